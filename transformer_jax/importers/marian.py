"""Marian / OPUS-MT transformer checkpoints (`.npz`) as transformer_jax models, exactly.

`read_model` reads a Marian `.npz` (numpy, no pickles) and its vocabulary, and returns our
`TransformerConfig`, a parameter tree (numpy float32) and a SentencePiece model in our id order:

  positions  Marian's [sin | cos] halves, timescales 10000^(i/(d/2-1)), from position 0
             (`sinusoid_layout='concatenated'`); layer norm epsilon 1e-6; x sqrt(d) embeddings.
  attention  Marian's query/key/value/output biases (`attention_bias`).
  ids        Marian: </s>=0, <unk>=1, no BOS, no PAD. Ours: PAD=0, EOS=1, BOS=2, UNK=3, so our
             id = {marian 0 -> 1, 1 -> 3, k >= 2 -> k + 2}. The PAD and BOS embedding rows are
             zero: our first decoder input, BOS at position 0, is sqrt(d) * 0 + P[0], Marian's
             zero start embedding. Their logits get MASKED_LOGIT_BIAS (`logits_bias`, which
             also carries Marian's `decoder_ff_logit_out_b`).
  vocabulary Marian's ids come from a `.yml` (`piece: id`) or a `.spm` (eos_id=0, unk_id=1);
             OPUS-MT segments sources with `source.spm`, targets with `target.spm`. Ours keeps
             each .spm's normaliser, model type and scores (one model per side, the same ids);
             .yml pieces it lacks are UNUSED (never produced by segmentation, still decoded);
             .spm pieces the .yml lacks (Marian reads them as <unk>) come last, with <unk>'s
             rows. Segmentation and ids are then what Marian reads.

What the model cannot represent is a one-line `UserInputError` naming the file and the option
or tensor. Sources: marian-dev src/models/transformer.h, src/layers/{embedding,output}.cpp,
src/common/config_parser.cpp.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import zipfile
import zlib
from typing import Any

import numpy as np

from transformer_jax.common.errors import UserInputError, is_integer, one_line
from transformer_jax.common.paths import file_sha256
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.importers import bounded_yaml
from transformer_jax.importers.marian_vocabulary import read_vocabulary, sentencepiece_vocabulary
from transformer_jax.model.config import TransformerConfig

# Logit bias of the ids Marian has no use for (PAD, BOS, copies of <unk>): exp(-30) is
# negligible in the softmax, so they are never chosen, and unlike -1e9 a label-smoothed
# fine-tuning loss (which spreads 0.1 / (V - 1) over every id) stays finite and moderate.
MASKED_LOGIT_BIAS = -30.0
META_KEY = 'special:model.yml'
MARIAN_EOS, MARIAN_UNK = 0, 1  # Hard-wired in Marian (data/default_vocab.cpp).

# special:model.yml keys (models/encoder_decoder.cpp modelFeatures_) that change nothing at
# inference here: RNN/BERT/ULR/AAN settings Marian stores for every model, and guided alignment,
# which only picks the decoder layer whose cross-attention is trained to align.
_IGNORED_OPTIONS = frozenset(
  'version dim-rnn enc-cell enc-type enc-cell-depth dec-cell dec-cell-base-depth '
  'dec-cell-high-depth skip layer-normalization special-vocab transformer-rnn-projection '
  'transformer-dim-aan transformer-aan-depth transformer-aan-activation transformer-aan-nogate '
  'transformer-guided-alignment-layer transformer-depth-scaling bert-train-type-embeddings '
  'bert-type-vocab-size ulr-trainable-transformation ulr-dim-emb lemma-dependency '
  'factors-combine separator-symbol transformer-alibi-shift transformer-alibi-trainable'.split()
)
# Checked options: key -> (Marian's default (common/config_parser.cpp), the values we support,
# why). Older models lack newer keys; a key Marian had no value for is stored as null. The sizes,
# tying and norm options (`_FREE`) are checked against each other and the tensors instead.
_SUPPORTED: dict[str, tuple[Any, tuple, str]] = {
  'type': ('amun', ('transformer',), "only Marian's 'transformer' models"),
  'right-left': (False, (False,), 'the model writes its output reversed'),
  'transformer-no-projection': (False, (False,), 'attention without output projection'),
  'transformer-pool': (False, (False,), 'cross-attention replaced by pooling'),
  'transformer-no-bias': (False, (False,), 'linear layers without biases'),
  'transformer-no-affine': (False, (False,), 'layer norms without scale and bias'),
  'transformer-disable-position-embeddings': (False, (False,), 'no position encodings'),
  'transformer-attention-mask': ('default', ('default',), 'only the default mask (no alibi)'),
  'transformer-tied-layers': ([], ([],), 'decoder layers sharing weights'),
  'transformer-decoder-autoreg': ('self-attention', ('self-attention',), 'no AAN, no rnn'),
  'transformer-ffn-depth': (2, (2,), 'only 2 FFN linears'),
  'transformer-decoder-ffn-depth': (0, (0, 2), 'only 2 FFN linears'),  # 0: as the encoder's
  'transformer-ffn-activation': ('swish', ('swish', 'relu', 'gelu'), 'swish, relu or gelu'),
  'transformer-postprocess-emb': ('d', ('', 'd'), 'no layer norm after the embeddings'),
  'ulr': (False, (False,), 'universal language representation embeddings'),
  'lemma-dim-emb': (0, (0,), 'factored vocabularies'),
  'factors-dim-emb': (0, (0,), 'factored vocabularies'),
  'input-types': ([], ([], ['sequence']), 'inputs other than one sequence'),
}
_FREE: dict[str, Any] = {
  'dim-vocabs': [0, 0],
  'dim-emb': 512,
  'enc-depth': 1,
  'dec-depth': 1,
  'transformer-heads': 8,
  'transformer-dim-ffn': 2048,
  'transformer-decoder-dim-ffn': 0,
  'transformer-preprocess': '',
  'transformer-postprocess': 'dan',
  'transformer-postprocess-top': '',
  'output-omit-bias': False,
  'tied-embeddings': False,
  'tied-embeddings-src': False,
  'tied-embeddings-all': False,
  # --type transformer reads another key and always uses sinusoids (a `Wpos` is refused).
  'transformer-train-position-embeddings': False,
}
# (preprocess, postprocess, postprocess-top) -> pre_norm. 'd' (dropout) is a no-op at
# inference; our dropout sits where Marian's does in these two.
_NORM_LAYOUTS = {('', 'dan', ''): False, ('n', 'da', 'n'): True}
# What every Marian transformer is in our terms (module docstring); eps: layers/generic.h.
_MARIAN = dict(
  attention_bias=True,
  sinusoid_layout='concatenated',
  learned_positions=False,
  layer_norm_epsilon=1e-6,
  logits_bias=True,
)
# Marian's gelu was x * sigmoid(1.702 x) until v1.12.2 and is exact (erf) from v1.12.3 on
# (commit d225c24d, 2023-03-01, "fully correct version of GELU").
_EXACT_GELU_SINCE = (1, 12, 3)


# --- The .npz ----------------------------------------------------------------------------------

# Marian (cnpy::npz_save) and np.savez store tensors uncompressed and float weights barely
# deflate (np.savez_compressed saves ~7%), so members that declare more than MAX_EXPANSION times
# the file's bytes (beyond the allowance) are a zip bomb, refused before anything is inflated.
MAX_EXPANSION = 16
EXPANSION_ALLOWANCE = 64 << 20
# What a damaged member raises: bad CRC, headers, flags or deflate data (zlib.error, EOFError).
_DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, NotImplementedError)


def _open_npz(path: str) -> zipfile.ZipFile:
  if not os.path.exists(path):
    raise FileNotFoundError(f'Marian model not found: {path}')
  if not os.path.isfile(path):
    raise UserInputError(f'{path}: not a regular file (a Marian .npz model is expected)')
  try:
    return zipfile.ZipFile(path)
  except _DAMAGED as error:
    with open(path, 'rb') as f:
      if f.read(6) == b'\x93NUMPY':
        raise UserInputError(f'{path}: a single .npy array, not a Marian .npz model') from None
    raise UserInputError(f'{path}: not a Marian .npz model ({one_line(error)})') from None


@contextlib.contextmanager
def _member(archive: zipfile.ZipFile, info: zipfile.ZipInfo):
  """The open member; what a damaged one raises is one line naming the file and the member."""
  try:
    with archive.open(info) as f:
      yield f
  except _DAMAGED as error:
    if isinstance(error, UserInputError):
      raise
    why = f'member {info.filename} is damaged ({one_line(error)})'
    raise UserInputError(f'{archive.filename}: {why}') from None


def _npz_headers(archive: zipfile.ZipFile) -> dict[str, tuple[zipfile.ZipInfo, tuple, Any]]:
  """Name -> (ZipInfo, shape, dtype) of each member, from the zip directory and the .npy
  headers alone, each member a .npy of exactly the bytes its header declares (zipfile inflates
  no more than a member's declared size), no pickles, no zip bomb."""
  infos, path, seen = archive.infolist(), archive.filename, set()
  for info in infos:
    why = None if info.filename.endswith('.npy') else 'is not a .npy array'
    why = 'appears twice' if info.filename in seen else why
    why = 'is encrypted' if info.flag_bits & 0x1 else why
    seen.add(info.filename)
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
      why = f'is compressed with zip method {info.compress_type} (only stored or deflated)'
    if why:
      raise UserInputError(f'{path}: member {info.filename} {why}')
  declared, size = sum(info.file_size for info in infos), os.path.getsize(path)
  if declared > max(MAX_EXPANSION * size, EXPANSION_ALLOWANCE):
    raise UserInputError(
      f'{path}: its members inflate to {declared} bytes, more than {MAX_EXPANSION} times the '
      f"file's {size} (a zip bomb, not a model)"
    )
  headers = {}
  for info in infos:
    with _member(archive, info) as f:
      version = np.lib.format.read_magic(f)
      if version not in ((1, 0), (2, 0)):
        raise ValueError(f'.npy version {version}, not 1.0 or 2.0')
      shape, _, dtype = getattr(np.lib.format, f'read_array_header_{version[0]}_0')(f)
      data_bytes, declared = info.file_size - f.tell(), math.prod(shape) * dtype.itemsize
    if dtype.hasobject:  # np.load(allow_pickle=False)'s words.
      why = 'Object arrays cannot be loaded when allow_pickle=False'
      raise UserInputError(f'{path}: tensor {info.filename[:-4]}: {why}')
    if min(shape, default=0) < 0 or declared != data_bytes:
      why = f'declares {dtype}{list(shape)} ({declared} bytes) but holds {data_bytes} bytes'
      raise UserInputError(f'{path}: member {info.filename} {why}')
    headers[info.filename[:-4]] = info, shape, dtype
  return headers


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
  with _member(archive, info) as f:
    array = np.lib.format.read_array(f, allow_pickle=False)
    f.read(1)  # Reaches the member's end, where zipfile checks its CRC.
  return array


def read_npz(path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, np.ndarray], int]:
  """(options of special:model.yml, what they decide (`check_options`), float32 tensors,
  Marian's vocabulary size) of a Marian .npz. Every member is checked (`_npz_headers`), and
  every tensor's shape against the options (`check_tensors`), before any tensor is read."""
  with _open_npz(path) as archive:
    headers = _npz_headers(archive)
    if META_KEY not in headers:
      raise UserInputError(f'{path}: no {META_KEY} (not a Marian model, or saved without options)')
    info, shape, dtype = headers.pop(META_KEY)
    limit = bounded_yaml.MAX_OPTIONS_BYTES
    if len(shape) != 1 or dtype.itemsize != 1 or dtype.kind not in 'iu' or shape[0] > limit:
      expected = f'expected int8[n], n <= {limit}'
      raise UserInputError(f'{path}: {META_KEY} is {dtype}{list(shape)}, {expected}')
    options = _parse_meta(_read_member(archive, info), path)
    layout = check_options(options, path)
    for name, (_, _, dtype) in headers.items():
      if dtype not in (np.float32, np.float16):
        raise UserInputError(f'{path}: tensor {name} is {dtype}, expected float32')
    vocab_size = check_tensors({name: h[1] for name, h in headers.items()}, layout, path)
    arrays = {
      name: _read_member(archive, info).astype(np.float32, copy=False)
      for name, (info, _, _) in headers.items()
    }
  return options, layout, arrays, vocab_size


def _parse_meta(meta: np.ndarray, path: str) -> dict[str, Any]:
  """The YAML text before the first NUL (Marian >= 2025-05 pads it with NULs to 256 bytes)."""
  text = meta.tobytes().split(b'\0', 1)[0].decode('utf-8', errors='replace')
  options = bounded_yaml.load(text, f'{path}: {META_KEY}')
  if not isinstance(options, dict):
    raise UserInputError(f'{path}: {META_KEY} is not a YAML map of options ({options!r:.200})')
  for key in options:
    if not isinstance(key, str):
      raise UserInputError(f'{path}: {META_KEY}: option name {key!r:.100} is not text')
  return options


# --- Options -----------------------------------------------------------------------------------


def _option(options: dict, key: str) -> Any:
  value = options.get(key)
  return (_SUPPORTED[key][0] if key in _SUPPORTED else _FREE[key]) if value is None else value


def check_options(options: dict, path: str) -> dict[str, Any]:
  """The options that decide our model, after refusing those it cannot represent.

  Returns our TransformerConfig fields d_model, d_ff, num_heads, num_{encoder,decoder}_layers,
  pre_norm, ffn_activation, and Marian's 'embeddings' ('all' | 'src' | 'target' | 'none', see
  `_embedding_layout`) and 'logits_bias' (whether the .npz has one).
  """

  def refuse(key: str, why: str):
    raise UserInputError(f'{path}: option {key}={options.get(key)!r:.100} is not supported: {why}')

  unknown = sorted(set(options) - set(_SUPPORTED) - set(_FREE) - _IGNORED_OPTIONS)
  if unknown:
    what = 'a newer Marian, or not a transformer'
    names = ', '.join(unknown)
    raise UserInputError(f'{path}: unknown option(s) {names:.300} in {META_KEY} ({what})')
  for key, (_, allowed, why) in _SUPPORTED.items():
    if _option(options, key) not in allowed:
      refuse(key, why)
  vocabs = _option(options, 'dim-vocabs')
  if not isinstance(vocabs, list) or len(vocabs) != 2:
    refuse('dim-vocabs', 'one encoder and one decoder (no multi-source models)')
  layout = tuple(
    str(_option(options, f'transformer-{k}'))
    for k in ('preprocess', 'postprocess', 'postprocess-top')
  )
  if layout not in _NORM_LAYOUTS:
    raise UserInputError(
      f'{path}: transformer-preprocess/postprocess/postprocess-top = {"/".join(layout)} is not '
      "supported: only post-norm ''/dan/'' and pre-norm n/da/n"
    )
  d_model, heads = _option(options, 'dim-emb'), _option(options, 'transformer-heads')
  if not (is_integer(d_model) and is_integer(heads) and heads > 0 < d_model):
    refuse('transformer-heads', f'sizes must be positive integers (dim-emb={d_model!r})')
  if d_model % heads or d_model % 2:
    refuse('dim-emb', f'must be even and divisible by transformer-heads={heads}')
  for key in ('enc-depth', 'dec-depth', 'transformer-dim-ffn'):
    if not is_integer(_option(options, key)) or _option(options, key) <= 0:
      refuse(key, 'must be a positive integer')
  d_ff = _option(options, 'transformer-dim-ffn')
  if _option(options, 'transformer-decoder-dim-ffn') not in (0, d_ff):
    refuse('transformer-decoder-dim-ffn', f'one FFN size only (transformer-dim-ffn={d_ff})')
  return {
    'd_model': d_model,
    'num_heads': heads,
    'num_encoder_layers': _option(options, 'enc-depth'),
    'num_decoder_layers': _option(options, 'dec-depth'),
    'd_ff': d_ff,
    'pre_norm': _NORM_LAYOUTS[layout],
    'ffn_activation': _activation(options, path),
    'embeddings': _embedding_layout(options),
    'logits_bias': not _option(options, 'output-omit-bias'),
  }


def _activation(options: dict, path: str) -> str:
  name = _option(options, 'transformer-ffn-activation')
  if name != 'gelu':
    return name
  version = str(options.get('version') or '')
  match = re.match(r'v?(\d+)\.(\d+)\.(\d+)', version)
  if not match:
    raise UserInputError(
      f'{path}: option version={version!r}: cannot tell which gelu this Marian used '
      f'(x * sigmoid(1.702 x) before v1.12.3, erf after)'
    )
  return 'gelu' if tuple(map(int, match.groups())) >= _EXACT_GELU_SINCE else 'gelu_sigmoid'


def _embedding_layout(options: dict) -> str:
  """'all': one `Wemb` in and out; 'src': `Wemb` in, an untied output; 'target': encoder_Wemb,
  decoder_Wemb, output = decoder_Wemb; 'none': both embeddings and the output apart (Marian
  layers/embedding.cpp createEmbeddingLayer, models/transformer.h output layer)."""
  if _option(options, 'tied-embeddings-all'):
    return 'all'
  if _option(options, 'tied-embeddings-src'):
    return 'all' if _option(options, 'tied-embeddings') else 'src'
  return 'target' if _option(options, 'tied-embeddings') else 'none'


def _layer_tensors(layout: dict) -> dict[str, list[tuple[str, tuple[str, ...], tuple, tuple]]]:
  """Per stack: (Marian name after `{side}_l{i}_`, our path in the layer, Marian's shape, our
  per-layer shape). Linear weights are [in, out] in both; head j of W{q,k,v} is columns
  j*dk:(j+1)*dk, of Wo rows j*dk:(j+1)*dk (transformer.h SplitHeads / JoinHeads)."""
  d, f, h = layout['d_model'], layout['d_ff'], layout['num_heads']
  dk, pre = d // h, '_pre' if layout['pre_norm'] else ''

  def attention(ours: str, marian: str) -> list:
    qkv = (('q', 'query'), ('k', 'key'), ('v', 'value'))
    rows = [(f'{marian}_W{p}', (ours, n, 'kernel'), (d, d), (d, h, dk)) for p, n in qkv]
    rows += [(f'{marian}_b{p}', (ours, n, 'bias'), (1, d), (h, dk)) for p, n in qkv]
    rows.append((f'{marian}_Wo', (ours, 'out', 'kernel'), (d, d), (h, dk, d)))  # [h, dk, m]
    return rows + [(f'{marian}_bo', (ours, 'out', 'bias'), (1, d), (d,))]  # W{q,k,v}: [m, h, dk]

  def norm(ours: str, marian: str) -> list:  # Marian's LN names: prefix + '_ln_scale' (+ _pre)
    return [(f'{marian}_ln_{k}{pre}', (ours, 'norm', k), (1, d), (d,)) for k in ('scale', 'bias')]

  ffn = [
    ('ffn_W1', ('ffn', 'wi', 'kernel'), (d, f), (d, f)),
    ('ffn_b1', ('ffn', 'wi', 'bias'), (1, f), (f,)),
    ('ffn_W2', ('ffn', 'wo', 'kernel'), (f, d), (f, d)),
    ('ffn_b2', ('ffn', 'wo', 'bias'), (1, d), (d,)),
  ] + norm('ffn_block', 'ffn_ffn')
  self_attention = attention('self_attention', 'self')
  cross = attention('cross_attention', 'context') + norm('cross_attention_block', 'context_Wo')
  return {
    'encoder': self_attention + norm('attention_block', 'self_Wo') + ffn,
    'decoder': self_attention + norm('self_attention_block', 'self_Wo') + cross + ffn,
  }


def expected_shapes(layout: dict, vocab_size: int, legacy_output: bool) -> dict[str, tuple]:
  """Name -> shape of every tensor Marian saves for `layout` (besides special:model.yml)."""
  d, v = layout['d_model'], vocab_size
  shapes: dict[str, tuple] = {}
  for side, rows in _layer_tensors(layout).items():
    for i in range(1, layout[f'num_{side}_layers'] + 1):
      shapes.update({f'{side}_l{i}_{name}': shape for name, _, shape, _ in rows})
    if layout['pre_norm']:
      shapes[f'{side}_top_ln_scale'] = shapes[f'{side}_top_ln_bias'] = (1, d)
  if layout['embeddings'] in ('all', 'src'):
    shapes['Wemb'] = (v, d)
  else:
    shapes['encoder_Wemb'] = shapes['decoder_Wemb'] = (v, d)
  if layout['embeddings'] in ('src', 'none'):
    shapes['decoder_ff_logit_out_W' if legacy_output else 'decoder_ff_logit_out_Wt'] = (
      (d, v) if legacy_output else (v, d)
    )
  if layout['logits_bias']:
    shapes['decoder_ff_logit_out_b'] = (1, v)
  return shapes


def check_tensors(shapes: dict[str, tuple], layout: dict, path: str) -> int:
  """Refuses missing, unknown and misshapen tensors (name -> shape, as the .npz declares them);
  returns Marian's vocabulary size."""
  table = 'Wemb' if layout['embeddings'] in ('all', 'src') else 'encoder_Wemb'
  if len(shapes.get(table, ())) != 2:
    raise UserInputError(f'{path}: tensor {table} [vocab, dim-emb] is missing or not 2-D')
  vocab_size = shapes[table][0]
  target = shapes.get('decoder_Wemb')
  if table == 'encoder_Wemb' and len(target or ()) == 2 and target[0] != vocab_size:
    raise UserInputError(
      f'{path}: separate source ({vocab_size}) and target ({target[0]}) vocabularies are '
      'not supported: transformer_jax models share one vocabulary'
    )
  if layout['num_encoder_layers'] + layout['num_decoder_layers'] > len(shapes):  # 16 a layer
    why = f'more layers than the file has tensors ({len(shapes)})'
    raise UserInputError(f'{path}: options enc-depth, dec-depth: {why}')
  legacy = 'decoder_ff_logit_out_W' in shapes and 'decoder_ff_logit_out_Wt' not in shapes
  expected = expected_shapes(layout, vocab_size, legacy)
  for name in sorted(expected.keys() - shapes.keys())[:1]:
    raise UserInputError(f'{path}: tensor {name} {list(expected[name])} is missing')
  for name in sorted(shapes.keys() - expected.keys())[:1]:
    hint = ' (learned positions)' if name == 'Wpos' else ''
    raise UserInputError(f'{path}: unknown tensor {name}{list(shapes[name])}{hint}')
  for name, shape in expected.items():
    if tuple(shapes[name]) != shape:
      raise UserInputError(
        f'{path}: tensor {name} has shape {list(shapes[name])}, expected {list(shape)}'
      )
  return vocab_size


# --- Parameters --------------------------------------------------------------------------------


def our_ids(marian_vocab_size: int) -> np.ndarray:
  """Our id of each Marian id: 0 (</s>) -> EOS, 1 (<unk>) -> UNK, k >= 2 -> k + 2."""
  ids = np.arange(marian_vocab_size) + 2
  ids[MARIAN_EOS], ids[MARIAN_UNK] = EOS_ID, UNK_ID
  return ids


def _rows(table: np.ndarray, vocab_size: int, extra: int) -> np.ndarray:
  """A Marian [V_marian, ...] table in our id order [vocab_size, ...]: PAD and BOS rows zero, the
  `extra` last rows (pieces Marian reads as <unk>) copies of <unk>'s."""
  out = np.zeros((vocab_size, *table.shape[1:]), np.float32)
  out[our_ids(table.shape[0])] = table
  out[vocab_size - extra :] = table[MARIAN_UNK]
  return out


def map_params(
  arrays: dict[str, np.ndarray], layout: dict, vocab_size: int, extra: int
) -> dict[str, Any]:
  """Marian's tensors as our parameter tree (the tree `Transformer(config).init` makes); our
  scanned layer stacks have a leading layer axis."""
  params: dict[str, Any] = {}
  for side, rows in _layer_tensors(layout).items():
    stack = params.setdefault(f'{side}_layers', {})
    depth = layout[f'num_{side}_layers']
    for name, path, _, shape in rows:
      node = stack
      for key in path[:-1]:
        node = node.setdefault(key, {})
      layers = [arrays[f'{side}_l{i}_{name}'].reshape(shape) for i in range(1, depth + 1)]
      node[path[-1]] = np.stack(layers)  # [layers, *shape]
    if layout['pre_norm']:  # The `*_top` norms after each stack (postprocess-top n).
      params[f'{side}_norm'] = {k: arrays[f'{side}_top_ln_{k}'][0] for k in ('scale', 'bias')}

  embeddings = layout['embeddings']
  if embeddings == 'all':
    params['shared_embedding'] = {'embedding': _rows(arrays['Wemb'], vocab_size, extra)}
  else:
    source = arrays['Wemb' if embeddings == 'src' else 'encoder_Wemb']
    target = arrays['Wemb' if embeddings == 'src' else 'decoder_Wemb']
    if embeddings == 'target':
      output = target  # Tied: logits = y @ decoder_Wemb^T; an untied copy is exact.
    elif 'decoder_ff_logit_out_Wt' in arrays:
      output = arrays['decoder_ff_logit_out_Wt']  # [V, m]
    else:
      output = arrays['decoder_ff_logit_out_W'].T  # Legacy [m, V] -> [V, m]
    params['source_embedding'] = {'embedding': _rows(source, vocab_size, extra)}
    params['target_embedding'] = {'embedding': _rows(target, vocab_size, extra)}
    params['output_projection'] = {'kernel': _rows(output, vocab_size, extra).T.copy()}  # [m, v]
  # MASKED_LOGIT_BIAS at PAD and BOS, and below <unk>'s at its copies (e^-30 of its probability).
  marian_vocab = vocab_size - 2 - extra
  bias = _rows(
    arrays.get('decoder_ff_logit_out_b', np.zeros((1, marian_vocab)))[0], vocab_size, extra
  )
  bias[[PAD_ID, BOS_ID]] = MASKED_LOGIT_BIAS
  bias[vocab_size - extra :] += MASKED_LOGIT_BIAS
  params['logits_bias'] = bias
  return params


# --- A model directory -------------------------------------------------------------------------


def find_model_files(directory: str) -> tuple[str, str, str | None, str | None]:
  """(npz, vocab, spm, target spm) of an OPUS-MT-style directory: its decoder.yml's model and
  vocabularies if present, else its one `*.npz` and `*vocab.yml`; `source.spm` (or the one
  `*.spm`); `target.spm` if present and not a copy of source.spm, else None."""

  def inside(name: str) -> str:
    return name if os.path.isabs(name) else os.path.join(directory, name)

  def contents(name: str) -> bytes:
    limit = bounded_yaml.MAX_VOCABULARY_BYTES
    return bounded_yaml.read_bounded(inside(name), limit, 'vocabulary')

  names = sorted(os.listdir(directory))
  npzs = [n for n in names if n.endswith('.npz')]
  vocabs = [n for n in names if n.endswith('vocab.yml')]
  decoder = os.path.join(directory, 'decoder.yml')
  if os.path.exists(decoder):
    npzs, vocabs = _decoder_yml(decoder, npzs, vocabs)
  if len(npzs) != 1:
    raise UserInputError(
      f'--model={directory}: expected one .npz model, found {len(npzs)} ({", ".join(npzs)}); '
      'give --model=FILE.npz'
    )
  vocabs = list(dict.fromkeys(vocabs))
  if len({contents(v) for v in vocabs}) > 1:
    raise UserInputError(
      f'--model={directory}: separate source and target vocabularies ({", ".join(vocabs)}) '
      'are not supported: transformer_jax models share one vocabulary'
    )
  if not vocabs:
    raise UserInputError(f'--model={directory}: no vocabulary (*.vocab.yml or *.spm); give --vocab')
  spms = [n for n in names if n.endswith('.spm')]
  spm = 'source.spm' if 'source.spm' in spms else (spms[0] if len(spms) == 1 else None)
  target = 'target.spm' if spm == 'source.spm' and 'target.spm' in spms else None
  if target and contents(target) == contents(spm):
    target = None
  return (
    inside(npzs[0]),
    inside(vocabs[0]),
    None if spm is None else inside(spm),
    None if target is None else inside(target),
  )


def _decoder_yml(path: str, npzs: list[str], vocabs: list[str]) -> tuple[list[str], list[str]]:
  """The models and vocabularies (lists of file names) a decoder.yml names, else npzs, vocabs."""
  settings = bounded_yaml.load_file(path, bounded_yaml.MAX_OPTIONS_BYTES, 'decoder.yml') or {}
  if not isinstance(settings, dict):
    raise UserInputError(f'{path}: not a YAML map of settings ({settings!r:.100})')
  for key in ('models', 'vocabs'):
    names = settings.get(key) or []
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
      raise UserInputError(f'{path}: {key} must be a list of file names, got {names!r:.100}')
  return settings.get('models') or npzs, settings.get('vocabs') or vocabs


# --- The whole import --------------------------------------------------------------------------


def read_model(
  model_path: str,
  vocab: str | None = None,
  spm: str | None = None,
  max_len: int = 512,
  target_spm: str | None = None,
) -> tuple[TransformerConfig, dict[str, Any], bytes, dict[str, Any], bytes | None]:
  """(config, params, vocabulary bytes, origin, target vocabulary bytes or None) of a Marian
  model (a .npz, or a directory, whose target.spm is found as its source.spm).

  The target vocabulary (from target_spm, OPUS-MT's target.spm) has the same pieces in the same
  ids and segments target text as Marian's training did; without one, the vocabulary segments
  both sides. origin records the files, the .npz's SHA-256, Marian's version string and the
  options used.
  """
  if os.path.isdir(model_path):
    found_npz, found_vocab, found_spm, found_target = find_model_files(model_path)
    npz_path, vocab = found_npz, vocab or found_vocab
    if spm is None and not vocab.endswith('.spm'):
      spm, target_spm = found_spm, target_spm or found_target
  else:
    npz_path = model_path
    if not os.path.exists(model_path):
      raise FileNotFoundError(f'Marian model not found: {model_path}')
    if vocab is None:
      raise UserInputError(f'--model={model_path} is a file: give its --vocab (and --spm)')
  if target_spm is not None and vocab.endswith(('.spm', '.model')):
    raise UserInputError(
      f'--target_spm={target_spm} with --vocab={vocab}: a .spm vocabulary segments both sides'
    )
  options, layout, arrays, marian_vocab_size = read_npz(npz_path)
  pieces, spm_path, yml_path = read_vocabulary(vocab, spm)
  if len(pieces) != marian_vocab_size:
    raise UserInputError(
      f'{vocab}: {len(pieces)} pieces, but the model {npz_path} has {marian_vocab_size}'
    )
  vocabulary, target_vocabulary, extra = sentencepiece_vocabulary(
    pieces, spm_path, yml_path, target_spm
  )
  vocab_size = marian_vocab_size + 2 + extra
  config = TransformerConfig(
    vocab_size=vocab_size,
    max_len=max_len,
    share_embeddings=layout['embeddings'] == 'all',
    **{k: v for k, v in layout.items() if k not in ('embeddings', 'logits_bias')},
    **_MARIAN,
  )
  params = map_params(arrays, layout, vocab_size, extra)
  origin = {
    'format': 'marian',
    'model': os.path.abspath(npz_path),
    'model_sha256': file_sha256(npz_path),
    'vocab': os.path.abspath(vocab),
    'spm': os.path.abspath(spm_path),
    'target_spm': os.path.abspath(target_spm) if target_spm else None,
    'marian_version': str(options.get('version') or ''),
    'options': json.loads(json.dumps({k: options[k] for k in sorted(options)}, default=str)),
    'mapped': {**layout, 'pieces_appended_as_unk': extra},
    'ignored_options': sorted(k for k in options if k in _IGNORED_OPTIONS and k != 'version'),
  }
  return config, params, vocabulary, origin, target_vocabulary
