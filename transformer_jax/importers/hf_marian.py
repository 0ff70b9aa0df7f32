"""transformers MarianMT checkpoints (a folder, or a Hub repo id) as transformer_jax models,
computing what `MarianMTModel` computes.

`read_model` reads config.json, the weights (`hf_files`), vocab.json and source.spm /
target.spm, and returns what `workdir_writer.write` takes:

  layers     post-norm (MarianMTModel has no other), layer norm epsilon 1e-5 (torch's
             default), attention biases; torch Linear weights [out, in] become our kernels
             [in, out], the q/k/v/out projections split into heads.
  positions  MarianMTModel's fixed sinusoids are [sin | cos] halves at the paper's timescales
             10000^(2i/d); ours interleave them (PE[2i] = sin, PE[2i+1] = cos). Permuting the
             hidden units (`interleaved_order`: every table, kernel, bias and norm along d_model)
             makes theirs ours, so an import is our default sinusoidal model and stays
             exportable after fine-tuning, whose positions stay fixed as MarianMTModel's do. We
             compute the angles in float32, MarianMTModel in float64: the encodings differ by up
             to 6e-6 below position 100 and 3e-5 at 512. An odd d_model has no such permutation
             (its d // 2 + 1 sines against our d // 2 and a zero feature): it keeps their
             sinusoids as learned position tables, exact, which fine-tuning may move.
  ids        HF: </s>=0, <unk>=1, ..., <pad>=pad_token_id, the decoder's start. Ours: PAD=0,
             EOS=1, BOS=2, UNK=3, then vocab.json's ids from 2 on, then target_vocab.json's
             pieces vocab.json lacks (hf_vocabulary: both sides in one id space). The <pad> row
             becomes both our PAD and BOS rows, so our BOS at position 0 is HF's decoder start.
             Our PAD's logit is the target's <pad> logit; BOS and every id that is no target
             piece get MASKED_LOGIT_BIAS, so the training loss (over every id) is
             MarianMTModel's. Our searches and scores never predict PAD or BOS and leave them
             out of the softmax (search.candidates.mask_never_predicted), as Marian, which has
             no <pad>, and CTranslate2's converter, which removes it, do; transformers never
             predicts <pad> either (bad_words_ids [[pad]], as Helsinki-NLP ships) but its beam
             search counts <pad>'s probability in the log-softmax it ranks by. Greedy is
             therefore the same search; beam scores differ by that probability, which can turn
             a near tie (tests/import_hf_test.py: >= 98% the same).
  embeddings tied as MarianMTModel ties them: with tie_word_embeddings, the shared table (or the
             decoder's, without share_encoder_decoder_embeddings) is the output too; without,
             transformers ties nothing. scale_embedding=False (our embedder always multiplies by
             sqrt(d)) divides the input tables by sqrt(d), which unties them from the output.
             Each side's table fills the ids of its own pieces; the ids its vocabulary lacks
             get its <unk> row (MarianTokenizer reads those pieces as <unk>).
  vocabulary vocab.json's ids with source.spm's segmentation (target.spm segments targets), as
             MarianTokenizer, language tags (a leading >>deu<<) and special tokens (</s>, <unk>,
             <pad>, and the tokenizer files' extra ones: hf_vocabulary) cut out first as it cuts
             them (Tokenizer's MarianTokenizer rules); pieces the .spm has beyond the
             vocabularies (MarianTokenizer: <unk>) come last.
  separate   vocabularies (tokenizer_config.json separate_vocabs, target_vocab.json; with
             share_encoder_decoder_embeddings=false, decoder_vocab_size may differ from
             vocab_size) are exact in our one vocabulary: its source pieces index the encoder's
             table, its target pieces the decoder's and the output's, and no other id is ever
             predicted. Shared embeddings over separate vocabularies become two tables.

Refused, one line naming the field: another model_type, decoder_vocab_size != vocab_size
without a target_vocab.json, encoder and decoder of different widths, activations we lack
(gelu_new, ...), and legacy fields MarianMTModel ignores whose value says it computes something
else (normalize_before, static_position_embeddings, ...).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.data.tokenizer import BOS_ID, PAD_ID
from transformer_jax.importers import hf_files, hf_vocabulary, workdir_writer
from transformer_jax.importers.marian import MASKED_LOGIT_BIAS
from transformer_jax.model.config import TransformerConfig

# transformers' ACT2FN names -> ours. 'gelu' is torch's exact (erf) gelu; 'quick_gelu' is
# x * sigmoid(1.702 x).
ACTIVATIONS = {
  'swish': 'swish',
  'silu': 'swish',
  'relu': 'relu',
  'gelu': 'gelu',
  'quick_gelu': 'gelu_sigmoid',
}
# Fields of BART-era configs (Helsinki-NLP's config.json files carry them) that MarianMTModel
# ignores: accepted at the value that describes what it computes, refused otherwise, since
# such a checkpoint claims a model MarianMTModel does not run.
_LEGACY_FIELDS = {
  'normalize_before': (False, 'MarianMTModel has post-norm layers only'),
  'normalize_embedding': (False, 'MarianMTModel has no layer norm after the embeddings'),
  'add_final_layer_norm': (False, 'MarianMTModel has no final layer norm'),
  'static_position_embeddings': (True, 'MarianMTModel has sinusoidal positions only'),
  'add_bias_logits': (False, 'MarianMTModel adds final_logits_bias only'),
  'is_decoder': (False, 'an encoder-decoder model is expected'),
}
LAYER_NORM_EPSILON = 1e-5
_ATTENTION = (('q_proj', 'query'), ('k_proj', 'key'), ('v_proj', 'value'))


def is_hf_model(model: str) -> bool:
  """A transformers folder (it has a config.json) or a Hub repo id (owner/name, no such path)."""
  if os.path.isdir(model):
    return os.path.exists(os.path.join(model, hf_files.HF_CONFIG))
  return hf_files.is_repo_id(model)


def _field(config: dict, name: str, default: Any = None) -> Any:
  value = config.get(name)
  return default if value is None else value


def check_config(config: Any, path: str) -> dict[str, Any]:
  """Our TransformerConfig fields, `tied` and `scale` of a MarianMTModel config.json."""

  def refuse(name: str, why: str):
    raise UserInputError(f'{path}: {name}={config.get(name)!r:.80} is not supported: {why}')

  if not isinstance(config, dict):
    raise UserInputError(f'{path}: not a map of config fields')
  if config.get('model_type') != 'marian':
    refuse('model_type', "only transformers' MarianMT models ('marian')")
  for name, (value, why) in _LEGACY_FIELDS.items():
    if name in config and config[name] != value:
      refuse(name, why)
  sizes = {}
  for name in ('d_model', 'encoder_layers', 'decoder_layers', 'encoder_attention_heads'):
    sizes[name] = config.get(name)
    if not is_integer(sizes[name]) or sizes[name] <= 0:
      refuse(name, 'must be a positive integer')
  for ours, theirs in (('decoder_attention_heads', 'encoder_attention_heads'),
                       ('decoder_ffn_dim', 'encoder_ffn_dim')):  # fmt: skip
    if config.get(ours) != config.get(theirs):
      refuse(ours, f'one size for encoder and decoder ({theirs}={config.get(theirs)!r})')
  if not is_integer(config.get('encoder_ffn_dim')) or config['encoder_ffn_dim'] <= 0:
    refuse('encoder_ffn_dim', 'must be a positive integer')
  if sizes['d_model'] % sizes['encoder_attention_heads']:
    refuse('d_model', 'must be divisible by encoder_attention_heads')
  activation = config.get('activation_function', 'gelu')
  if activation not in ACTIVATIONS:
    refuse('activation_function', f'only {", ".join(ACTIVATIONS)}')
  vocab_size = config.get('vocab_size')
  if not is_integer(vocab_size) or vocab_size < 3:
    refuse('vocab_size', 'must be an integer of at least 3')
  share = _field(config, 'share_encoder_decoder_embeddings', True)
  # MarianMTModel ignores decoder_vocab_size when the embeddings are shared.
  target_size = vocab_size if share else _field(config, 'decoder_vocab_size', vocab_size)
  if not is_integer(target_size) or target_size < 3:
    refuse('decoder_vocab_size', 'must be an integer of at least 3')
  for name, want in (('eos_token_id', 0), ('pad_token_id', vocab_size - 1)):
    if config.get(name, want) != want:
      refuse(name, f'expected {want}: </s> first, <pad> last, as Marian conversions have them')
  if _field(config, 'decoder_start_token_id', target_size - 1) != target_size - 1:
    refuse('decoder_start_token_id', f"decoding starts from the target's <pad> ({target_size - 1})")
  max_pos = config.get('max_position_embeddings', 1024)
  if not is_integer(max_pos) or max_pos <= 0:
    refuse('max_position_embeddings', 'must be a positive integer')
  for name in ('share_encoder_decoder_embeddings', 'tie_word_embeddings', 'scale_embedding'):
    if not isinstance(config.get(name, False), bool):
      refuse(name, 'must be true or false')
  return {
    'd_model': sizes['d_model'],
    'num_heads': sizes['encoder_attention_heads'],
    'num_encoder_layers': sizes['encoder_layers'],
    'num_decoder_layers': sizes['decoder_layers'],
    'd_ff': config['encoder_ffn_dim'],
    'ffn_activation': ACTIVATIONS[activation],
    'hf_vocab_size': vocab_size,
    'hf_target_vocab_size': target_size,
    'max_position_embeddings': max_pos,
    'share': share,
    'tied': _field(config, 'tie_word_embeddings', True),
    'scale': _field(config, 'scale_embedding', False),
  }


def interleaved_order(d_model: int) -> np.ndarray:
  """MarianMTModel's feature j -> ours for our 'interleaved' sinusoids (PE[2i] = sin, PE[2i+1]
  = cos): its [sin | cos] halves at the same timescales 10000^(2i/d) are [0, 2, 4, ... | 1, 3,
  5, ...] of ours (d_model even)."""
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def sinusoids(n_pos: int, dim: int) -> np.ndarray:
  """MarianSinusoidalPositionalEmbedding.create_weight: float64, then float32 halves."""
  j = np.arange(dim)
  position_enc = np.arange(n_pos)[:, None] / np.power(10000, 2 * (j // 2) / dim)[None, :]
  sentinel = dim // 2 if dim % 2 == 0 else dim // 2 + 1
  out = np.empty((n_pos, dim), np.float32)
  out[:, :sentinel] = np.sin(position_enc[:, 0::2])
  out[:, sentinel:] = np.cos(position_enc[:, 1::2])
  return out


def expected_shapes(layout: dict) -> dict[str, tuple]:
  """Name -> shape of every layer tensor MarianMTModel has (embeddings apart)."""
  d, f = layout['d_model'], layout['d_ff']
  shapes = {}
  for side in ('encoder', 'decoder'):
    blocks = ['self_attn'] + (['encoder_attn'] if side == 'decoder' else [])
    for i in range(layout[f'num_{side}_layers']):
      prefix = f'model.{side}.layers.{i}.'
      for block in blocks:
        for proj in ('q_proj', 'k_proj', 'v_proj', 'out_proj'):
          shapes[f'{prefix}{block}.{proj}.weight'], shapes[f'{prefix}{block}.{proj}.bias'] = (
            (d, d),
            (d,),
          )
        shapes[f'{prefix}{block}_layer_norm.weight'] = shapes[
          f'{prefix}{block}_layer_norm.bias'
        ] = (d,)
      shapes[f'{prefix}fc1.weight'], shapes[f'{prefix}fc1.bias'] = (f, d), (f,)
      shapes[f'{prefix}fc2.weight'], shapes[f'{prefix}fc2.bias'] = (d, f), (d,)
      shapes[f'{prefix}final_layer_norm.weight'] = shapes[f'{prefix}final_layer_norm.bias'] = (d,)
  return shapes


def _tables(arrays: dict, layout: dict, path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(source, target, output) [V, d] tables as MarianMTModel ties them (module docstring)."""
  names = ['model.shared.weight', 'model.encoder.embed_tokens.weight']
  names += ['model.decoder.embed_tokens.weight', 'lm_head.weight']

  def first(*candidates: str) -> np.ndarray:
    for name in candidates:
      if name in arrays:
        return arrays[name]
    raise UserInputError(f'{path}: tensor {candidates[0]} is missing')

  if layout['tied'] and layout['share']:
    table = first(*names)
    return table, table, table
  if layout['tied']:
    source, target = first(names[1]), first(names[2], names[3])
    return source, target, target
  return first(names[1]), first(names[2]), first(names[3])


def map_params(
  arrays: dict, layout: dict, vocab: hf_vocabulary.HFVocabulary, max_len: int, path: str
):
  """MarianMTModel's tensors as our parameter tree (marian.map_params' layout); shapes and
  values checked against the config first."""
  d, h = layout['d_model'], layout['num_heads']
  v_source, v_target = layout['hf_vocab_size'], layout['hf_target_vocab_size']
  expected = expected_shapes(layout)
  embedding_sizes = {
    'model.shared.weight': v_source,
    'model.encoder.embed_tokens.weight': v_source,
    'model.decoder.embed_tokens.weight': v_target,
    'lm_head.weight': v_target,
  }
  expected.update({n: (v, d) for n, v in embedding_sizes.items() if n in arrays})
  expected['final_logits_bias'] = (1, v_target)
  positions = {'model.encoder.embed_positions.weight', 'model.decoder.embed_positions.weight'}
  for name in sorted(set(expected) - set(arrays))[:1]:
    if name != 'final_logits_bias':
      raise UserInputError(f'{path}: tensor {name} {list(expected[name])} is missing')
  for name in sorted(set(arrays) - set(expected) - positions)[:1]:
    raise UserInputError(f'{path}: unknown tensor {name}{list(arrays[name].shape)}')
  table = sinusoids(layout['max_position_embeddings'], d)
  for name in sorted(positions & set(arrays)):  # Older transformers saved them; it recomputes.
    if arrays[name].shape != table.shape or not np.allclose(arrays[name], table, atol=1e-6):
      raise UserInputError(f'{path}: tensor {name} is not the sinusoids MarianMTModel computes')
  for name, array in arrays.items():
    if name in expected and tuple(array.shape) != expected[name]:
      raise UserInputError(
        f'{path}: tensor {name} has shape {list(array.shape)}, expected {list(expected[name])} '
        'from config.json'
      )
    if not np.isfinite(array).all():
      raise UserInputError(f'{path}: tensor {name} holds NaN or Inf')

  def rows(hf_table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """One side's HF [V, ...] table (`ids`: its HF id -> ours) in our id order: <pad>'s row at
    PAD and BOS, <unk>'s at every id the side's vocabulary lacks (MarianTokenizer reads those
    pieces as <unk>: the extras, and with separate vocabularies the other side's pieces)."""
    out = np.empty((vocab.vocab_size, *hf_table.shape[1:]), np.float32)
    out[:] = hf_table[1]
    out[ids[:-1]] = hf_table[:-1]
    out[[PAD_ID, BOS_ID]] = hf_table[-1]
    return out

  # ours[..., i] = theirs[..., hidden[i]] along every d_model axis (module docstring).
  learned = d % 2 == 1
  hidden = np.arange(d) if learned else np.argsort(interleaved_order(d))

  def features(array: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.take(array, hidden, axis=axis)

  params: dict[str, Any] = {}
  for side in ('encoder', 'decoder'):
    blocks = [('self_attn', 'self_attention', 'attention_block' if side == 'encoder' else None)]
    if side == 'decoder':
      blocks = [('self_attn', 'self_attention', 'self_attention_block')]
      blocks.append(('encoder_attn', 'cross_attention', 'cross_attention_block'))
    layers = []
    for i in range(layout[f'num_{side}_layers']):
      get = lambda name: arrays[f'model.{side}.layers.{i}.{name}']  # noqa: E731, B023
      layer: dict[str, Any] = {}
      for theirs, ours, norm in blocks:
        attention = {
          n: {'kernel': features(get(f'{theirs}.{p}.weight').T, 0).reshape(d, h, d // h),
              'bias': get(f'{theirs}.{p}.bias').reshape(h, d // h)}
          for p, n in _ATTENTION
        }  # fmt: skip
        attention['out'] = {
          'kernel': features(get(f'{theirs}.out_proj.weight').T).reshape(h, d // h, d),
          'bias': features(get(f'{theirs}.out_proj.bias')),
        }
        layer[ours] = attention
        ln = f'{theirs}_layer_norm'
        layer[norm] = {
          'norm': {'scale': features(get(f'{ln}.weight')), 'bias': features(get(f'{ln}.bias'))}
        }
      layer['ffn'] = {
        'wi': {'kernel': features(get('fc1.weight').T, 0), 'bias': get('fc1.bias')},
        'wo': {'kernel': features(get('fc2.weight').T), 'bias': features(get('fc2.bias'))},
      }
      norm = {'scale': get('final_layer_norm.weight'), 'bias': get('final_layer_norm.bias')}
      layer['ffn_block'] = {'norm': {name: features(value) for name, value in norm.items()}}
      layers.append(layer)
    params[f'{side}_layers'] = _stack(layers)
  if learned:
    for embedder in ('source_embedder', 'target_embedder'):
      params[embedder] = {'position_embedding': table[:max_len].copy()}

  source, target, output = (features(t) for t in _tables(arrays, layout, path))
  scale = 1.0 if layout['scale'] else 1 / math.sqrt(d)  # Ours multiplies by sqrt(d) always.
  sources, targets = vocab.source_ids, vocab.target_ids
  if layout['shared_table'] and scale == 1.0:
    params['shared_embedding'] = {'embedding': rows(source, sources)}
  else:
    params['source_embedding'] = {'embedding': rows(source * scale, sources)}
    params['target_embedding'] = {'embedding': rows(target * scale, targets)}
    params['output_projection'] = {'kernel': rows(output, targets).T.copy()}
  bias = rows(arrays.get('final_logits_bias', np.zeros((1, v_target), np.float32))[0], targets)
  # Only the target vocabulary's pieces are predictions (and PAD, <pad>'s, which searches and
  # scores leave out themselves); BOS and the rest never are.
  never = np.ones(vocab.vocab_size, bool)
  never[targets] = False
  never[BOS_ID] = True
  bias[never] += MASKED_LOGIT_BIAS
  params['logits_bias'] = bias
  return params


def _stack(layers: list[dict]) -> dict:
  """Per-layer trees as one tree of [layers, ...] float32 arrays (our scanned stacks)."""
  first = layers[0]
  if isinstance(first, dict):
    return {k: _stack([layer[k] for layer in layers]) for k in first}
  return np.stack([np.asarray(layer, np.float32) for layer in layers])


def read_model(model: str, max_len: int = 512):
  """(config, params, vocabulary, origin, target vocabulary or None) of a MarianMT folder or
  Hub repo id (see the module docstring)."""
  folder = hf_files.resolve_repo(model) if hf_files.is_repo_id(model) else model
  config_path = os.path.join(folder, hf_files.HF_CONFIG)
  if not os.path.exists(config_path):
    raise UserInputError(f'--model={model}: config.json is missing (not a transformers folder)')
  config = hf_files.read_json(config_path, 'config')
  layout = check_config(config, config_path)
  vocab = hf_vocabulary.read_vocabulary(
    folder, layout['hf_vocab_size'], layout['hf_target_vocab_size']
  )
  arrays, weight_files = hf_files.read_weights(folder)
  where = os.path.join(folder, weight_files[0])
  # One table for both sides only where both sides' ids are the same pieces.
  layout['shared_table'] = layout['tied'] and layout['share'] and not vocab.separate
  max_len = min(max_len, layout['max_position_embeddings'])
  params = map_params(arrays, layout, vocab, max_len, where)
  model_config = TransformerConfig(
    vocab_size=vocab.vocab_size,
    max_len=max_len,
    share_embeddings=layout['shared_table'] and layout['scale'],
    pre_norm=False,
    learned_positions=layout['d_model'] % 2 == 1,  # map_params: odd widths keep tables.
    layer_norm_epsilon=LAYER_NORM_EPSILON,
    attention_bias=True,
    logits_bias=True,
    **{k: layout[k] for k in ('d_model', 'num_heads', 'num_encoder_layers', 'num_decoder_layers')},
    d_ff=layout['d_ff'],
    ffn_activation=layout['ffn_activation'],
  )
  origin = {
    'format': 'huggingface-marian',
    'model': model,
    'folder': os.path.abspath(folder),
    'files': weight_files + vocab.files,
    'model_sha256': [paths.file_sha256(os.path.join(folder, f)) for f in weight_files],
    'config': {k: config[k] for k in sorted(config) if isinstance(config[k], (bool, int, str))},
    'mapped': {
      **layout,
      'pieces_appended_as_unk': vocab.extra,
      'separate_vocabularies': vocab.separate,
    },
  }
  return model_config, params, vocab.vocabulary, origin, vocab.target_vocabulary


def import_hf_model(model: str, workdir: str, *, max_len: int = 512, force: bool = False) -> None:
  """`import_marian --model=` a MarianMT folder or Hub repo id: read here, written by
  workdir_writer.write (its --force rules)."""
  if os.path.isdir(model):
    paths.check_outputs_apart({'--workdir': workdir}, {'--model': model})
  model_config, params, vocabulary, origin, target_vocabulary = read_model(model, max_len)
  workdir_writer.write(
    workdir,
    model_config,
    params,
    vocabulary,
    origin,
    target_vocabulary=target_vocabulary,
    force=force,
  )
