"""Export to CTranslate2: `python -m transformer_jax.export --format=ctranslate2 --out=DIR`.

The model is described through CTranslate2's own specification API (`TransformerSpec`, whose
`validate`, `optimize` and `save` write and quantise the files), so nothing here writes its binary
format. What differs silently between the two codebases, and how each difference is bridged:

  positions     ours interleave sin/cos (PE[2i] = sin, PE[2i+1] = cos, position 0 first);
                CTranslate2's built-in table is [sin | cos] with another timescale and starts at
                position 1. The spec lets a model store its own table (`position_encodings`), so
                ours is stored: `model.inputs.sinusoidal_positions` for max_len positions (in the
                config's sinusoid_layout), or the learned tables (source and target apart).
  layer norm    epsilon 1e-6 here, CTranslate2's default 1e-5: `config.layer_norm_epsilon`.
  embeddings    x sqrt(d_model) on both sides (`scale_embeddings`); with share_embeddings one
                matrix is given to source, target and output projection (`optimize` aliases it).
  attention     no biases by default: CTranslate2's linear biases are optional and left unset
                (with attention_bias, Marian's variant, they are set, fused as the weights).
                Self-attention is one fused [Q; K; V] linear, cross-attention a query linear and
                a fused [K; V] one; flax kernels are [in, heads, head] and become [out, in]
                matrices, heads major. CTranslate2 splits a fused projection into equal parts,
                so where qk_dim != v_dim the smaller side is zero-padded to the larger (exact:
                zero columns add nothing to Q.K, zero value columns meet zero output rows) and
                `queries_scale` keeps 1/sqrt(qk_dim).
  FFN           ffn_activation: CTranslate2's Activation of the same function (swish, gelu with
                erf, gelu_sigmoid); logits_bias goes into the output layer's bias.
  norm order    post-LN (the paper) or pre-LN with a final norm per stack: the spec's `pre_norm`.
  special ids   pad=0, eos=1, bos=2, unk=3 (data/tokenizer.py). The vocabulary is written from
                the SentencePiece model in id order; sources end with EOS (`add_source_eos`), no
                BOS; decoding starts from BOS (`decoder_start_token`). Our searches never predict
                PAD or BOS (search.candidates.mask_never_predicted): the output layer gets a
                bias that is 0 except -1e4 at PAD and BOS, which gives them zero probability
                and leaves every other log-prob unchanged.
  decoding      beam search here ranks by log P / ((5 + |y|) / 6)^alpha (GNMT), CTranslate2 by
                log P / |y|^length_penalty (|y| counting EOS in both): `translate` asks
                CTranslate2 for all beam_size hypotheses with plain log-probs and ranks them by
                ours. CTranslate2's min_decoding_length=1 forbids EOS first, ours allows an empty
                output: 0. Lengths are capped at max_len as ours (`translation_options`).

Every TransformerConfig variant of today is expressible; a field this module does not know (one
added to the model later) is refused, unless at its default, with a one-line error naming it
(`check_exportable`). The weights are float32 whatever `dtype` the model trained in; CTranslate2
computes in the type of `--quantization` (or its `compute_type=` when loading).
"""

from __future__ import annotations

import inspect
import json
import math
import os
from typing import Any

import numpy as np

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import log
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from transformer_jax.exporters import ctranslate2_runtime, stablehlo_runner
from transformer_jax.exporters.ctranslate2_runtime import import_ctranslate2
from transformer_jax.inference.translator import Translator
from transformer_jax.model.config import TransformerConfig, refuse_unknown_variant
from transformer_jax.model.inputs import sinusoidal_positions
from transformer_jax.workdir.layout import Workdir

# CTranslate2's weight types (`ctranslate2.specs.model_spec.ACCEPTED_MODEL_TYPES`).
QUANTIZATIONS = (
  'int8',
  'int8_float32',
  'int8_float16',
  'int8_bfloat16',
  'int16',
  'float16',
  'bfloat16',
  'float32',
)
SENTENCEPIECE_FILE = ctranslate2_runtime.SENTENCEPIECE_FILE
# Where the workdir segments targets with a model of its own (an OPUS-MT import's target.spm, a
# MarianMT import's separate vocabularies): its copy, for target prefixes and scored targets.
TARGET_SENTENCEPIECE_FILE = ctranslate2_runtime.TARGET_SENTENCEPIECE_FILE
# A MarianMT import's vocabulary: MarianTokenizer's rules as data (`Tokenizer.marian_record`),
# for the README's tokenization (`stablehlo_runner.marian_encode`).
MARIAN_RULES_FILE = 'marian_rules.json'
README_FILE = 'README.md'
# Added to PAD's and BOS's output logits: exp(-1e4) is 0 in every float type, and -1e4 is
# finite in float16.
PAD_LOGIT_BIAS = -1e4

# TransformerConfig.ffn_activation -> the name of its `ctranslate2.specs.common_spec.Activation`.
_ACTIVATIONS = {
  'relu': 'RELU',
  'swish': 'SWISH',
  'silu': 'SWISH',
  'gelu': 'GELU',
  'gelu_sigmoid': 'GELUSigmoid',
}


def check_exportable(config: Any) -> None:
  """Raises a one-line UserInputError for a model CTranslate2 cannot run as we do."""
  refuse_unknown_variant(config, 'the CTranslate2 export')


def check_quantization(quantization: str) -> None:
  if quantization not in QUANTIZATIONS:
    raise UserInputError(
      f'--quantization must be one of {", ".join(QUANTIZATIONS)}, got {quantization!r}'
    )


# --- Parameters -> specification --------------------------------------------------------------


def _array(x) -> np.ndarray:
  """A float32 copy: CTranslate2 quantises in place, and JAX's arrays are read-only."""
  return np.array(x, np.float32)


def _layer(tree, index: int):
  """One layer's parameters out of a scanned stack (leading 'layers' axis)."""
  if isinstance(tree, dict):
    return {name: _layer(value, index) for name, value in tree.items()}
  return _array(tree[index])


def _set_layer_norm(spec, norm) -> None:
  spec.gamma = _array(norm['scale'])
  spec.beta = _array(norm['bias'])


def _set_dense(spec, dense) -> None:
  """flax Dense-like kernel [in, out] (+ bias [out]) -> CTranslate2 linear weight [out, in]."""
  spec.weight = np.ascontiguousarray(dense['kernel'].T)
  if 'bias' in dense:
    spec.bias = dense['bias']


def _projection(kernel: np.ndarray, head_dim: int) -> np.ndarray:
  """[d_model, heads, d] -> [heads * head_dim, d_model], each head zero-padded to head_dim."""
  d_model, heads, depth = kernel.shape
  padded = np.zeros((d_model, heads, head_dim), np.float32)
  padded[:, :, :depth] = kernel
  return np.ascontiguousarray(padded.reshape(d_model, heads * head_dim).T)


def _projection_bias(projection, head_dim: int) -> np.ndarray | None:
  """[heads, d] -> [heads * head_dim], each head zero-padded; None without a bias."""
  if 'bias' not in projection:
    return None
  heads, depth = projection['bias'].shape
  padded = np.zeros((heads, head_dim), np.float32)
  padded[:, :depth] = projection['bias']
  return padded.reshape(heads * head_dim)


def _set_attention(spec, attention, config: TransformerConfig, self_attention: bool) -> None:
  head_dim = max(config.head_qk_dim, config.head_v_dim)
  names = ('query', 'key', 'value')
  query, key, value = (_projection(attention[n]['kernel'], head_dim) for n in names)
  biases = [_projection_bias(attention[n], head_dim) for n in names]
  if self_attention:
    spec.linear[0].weight = np.concatenate([query, key, value])  # CTranslate2's fused Q, K, V.
    if config.attention_bias:
      spec.linear[0].bias = np.concatenate(biases)
  else:
    spec.linear[0].weight = query
    spec.linear[1].weight = np.concatenate([key, value])  # Fused K, V of the encoder output.
    if config.attention_bias:
      spec.linear[0].bias, spec.linear[1].bias = biases[0], np.concatenate(biases[1:])
  out = attention['out']['kernel']  # [heads, d_v, d_model]
  heads, depth, d_model = out.shape
  padded = np.zeros((heads, head_dim, d_model), np.float32)
  padded[:, :depth] = out
  spec.linear[-1].weight = np.ascontiguousarray(padded.reshape(heads * head_dim, d_model).T)
  if config.attention_bias:
    spec.linear[-1].bias = _array(attention['out']['bias'])
  spec.queries_scale = np.float32(1.0 / math.sqrt(config.head_qk_dim))


def _set_ffn(spec, ffn) -> None:
  _set_dense(spec.linear_0, ffn['wi'])
  _set_dense(spec.linear_1, ffn['wo'])


def position_table(config: TransformerConfig, params, side: str) -> np.ndarray:
  """[max_len, d_model]: what our model adds at positions 0..max_len-1 ('source' / 'target')."""
  if config.learned_positions:
    return _array(params[f'{side}_embedder']['position_embedding'])
  table = sinusoidal_positions(
    np.arange(config.max_len)[None], config.d_model, config.sinusoid_layout
  )
  return _array(table[0])


def _embedding(params, config: TransformerConfig, side: str) -> np.ndarray:
  name = 'shared_embedding' if config.share_embeddings else f'{side}_embedding'
  return _array(params[name]['embedding'])


def vocabulary(tokenizer: Tokenizer) -> list[str]:
  """The SentencePiece pieces in id order: CTranslate2's token i is our id i."""
  return tokenizer.pieces(range(tokenizer.vocab_size))


def model_spec(config: TransformerConfig, params, tokenizer: Tokenizer):
  """A validated `ctranslate2.specs.TransformerSpec` holding our parameters (float32)."""
  check_exportable(config)
  ctranslate2 = import_ctranslate2('--format=ctranslate2')
  specs = ctranslate2.specs
  if tokenizer.vocab_size != config.vocab_size:
    raise UserInputError(
      f'{tokenizer.path}: vocabulary has {tokenizer.vocab_size} pieces but the model '
      f'expects {config.vocab_size}'
    )
  head_dim = max(config.head_qk_dim, config.head_v_dim)
  activation = getattr(specs.common_spec.Activation, _ACTIVATIONS[config.ffn_activation])
  common = dict(
    num_heads=config.num_heads, pre_norm=config.pre_norm, head_dim=head_dim, activation=activation
  )
  encoder = specs.TransformerEncoderSpec(config.num_encoder_layers, **common)
  decoder = specs.TransformerDecoderSpec(config.num_decoder_layers, **common)
  spec = specs.TransformerSpec(encoder, decoder)

  encoder.embeddings[0].weight = _embedding(params, config, 'source')
  encoder.scale_embeddings = True  # x sqrt(d_model), as model.layers.Embedder.
  encoder.position_encodings.encodings = position_table(config, params, 'source')
  layers = params['encoder_layers']
  for index, layer_spec in enumerate(encoder.layer):
    layer = _layer(layers, index)
    _set_attention(layer_spec.self_attention, layer['self_attention'], config, True)
    _set_layer_norm(layer_spec.self_attention.layer_norm, layer['attention_block']['norm'])
    _set_ffn(layer_spec.ffn, layer['ffn'])
    _set_layer_norm(layer_spec.ffn.layer_norm, layer['ffn_block']['norm'])

  decoder.embeddings.weight = _embedding(params, config, 'target')
  decoder.scale_embeddings = True
  decoder.position_encodings.encodings = position_table(config, params, 'target')
  layers = params['decoder_layers']
  for index, layer_spec in enumerate(decoder.layer):
    layer = _layer(layers, index)
    _set_attention(layer_spec.self_attention, layer['self_attention'], config, True)
    _set_layer_norm(layer_spec.self_attention.layer_norm, layer['self_attention_block']['norm'])
    _set_attention(layer_spec.attention, layer['cross_attention'], config, False)
    _set_layer_norm(layer_spec.attention.layer_norm, layer['cross_attention_block']['norm'])
    _set_ffn(layer_spec.ffn, layer['ffn'])
    _set_layer_norm(layer_spec.ffn.layer_norm, layer['ffn_block']['norm'])
  if config.pre_norm:
    _set_layer_norm(encoder.layer_norm, params['encoder_norm'])
    _set_layer_norm(decoder.layer_norm, params['decoder_norm'])

  if config.share_embeddings:
    decoder.projection.weight = decoder.embeddings.weight  # Logits = x E^T (Embed.attend).
  else:
    decoder.projection.weight = np.ascontiguousarray(
      _array(params['output_projection']['kernel']).T
    )
  bias = np.zeros((config.vocab_size,), np.float32)
  if config.logits_bias:
    bias += _array(params['logits_bias'])
  bias[[PAD_ID, BOS_ID]] = PAD_LOGIT_BIAS  # Never predicted (search.candidates)
  decoder.projection.bias = bias

  pieces = vocabulary(tokenizer)
  spec.register_source_vocabulary(pieces)
  spec.register_target_vocabulary(pieces)
  spec.config.unk_token = pieces[UNK_ID]
  spec.config.bos_token = pieces[BOS_ID]
  spec.config.eos_token = pieces[EOS_ID]
  spec.config.decoder_start_token = pieces[BOS_ID]
  spec.config.add_source_bos = False
  spec.config.add_source_eos = True
  spec.config.layer_norm_epsilon = float(config.layer_norm_epsilon)
  spec.validate()
  return spec


# --- The command -------------------------------------------------------------------------------

_README = """\
# {name}: a transformer_jax model for CTranslate2

Exported by `python -m transformer_jax.export --format=ctranslate2` from `{workdir}`
(checkpoint: {checkpoint}; weights: {quantization}). `{spm}` is the shared source/target
SentencePiece vocabulary. With `pip install ctranslate2=={version} sentencepiece`:

```python
import ctranslate2, sentencepiece{imports}
translator = ctranslate2.Translator('{out}')  # compute_type='int8': faster on CPU
sp = sentencepiece.SentencePieceProcessor(model_file='{out}/{spm}')
{tokenize}results = translator.translate_batch(
  [{encode} for s in ['{example}']],
  beam_size=4, num_hypotheses=4, length_penalty=0, return_scores=True,
  max_input_length={max_len}, max_decoding_length={max_decode}, min_decoding_length=0)
# Rank as transformer_jax: log P / ((5 + |y|) / 6) ** alpha, alpha = 0.6, |y| counting EOS.
best = [max(zip(r.hypotheses, r.scores), key=lambda h: h[1] / ((6 + len(h[0])) / 6) ** 0.6)[0]
        for r in results]
print([{decode} for tokens in best])
```
{marian}
With float32 weights these are the translations of `python -m transformer_jax.translate`
(beam 4, alpha 0.6; int8 weights change a few); `beam_size=1` (and
`best = [r.hypotheses[0] for r in results]`) is its `--beam_size=1`.
CTranslate2's own ranking, `length_penalty=0.6` with `num_hypotheses=1`, divides by
|y| ** 0.6 instead and picks another translation for a few sentences in a thousand. Keep
`max_input_length={max_len}`: the model has {max_len} positions. `min_decoding_length=0` allows
an empty translation, as transformer_jax does (CTranslate2's default is 1). The same in Python
with transformer_jax installed: `transformer_jax.exporters.ctranslate2_runtime.translate`.
"""


# A MarianMT import's vocabulary (`Tokenizer.marian_record`): the README tokenizes as
# MarianTokenizer does, with the rules the export writes beside the model.
_MARIAN_TOKENIZE = """\
# This vocabulary is a transformers MarianTokenizer's: tokenize as it does.
rules = json.load(open('{out}/{rules}', encoding='utf-8'))
{function}
"""
_MARIAN_NOTE = """
This vocabulary was imported from a transformers MarianMT model: text is cut as MarianTokenizer
cuts it before SentencePiece sees it (its special tokens wherever they stand, then a leading
language tag such as `>>deu<<`; pieces its vocabulary lacks read as `<unk>`), which
SentencePiece alone cannot do. `{rules}` holds the rule's data, and `marian_encode` above
applies it; decoded text is stripped, as MarianTokenizer strips it.{target}
"""
_MARIAN_TARGET = f"""
Targets (prefixes, scored translations) are segmented by `{TARGET_SENTENCEPIECE_FILE}`, with
rules of their own (transformer_jax's `ctranslate2_runtime.load_tokenizers` reads both)."""


def readme_code(tokenizer: Tokenizer) -> dict[str, str]:
  """The README template's tokenization slots: SentencePiece's own, or MarianTokenizer's for a
  MarianMT import's vocabulary (`stablehlo_runner.marian_encode`, its source shown)."""
  if not tokenizer.marian_rules:
    return dict(
      imports='',
      tokenize='',
      encode='sp.encode(s, out_type=str)',
      decode='sp.decode(tokens)',
    )
  return dict(
    imports=', json, re',
    tokenize=_MARIAN_TOKENIZE.format(
      out='{out}',
      rules=MARIAN_RULES_FILE,
      function=inspect.getsource(stablehlo_runner.marian_encode),
    ),
    encode='[sp.id_to_piece(i) for i in marian_encode(sp, s, rules)]',
    decode='sp.decode(tokens).strip()',
  )


def write_vocabularies(workdir: str, tokenizer: Tokenizer, folder: str) -> None:
  """The workdir's vocabulary (and its target side's model, if any) into the export `folder`,
  with MarianTokenizer's rules as data where the vocabulary has them."""
  layout = Workdir(workdir)
  with open(os.path.join(folder, SENTENCEPIECE_FILE), 'wb') as f:
    f.write(layout.vocab_file.read_bytes())
  if layout.target_vocab_file.exists():
    with open(os.path.join(folder, TARGET_SENTENCEPIECE_FILE), 'wb') as f:
      f.write(layout.target_vocab_file.read_bytes())
  record = tokenizer.marian_record()
  if record is not None:
    with open(os.path.join(folder, MARIAN_RULES_FILE), 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=1, ensure_ascii=False)
      f.write('\n')


def export(
  workdir: str,
  out_dir: str,
  *,
  quantization: str = 'float32',
  checkpoint: int | str | None = None,
  force: bool = False,
  example: str = 'three hundred forty-two',
) -> str:
  """Writes the workdir's model to `out_dir` as a CTranslate2 model directory; returns it.

  checkpoint as `translate`'s --checkpoint (None: averaged if current, else latest). The
  directory is written beside `out_dir` and moved into place complete; an existing `out_dir`
  is refused unless `force` (then replaced).
  """
  ctranslate2 = import_ctranslate2('--format=ctranslate2')
  check_quantization(quantization)
  if paths.is_gcs(out_dir):
    raise UserInputError(f'--out={out_dir}: CTranslate2 reads local directories only')
  out_dir = os.path.abspath(out_dir)
  # Never a workdir, a folder holding one or someone's files, even with --force.
  paths.check_replaceable_folder(out_dir, '--out', force)
  paths.check_outputs_apart({'--out': out_dir}, runs={'--workdir': workdir})
  restored = Translator.from_checkpoint(workdir, checkpoint, batch_size=1)
  config = restored.model_config
  spec = model_spec(config, restored.params, restored.tokenizer)
  spec.optimize(quantization=quantization)

  with paths.staged_folder(out_dir) as staging:
    spec.save(staging)
    paths.mark_export_folder(staging)
    write_vocabularies(workdir, restored.tokenizer, staging)
    code = readme_code(restored.tokenizer)
    marian = ''
    if restored.tokenizer.marian_rules:
      apart = Workdir(workdir).target_vocab_file.exists()
      marian = _MARIAN_NOTE.format(rules=MARIAN_RULES_FILE, target=_MARIAN_TARGET if apart else '')
    with open(os.path.join(staging, README_FILE), 'w', encoding='utf-8') as f:
      f.write(
        _README.format(
          **{k: v.replace('{out}', out_dir) for k, v in code.items()},
          marian=marian,
          name=os.path.basename(out_dir),
          workdir=workdir,
          checkpoint=checkpoint or 'the default, averaged if current, else latest',
          quantization=quantization,
          spm=SENTENCEPIECE_FILE,
          version=ctranslate2.__version__,
          out=out_dir,
          example=example,
          max_len=config.max_len,
          max_decode=config.max_len - 1,
        )
      )
  log(f'CTranslate2 model ({quantization}) written to {out_dir}')
  return out_dir
