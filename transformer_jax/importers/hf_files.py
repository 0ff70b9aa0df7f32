"""A transformers checkpoint's files, read without trusting them: bounded JSON, safetensors
through NumPy, `pytorch_model.bin` through an unpickler that builds tensors and nothing else,
sharded checkpoints (`*.index.json`), and a Hub repo id resolved by `huggingface_hub`.

Whoever published the checkpoint wrote these files, so each is a one-line `UserInputError`
naming the file when it is not what it claims. No pickled code ever runs: the `.bin` reader's
`find_class` knows four names (an OrderedDict, torch's tensor rebuild, its storage types) and
refuses every other before anything is constructed; torch itself is never imported.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pickle
import re
import struct
import zipfile
from typing import Any

import numpy as np

from transformer_jax.common.errors import UserInputError, one_line
from transformer_jax.importers import bounded_yaml

# config.json, vocab.json and index files: a 250k-piece vocab.json is ~6 MB.
MAX_JSON_BYTES = bounded_yaml.MAX_VOCABULARY_BYTES
# A config nests 3 deep (id2label, task_specific_params); 64 is far beyond, and far below
# Python's recursion limit, which a run of '[' would otherwise hit inside json.
MAX_JSON_DEPTH = 64
# safetensors' own cap on its header (the Rust crate refuses larger).
MAX_SAFETENSORS_HEADER = 100 << 20
SAFETENSORS_DTYPES = {'F32': np.float32, 'F16': np.float16, 'BF16': 'bf16', 'F64': np.float64}
# torch storage class -> (NumPy dtype, bytes); bfloat16 is read as uint16 and widened.
_TORCH_STORAGES = {
  'FloatStorage': (np.float32, 4),
  'HalfStorage': (np.float16, 2),
  'BFloat16Storage': (np.uint16, 2),
  'DoubleStorage': (np.float64, 8),
}
# A transformers model folder's config (not our workdir's, whose names live in workdir/layout.py).
HF_CONFIG = 'config.json'
# The files a MarianMT checkpoint is made of (snapshot_download fetches only these).
HUB_FILES = [
  HF_CONFIG,
  'generation_config.json',
  'tokenizer_config.json',
  'special_tokens_map.json',
  'added_tokens.json',
  'vocab.json',
  'target_vocab.json',
  'source.spm',
  'target.spm',
  '*.safetensors',
  '*.safetensors.index.json',
  'pytorch_model*.bin',
  'pytorch_model.bin.index.json',
]
_REPO_ID = re.compile(r'[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}')


def read_json(path: str, what: str) -> Any:
  """The JSON value of `path` (a `what`), at most MAX_JSON_BYTES and MAX_JSON_DEPTH deep."""
  data = bounded_yaml.read_bounded(path, MAX_JSON_BYTES, what)
  depth = deepest = 0
  in_string = escaped = False
  for char in data.decode('utf-8', errors='replace'):  # Brackets outside strings.
    if in_string:
      escaped, in_string = (False, True) if escaped else (char == '\\', char != '"')
    elif char == '"':
      in_string = True
    elif char in '[{':
      depth += 1
      deepest = max(deepest, depth)
    elif char in ']}':
      depth -= 1
  if deepest > MAX_JSON_DEPTH:
    raise UserInputError(f'{path}: nests {deepest} deep, more than {MAX_JSON_DEPTH} (not a {what})')
  try:
    return json.loads(data)
  except (ValueError, RecursionError) as error:
    raise UserInputError(f'{path}: not JSON ({one_line(error)})') from None


# --- safetensors -------------------------------------------------------------------------------


def _widen_bf16(raw: np.ndarray) -> np.ndarray:
  """bfloat16 bits (uint16) as float32: they are float32's upper half, exactly."""
  return (raw.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """Name -> float32 array of a `.safetensors` file: an 8-byte header size, a JSON header of
  {name: {dtype, shape, data_offsets}}, then the data. Offsets, sizes and dtypes are checked
  against the file before anything is read."""
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    head = f.read(8)
    (length,) = struct.unpack('<Q', head) if len(head) == 8 else (size,)
    if length > min(MAX_SAFETENSORS_HEADER, size - 8):
      raise UserInputError(f'{path}: not a safetensors file (header of {length} bytes)')
    try:
      header = json.loads(f.read(length))
    except (ValueError, RecursionError) as error:
      raise UserInputError(f'{path}: not a safetensors file ({one_line(error)})') from None
    if not isinstance(header, dict):
      raise UserInputError(f'{path}: not a safetensors file (its header is not a map)')
    header.pop('__metadata__', None)
    start, arrays = 8 + length, {}
    for name, entry in sorted(header.items(), key=lambda item: str(item[1])):
      entry = entry if isinstance(entry, dict) else {}
      kind, shape, offsets = entry.get('dtype'), entry.get('shape'), entry.get('data_offsets')
      if kind not in SAFETENSORS_DTYPES:
        raise UserInputError(f'{path}: tensor {name} is {kind!r:.40}, expected a float type')
      dtype = SAFETENSORS_DTYPES[kind]
      itemsize = 2 if dtype == 'bf16' else np.dtype(dtype).itemsize
      good = isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
      good = good and isinstance(offsets, list) and len(offsets) == 2
      good = good and all(isinstance(n, int) for n in offsets)
      if not good or not 0 <= offsets[0] <= offsets[1] <= size - start:
        raise UserInputError(f'{path}: tensor {name} has a bad shape or data_offsets')
      if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        why = f'declares {kind}{shape} but holds {offsets[1] - offsets[0]} bytes'
        raise UserInputError(f'{path}: tensor {name} {why}')
      f.seek(start + offsets[0])
      raw = np.frombuffer(f.read(offsets[1] - offsets[0]), np.uint16 if dtype == 'bf16' else dtype)
      arrays[name] = (_widen_bf16(raw) if dtype == 'bf16' else raw.astype(np.float32)).reshape(
        shape
      )
  return arrays


# --- pytorch_model.bin -------------------------------------------------------------------------


class _Storage:
  """A torch storage type named in the pickle (`torch.FloatStorage`): a dtype, no code."""

  def __init__(self, name: str):
    self.name = name


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, *rest):
  """torch._utils._rebuild_tensor_v2's arguments -> a NumPy array (a copy), bounds checked."""
  ints = lambda value: isinstance(value, tuple) and all(isinstance(n, int) for n in value)  # noqa: E731
  if not (isinstance(storage, np.ndarray) and isinstance(offset, int) and ints(size)):
    raise pickle.UnpicklingError('a tensor of unexpected form')
  if not ints(stride) or len(stride) != len(size) or min((*size, *stride, offset, 0)) < 0:
    raise pickle.UnpicklingError('a tensor of unexpected form')
  if hooks:  # Backward hooks are code.
    raise pickle.UnpicklingError('a tensor with backward hooks')
  if math.prod(size) and offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.size:
    raise pickle.UnpicklingError('a tensor beyond its storage')
  item = storage.itemsize
  view = np.lib.stride_tricks.as_strided(
    storage[offset:], shape=size, strides=[s * item for s in stride]
  )
  array = np.array(view)
  return _widen_bf16(array) if array.dtype == np.uint16 else array.astype(np.float32)


class _TensorsOnly(pickle.Unpickler):
  def __init__(self, file, archive: zipfile.ZipFile, prefix: str, path: str):
    super().__init__(file)
    self.archive, self.prefix, self.path = archive, prefix, path

  def find_class(self, module: str, name: str):
    if (module, name) == ('collections', 'OrderedDict'):
      return collections.OrderedDict
    if (module, name) == ('torch._utils', '_rebuild_tensor_v2'):
      return _rebuild_tensor
    if module == 'torch' and name in _TORCH_STORAGES:
      return _Storage(name)
    raise UserInputError(
      f'{self.path}: holds a pickled {module}.{name:.100}, not only tensors; refused '
      '(nothing in it was run)'
    )

  def persistent_load(self, pid):
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == 'storage'):
      raise pickle.UnpicklingError(f'an unknown persistent id {pid!r:.80}')
    _, kind, key, _, numel = pid
    if not isinstance(kind, _Storage) or not isinstance(key, str) or not isinstance(numel, int):
      raise pickle.UnpicklingError(f'an unknown storage {pid!r:.80}')
    dtype, item = _TORCH_STORAGES[kind.name]
    try:
      info = self.archive.getinfo(f'{self.prefix}/data/{key}')
    except KeyError:
      raise pickle.UnpicklingError(f'storage {key!r:.40} is missing') from None
    if info.file_size != numel * item:
      raise pickle.UnpicklingError(f'storage {key!r:.40} holds {info.file_size} bytes')
    return np.frombuffer(self.archive.read(info), dtype)


def read_torch_bin(path: str) -> dict[str, np.ndarray]:
  """Name -> float32 array of a `torch.save`d state dict (the zip format of torch >= 1.6)."""
  try:
    archive = zipfile.ZipFile(path)
  except (zipfile.BadZipFile, OSError):
    raise UserInputError(
      f"{path}: not a zip-format torch checkpoint (torch < 1.6's format, or not one); "
      'resave it with a newer torch or as safetensors'
    ) from None
  with archive:
    pickles = [n for n in archive.namelist() if n.endswith('/data.pkl') and n.count('/') == 1]
    if len(pickles) != 1:
      raise UserInputError(f'{path}: not a torch checkpoint (no single */data.pkl)')
    prefix = pickles[0].split('/')[0]
    byteorder = f'{prefix}/byteorder'
    if byteorder in archive.namelist() and archive.read(byteorder).strip() != b'little':
      raise UserInputError(f'{path}: a big-endian torch checkpoint is not supported')
    with archive.open(pickles[0]) as f:
      try:
        state = _TensorsOnly(f, archive, prefix, path).load()
      except UserInputError:
        raise
      except Exception as error:  # pickle raises many kinds on damaged data
        raise UserInputError(f'{path}: not a state dict of tensors ({one_line(error)})') from None
  if not isinstance(state, dict) or not all(
    isinstance(k, str) and isinstance(v, np.ndarray) for k, v in state.items()
  ):
    raise UserInputError(f'{path}: not a state dict (a map of names to tensors)')
  return dict(state)


# --- A checkpoint folder -----------------------------------------------------------------------


def _read_weights_file(path: str) -> dict[str, np.ndarray]:
  return read_safetensors(path) if path.endswith('.safetensors') else read_torch_bin(path)


def read_weights(folder: str) -> tuple[dict[str, np.ndarray], list[str]]:
  """(name -> float32 array, the files read) of a transformers folder: model.safetensors, its
  sharded index, pytorch_model.bin or its index, in transformers' order of preference."""
  for single, index in (
    ('model.safetensors', 'model.safetensors.index.json'),
    ('pytorch_model.bin', 'pytorch_model.bin.index.json'),
  ):
    if os.path.exists(os.path.join(folder, single)):
      return _read_weights_file(os.path.join(folder, single)), [single]
    index_path = os.path.join(folder, index)
    if os.path.exists(index_path):
      mapping = read_json(index_path, 'checkpoint index').get('weight_map')
      if not isinstance(mapping, dict) or not all(
        isinstance(v, str) and os.path.basename(v) == v and not v.startswith('.')
        for v in mapping.values()
      ):
        raise UserInputError(f'{index_path}: weight_map must map names to files of this folder')
      arrays: dict[str, np.ndarray] = {}
      shards = sorted(set(mapping.values()))
      for shard in shards:
        shard_path = os.path.join(folder, shard)
        if not os.path.exists(shard_path):
          raise UserInputError(f'{index_path}: shard {shard} is missing')
        for name, array in _read_weights_file(shard_path).items():
          if mapping.get(name) != shard:
            raise UserInputError(f'{shard_path}: tensor {name} is not in {index} for this shard')
          arrays[name] = array
      for name in sorted(set(mapping) - set(arrays))[:1]:
        raise UserInputError(f'{index_path}: tensor {name} is in no shard')
      return arrays, [index, *shards]
  raise UserInputError(
    f'--model={folder}: no weights (model.safetensors, pytorch_model.bin or a sharded *.index.json)'
  )


def is_repo_id(model: str) -> bool:
  """A Hub repo id (owner/name) that is not a path here."""
  return bool(_REPO_ID.fullmatch(model)) and not os.path.exists(model)


def resolve_repo(repo_id: str) -> str:
  """The local snapshot folder of Hub repo `repo_id`: downloaded (its MarianMT files only) with
  network, the cache's with HF_HUB_OFFLINE=1, else one line saying what is missing."""
  try:
    import huggingface_hub
    from huggingface_hub import constants
  except ImportError:
    raise UserInputError(
      f'--model={repo_id}: no such folder; a Hub repo id needs huggingface_hub '
      "(pip install -e '.[hub]')"
    ) from None
  try:
    return huggingface_hub.snapshot_download(repo_id, allow_patterns=HUB_FILES)
  except Exception as error:  # its errors: offline, not found, gated, network
    if constants.HF_HUB_OFFLINE:
      raise UserInputError(
        f'--model={repo_id}: no such folder, and the repo is not in the Hugging Face cache '
        f'({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1'
      ) from None
    raise UserInputError(f'--model={repo_id}: download failed: {one_line(error)}') from None
