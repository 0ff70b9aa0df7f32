"""Export to StableHLO: `python -m transformer_jax.export --format=stablehlo --out=DIR`.

What is exported: the whole search, one `jax.export` function per beam size (1 = greedy), each
calling this project's own `inference.greedy_decode` / `inference.beam_decode` (encoder, cache
creation and cached decoder steps, as `Translator` runs them) on parameters passed as its first
argument:

    search(parameters {name: dtype[...]}, source_ids int32[b, s], max_lengths int32[b],
           alpha float32[]) -> tokens int32[b, min(s + 50, max_len)]

`dtype` (`--dtype`, `Translator`'s inference dtype: float32, bfloat16 or float16; default the
model's own) is what the searches compute in and what the parameters' matrices are stored in
(`translator.cast_params`: kernels and embedding tables; biases and norm scales stay float32),
so the runner decodes as
`Translator(dtype=...)` does and reads half the bytes at 16 bits.

The batch b and the source length s are symbolic (1 <= s <= max_len): one artifact serves every
batch size and every length bucket, and the decode length is the Translator's,
min(bucket + 50, max_len), as a symbolic expression of s. Every model variant traces with
symbolic lengths (positions, masks and the cache are built from the shapes), so nothing is
bucketed at export time. The runner pads sources to the Translator's length buckets: each
batch shape compiles once, and a batch as the Translator forms it runs the Translator's very
computation (other batch sizes translate identically too; the tests check both). Greedy search
ignores max_lengths and alpha (its caps are applied when the output is cut, as in `Translator`).

DIR holds:

    greedy.jax_export, beam4.jax_export   `Exported.serialize()` of each search
    parameters.npz                        the parameters, flat names 'encoder_layers/ffn/wi/kernel'
                                          (numeric arrays only: loads with allow_pickle=False;
                                          bfloat16 ones as their uint16 bit patterns, see
                                          `stored_parameters`)
    sentencepiece.model                   the workdir's shared vocabulary
    manifest.json                         shapes, dtypes, special ids, defaults, lengths, jax
                                          version; for a MarianMT import's vocabulary,
                                          MarianTokenizer's rules ('marian_rules': special
                                          tokens, ids read as <unk>), which the runner applies
                                          before SentencePiece
    translate.py                          the runner (`stablehlo_runner.py`): jax, numpy and
                                          sentencepiece only
    README.md                             how to run it

Refused with a one-line error: unknown platform names, beam sizes that are not positive
integers, a --quantization other than float32 (--dtype chooses the parameters' type), a dtype
not among float32, bfloat16, float16, and the cuDNN attention kernel (`attention_impl='cudnn'`)
for any platform but CUDA alone.
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jax_export

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.common.log import log
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from transformer_jax.exporters import stablehlo_runner
from transformer_jax.inference.decoding import (
  EXTRA_DECODE_LENGTH,
  MIN_SOURCE_BUCKET,
  beam_decode,
  greedy_decode,
)
from transformer_jax.inference.options import check_dtype
from transformer_jax.inference.translator import Translator, check_decoding_options
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer
from transformer_jax.workdir.layout import Workdir

DEFAULT_BEAM_SIZES = (1, 4)
# CPU and NVIDIA GPUs from one artifact: the ops are the same, jax adds a platform argument.
DEFAULT_PLATFORMS = ('cpu', 'cuda')
_KNOWN_PLATFORMS = ('cpu', 'cuda', 'rocm', 'tpu')
DEFAULT_ALPHA = 0.6
DEFAULT_BATCH_SIZE = 64
PARAMETERS_FILE = 'parameters.npz'
SENTENCEPIECE_FILE = 'sentencepiece.model'
RUNNER_FILE = 'translate.py'
README_FILE = 'README.md'
# The runner is a library module of the package, not a command (it has no entry of its own);
# its copy in DIR runs as a script with this entry appended.
_SCRIPT_ENTRY = '\n\n\nif __name__ == "__main__":\n  sys.exit(main())\n'
_NAME_SEPARATOR = '/'


def search_file(beam_size: int) -> str:
  return 'greedy.jax_export' if beam_size == 1 else f'beam{beam_size}.jax_export'


# --- Checks ------------------------------------------------------------------------------------


def check_export_options(*, beam_sizes: Sequence[int], platforms: Sequence[str]) -> None:
  """One-line UserInputError for beam sizes or platforms that cannot be exported."""
  if isinstance(platforms, (str, bytes)) or not platforms:
    raise UserInputError(f'platforms must be a list of platform names, got {platforms!r}')
  if any(p not in _KNOWN_PLATFORMS for p in platforms) or len(set(platforms)) != len(platforms):
    raise UserInputError(
      f'platforms must be distinct names among {", ".join(_KNOWN_PLATFORMS)}, got {platforms!r}'
    )
  if isinstance(beam_sizes, (str, bytes)) or not beam_sizes:
    raise UserInputError(f'beam_sizes must be a list of positive integers, got {beam_sizes!r}')
  for beam_size in beam_sizes:
    if not is_integer(beam_size) or beam_size < 1:
      raise UserInputError(f'beam_sizes must be positive integers, got {beam_size!r}')
  if len(set(beam_sizes)) != len(beam_sizes):
    raise UserInputError(f'beam_sizes must be distinct, got {list(beam_sizes)}')


def check_exportable(config: TransformerConfig, platforms: Sequence[str]) -> None:
  """One-line UserInputError for a model variant that cannot be exported for `platforms`.

  Every other variant exports: the search runs the model's own code, whatever its switches.
  """
  if config.attention_impl == 'cudnn' and tuple(platforms) != ('cuda',):
    # The fused kernel exists on NVIDIA GPUs only, and jax lowers it only where cuDNN is found.
    raise UserInputError(
      "TransformerConfig.attention_impl='cudnn' exports for platforms=('cuda',) only "
      f'(from a GPU host), got platforms={tuple(platforms)!r}'
    )


def check_quantization(quantization: str) -> None:
  if quantization != 'float32':
    raise UserInputError(
      f'--quantization={quantization}: --format=stablehlo exports float32, bfloat16 or float16 '
      'parameters, chosen with --dtype (quantization is for --format=ctranslate2)'
    )


# --- Parameters ----------------------------------------------------------------------------------


def flatten_parameters(params) -> dict[str, np.ndarray]:
  """The nested parameter dict as {'encoder_layers/ffn/wi/kernel': array} (numpy, host)."""
  flat = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [str(key.key) for key in path]
    if any(_NAME_SEPARATOR in name for name in names):
      raise ValueError(f'parameter name {names} contains {_NAME_SEPARATOR!r}')
    flat[_NAME_SEPARATOR.join(names)] = np.asarray(leaf)
  return flat


def stored_parameters(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """What parameters.npz holds: the arrays, bfloat16 ones as their uint16 bit patterns. NumPy
  has no bfloat16 of its own: np.savez would write it as raw 2-byte voids that load back as
  bytes, not numbers; the manifest's parameters.dtypes_by_name says which to view back
  (`stablehlo_runner.load_parameters`)."""
  return {
    name: value.view(np.uint16) if value.dtype == jnp.bfloat16 else value
    for name, value in flat.items()
  }


def nest_parameters(flat: dict[str, Any]) -> dict:
  """The inverse of flatten_parameters (on arrays or tracers)."""
  nested: dict = {}
  for name, value in flat.items():
    *parents, leaf = name.split(_NAME_SEPARATOR)
    node = nested
    for parent in parents:
      node = node.setdefault(parent, {})
    node[leaf] = value
  return nested


# --- The exported searches -----------------------------------------------------------------------


def symbolic_source_shape(max_len: int):
  """(b, s): the batch and source length, 1 <= s <= max_len (the model's positions)."""
  return jax_export.symbolic_shape('b, s', constraints=(f's <= {max_len}',))


def decode_length(source_length, max_len: int):
  """The Translator's decode length for a padded source length: min(s + 50, max_len), also when
  s is symbolic (then a symbolic expression, min(s + 50, max_len) or max_len where decided)."""
  return jax.core.min_dim(source_length + EXTRA_DECODE_LENGTH, max_len)


def search_function(model: Transformer, beam_size: int):
  """search(parameters, source_ids, max_lengths, alpha) -> int32[b, decode length]: what
  `Translator.translate` computes for one batch (its beam search keeps the best hypothesis)."""
  max_len = model.config.max_len

  def search(parameters, source_ids, max_lengths, alpha):
    params = nest_parameters(parameters)
    max_decode_len = decode_length(source_ids.shape[1], max_len)
    if beam_size == 1:
      return greedy_decode(model, params, source_ids, max_decode_len=max_decode_len)
    tokens, _ = beam_decode(
      model,
      params,
      source_ids,
      beam_size=beam_size,
      alpha=alpha,
      max_decode_len=max_decode_len,
      max_lengths=max_lengths,
    )
    return tokens[:, 0]  # [b, beam, L] -> the best hypothesis [b, L]

  return search


def export_search(
  model: Transformer, flat_params: dict[str, np.ndarray], beam_size: int, platforms: Sequence[str]
) -> jax_export.Exported:
  batch, source_length = symbolic_source_shape(model.config.max_len)
  arguments = (
    {name: jax.ShapeDtypeStruct(value.shape, value.dtype) for name, value in flat_params.items()},
    jax.ShapeDtypeStruct((batch, source_length), jnp.int32),  # source ids
    jax.ShapeDtypeStruct((batch,), jnp.int32),  # max lengths
    jax.ShapeDtypeStruct((), jnp.float32),  # alpha
  )
  return jax_export.export(jax.jit(search_function(model, beam_size)), platforms=platforms)(
    *arguments
  )


# --- The directory -------------------------------------------------------------------------------


def manifest(
  config: TransformerConfig,
  flat_params: dict[str, np.ndarray],
  searches: dict[int, jax_export.Exported],
  *,
  default_beam_size: int,
  default_alpha: float,
  workdir: str,
  checkpoint: int | str | None,
  marian_rules: dict | None = None,
) -> dict:
  def shape(aval) -> str:
    return f'[{", ".join(map(str, aval.shape))}]'  # Symbolic dims by name: [b, s].

  some_search = next(iter(searches.values()))
  source_aval = some_search.in_avals[-3]  # Flattened: parameters..., source_ids, lengths, alpha.
  return {
    'format': stablehlo_runner.FORMAT,
    'version': stablehlo_runner.FORMAT_VERSION,
    'jax_version': jax.__version__,
    'platforms': list(some_search.platforms),
    'exported_from': {'workdir': str(Workdir(workdir)), 'checkpoint': checkpoint or 'default'},
    'model': config.to_dict(),
    # What the searches compute in (the model's compute dtype at export, `--dtype`).
    'dtype': config.dtype,
    'special_ids': {'pad': PAD_ID, 'eos': EOS_ID, 'bos': BOS_ID, 'unk': UNK_ID},
    'max_len': config.max_len,
    'extra_decode_length': EXTRA_DECODE_LENGTH,
    'min_source_bucket': MIN_SOURCE_BUCKET,
    'defaults': {
      'beam_size': default_beam_size,
      'alpha': default_alpha,
      'batch_size': DEFAULT_BATCH_SIZE,
    },
    'searches': {
      str(beam_size): {
        'file': search_file(beam_size),
        'inputs': {
          'parameters': f'{{name: array}} as in {PARAMETERS_FILE}',
          'source_ids': f'int32{shape(source_aval)}',
          'max_lengths': f'int32{shape(exported.in_avals[-2])}',
          'alpha': 'float32[]',
        },
        'output': f'int32{shape(exported.out_avals[0])}',
      }
      for beam_size, exported in searches.items()
    },
    'symbolic_dims': {'b': 'batch, any >= 1', 's': f'source length, 1 <= s <= {config.max_len}'},
    'parameters': {
      'file': PARAMETERS_FILE,
      'count': int(sum(value.size for value in flat_params.values())),
      'shapes': {name: list(value.shape) for name, value in flat_params.items()},
      'dtypes': sorted({str(value.dtype) for value in flat_params.values()}),
      # Per name: the runner views the uint16-stored bfloat16 ones back (`stored_parameters`).
      'dtypes_by_name': {name: str(value.dtype) for name, value in flat_params.items()},
    },
    'sentencepiece_model': SENTENCEPIECE_FILE,
    # A MarianMT import's vocabulary: MarianTokenizer's rules (`stablehlo_runner.marian_encode`).
    'marian_rules': marian_rules,
  }


_README = """\
# {name}: a transformer_jax model as StableHLO

Exported by `python -m transformer_jax.export --format=stablehlo` from `{workdir}`
(checkpoint: {checkpoint}) with jax {jax_version}, for {platforms}, computing in {dtype}. It
translates as `python -m transformer_jax.translate --dtype={dtype}` does, with neither
transformer_jax nor flax installed:

```sh
pip install jax=={jax_version} flatbuffers numpy sentencepiece
echo '{example}' | python {out}/{runner}  # beam 4, alpha 0.6
python {out}/{runner} --beam_size=1 --input=in.txt --output=out.txt  # greedy
```

Options (`--help`): `--beam_size` ({beam_sizes} were exported; 1 is greedy), `--alpha`,
`--batch_size` (any: the batch axis is symbolic), `--input`, `--output`, `--model_dir`. From
Python:

```python
import sys; sys.path.insert(0, '{out}')
from translate import ExportedTranslator
translator = ExportedTranslator('{out}')
print(translator.translate(['{example}'], beam_size=4, alpha=0.6))
```

Files: {searches}: one `jax.export` search each (encoder and cached decoder included; batch and
source length symbolic), read with `jax.export.deserialize`; `{parameters}`: the parameters,
the search's first argument (`numpy.load(path, allow_pickle=False)`; bfloat16 ones stored as
uint16 bit patterns, named in `manifest.json`'s parameters.dtypes_by_name); `{spm}`: the
SentencePiece vocabulary; `manifest.json`: shapes, special ids, defaults, lengths, jax version.
"""


def _readme(
  out_dir: str,
  workdir: str,
  checkpoint,
  platforms: Sequence[str],
  beam_sizes,
  example: str,
  dtype: str,
) -> str:
  return _README.format(
    dtype=dtype,
    name=os.path.basename(out_dir),
    workdir=workdir,
    checkpoint=checkpoint or 'default',
    jax_version=jax.__version__,
    platforms=', '.join(platforms),
    example=example,
    out=out_dir,
    runner=RUNNER_FILE,
    beam_sizes=', '.join(map(str, beam_sizes)),
    searches=', '.join(f'`{search_file(size)}`' for size in beam_sizes),
    parameters=PARAMETERS_FILE,
    spm=SENTENCEPIECE_FILE,
  )


def _runner_source() -> str:
  with open(stablehlo_runner.__file__, encoding='utf-8') as f:
    return f.read().rstrip('\n') + _SCRIPT_ENTRY


def export(
  workdir: str,
  out_dir: str,
  *,
  checkpoint: int | str | None = None,
  beam_sizes: Sequence[int] = DEFAULT_BEAM_SIZES,
  platforms: Sequence[str] = DEFAULT_PLATFORMS,
  alpha: float = DEFAULT_ALPHA,
  quantization: str = 'float32',
  dtype: str | None = None,
  force: bool = False,
  example: str = 'three hundred forty-two',
) -> str:
  """Writes the workdir's model to `out_dir` as StableHLO searches + parameters; returns it.

  checkpoint as `translate`'s --checkpoint (None: averaged if current, else latest).
  beam_sizes: one search each (1 is greedy); the runner's default is 4 if exported, else the
  largest. alpha: the runner's default length penalty (it takes any). dtype: the inference
  dtype the searches compute in and the matrices are stored in (`Translator`; None: the
  model's own, with float32 parameters as trained). The directory is written
  beside `out_dir` and moved into place complete; an existing `out_dir` is refused unless
  `force` (then replaced).
  """
  check_quantization(quantization)
  check_dtype(dtype)
  check_decoding_options(alpha=alpha)
  if paths.is_gcs(out_dir):
    raise UserInputError(f'--out={out_dir}: the runner reads local directories only')
  out_dir = os.path.abspath(out_dir)
  # Never a workdir, a folder holding one or someone's files, even with --force.
  paths.check_replaceable_folder(out_dir, '--out', force)
  paths.check_outputs_apart({'--out': out_dir}, runs={'--workdir': workdir})
  check_export_options(beam_sizes=beam_sizes, platforms=platforms)  # Before any checkpoint.
  beam_sizes, platforms = tuple(sorted(beam_sizes)), tuple(platforms)
  # The Translator's own cast (`cast_params`) and compute dtype: what the runner must reproduce.
  restored = Translator.from_checkpoint(workdir, checkpoint, batch_size=1, dtype=dtype)
  config = restored.model_config
  check_exportable(config, platforms)
  flat_params = flatten_parameters(restored.params)
  searches = {
    size: export_search(restored.model, flat_params, size, platforms) for size in beam_sizes
  }
  default_beam_size = 4 if 4 in beam_sizes else max(beam_sizes)

  with paths.staged_folder(out_dir) as staging:
    paths.mark_export_folder(staging)
    for beam_size, exported in searches.items():
      with open(os.path.join(staging, search_file(beam_size)), 'wb') as f:
        f.write(exported.serialize())
    np.savez(os.path.join(staging, PARAMETERS_FILE), **stored_parameters(flat_params))
    with open(os.path.join(staging, SENTENCEPIECE_FILE), 'wb') as f:
      f.write(Workdir(workdir).vocab_file.read_bytes())
    description = manifest(
      config,
      flat_params,
      searches,
      default_beam_size=default_beam_size,
      default_alpha=float(alpha),
      workdir=workdir,
      checkpoint=checkpoint,
      marian_rules=restored.tokenizer.marian_record(),
    )
    with open(os.path.join(staging, stablehlo_runner.MANIFEST_FILE), 'w', encoding='utf-8') as f:
      json.dump(description, f, indent=2)
      f.write('\n')
    with open(os.path.join(staging, RUNNER_FILE), 'w', encoding='utf-8') as f:
      f.write(_runner_source())
    with open(os.path.join(staging, README_FILE), 'w', encoding='utf-8') as f:
      f.write(_readme(out_dir, workdir, checkpoint, platforms, beam_sizes, example, config.dtype))
  log(
    f'StableHLO searches (beam sizes {", ".join(map(str, beam_sizes))}, {config.dtype}) '
    f'written to {out_dir}'
  )
  return out_dir
