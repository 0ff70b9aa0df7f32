"""transformers MarianMT checkpoints (a folder, or a Hub repo id) as transformer_jax models,
computing what `MarianMTModel` computes.

`read_model` reads config.json, the weights (`hf_files`), vocab.json and source.spm /
target.spm, and returns what `workdir_writer.write` takes:

  layers     post-norm (MarianMTModel has no other), layer norm epsilon 1e-5 (torch's
             default), attention biases; torch Linear weights [out, in] become our kernels
             [in, out], the q/k/v/out projections split into heads.
  positions  MarianMTModel's sinusoids ([sin | cos] halves at timescales 10000^(2i/d), which
             neither of our sinusoid layouts is) as learned position tables, computed as it
             computes them: exact, and fine-tuning may then move them (MarianMTModel's are frozen).
  ids        HF: </s>=0, <unk>=1, ..., <pad>=pad_token_id, the decoder's start. Ours: PAD=0,
             EOS=1, BOS=2, UNK=3, then HF's ids from 2 on (marian.our_ids without <pad>). The
             <pad> row becomes both our PAD and BOS rows, so our BOS at position 0 is HF's
             decoder start. Our PAD's logit is HF's <pad> logit, which our searches and scores
             leave out, as the Helsinki-NLP generation configs do (bad_words_ids [[pad]]); BOS
             and the pieces the .spm has beyond vocab.json get MASKED_LOGIT_BIAS.
  embeddings tied as MarianMTModel ties them: with tie_word_embeddings, the shared table (or the
             decoder's, without share_encoder_decoder_embeddings) is the output too; without,
             transformers ties nothing. scale_embedding=False (our embedder always multiplies by
             sqrt(d)) divides the input tables by sqrt(d), which unties them from the output.
  vocabulary vocab.json's ids with source.spm's segmentation (target.spm segments targets), as
             MarianTokenizer, language tags (a leading >>deu<<) and special tokens (</s>, <unk>,
             <pad>) cut out first as it cuts them (Tokenizer's MarianTokenizer rules); pieces
             the .spm has beyond vocab.json (MarianTokenizer: <unk>) come last with <unk>'s
             rows (marian_vocabulary).

Refused, one line naming the field: another model_type, separate source and target
vocabularies (decoder_vocab_size != vocab_size, separate_vocabs), encoder and decoder of
different widths, activations we lack (gelu_new, ...), and legacy fields MarianMTModel ignores
whose value says it computes something else (normalize_before, static_position_embeddings, ...).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError, is_integer
from transformer_jax.data.tokenizer import BOS_ID, PAD_ID, with_marian_rules
from transformer_jax.importers import hf_files, workdir_writer
from transformer_jax.importers.marian import MASKED_LOGIT_BIAS, our_ids
from transformer_jax.importers.marian_vocabulary import sentencepiece_vocabulary
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
  if not share and _field(config, 'decoder_vocab_size', vocab_size) != vocab_size:
    refuse(
      'decoder_vocab_size', f'separate source and target vocabularies (vocab_size={vocab_size})'
    )
  for name, want in (('eos_token_id', 0), ('pad_token_id', vocab_size - 1)):
    if config.get(name, want) != want:
      refuse(name, f'expected {want}: </s> first, <pad> last, as Marian conversions have them')
  if _field(config, 'decoder_start_token_id', vocab_size - 1) != vocab_size - 1:
    refuse('decoder_start_token_id', f'decoding starts from <pad> ({vocab_size - 1})')
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
    'max_position_embeddings': max_pos,
    'share': share,
    'tied': _field(config, 'tie_word_embeddings', True),
    'scale': _field(config, 'scale_embedding', False),
  }


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


def map_params(arrays: dict, layout: dict, vocab_size: int, extra: int, max_len: int, path: str):
  """MarianMTModel's tensors as our parameter tree (marian.map_params' layout); shapes and
  values checked against the config first."""
  d, h, v_hf = layout['d_model'], layout['num_heads'], layout['hf_vocab_size']
  expected = expected_shapes(layout)
  embedding_names = {
    'model.shared.weight',
    'model.encoder.embed_tokens.weight',
    'model.decoder.embed_tokens.weight',
    'lm_head.weight',
  }
  expected.update({n: (v_hf, d) for n in embedding_names & set(arrays)})
  expected['final_logits_bias'] = (1, v_hf)
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

  def rows(hf_table: np.ndarray) -> np.ndarray:
    """An HF [V, ...] table in our id order: <pad>'s row at PAD and BOS, <unk>'s at extras."""
    out = np.zeros((vocab_size, *hf_table.shape[1:]), np.float32)
    out[our_ids(v_hf - 1)] = hf_table[:-1]
    out[[PAD_ID, BOS_ID]] = hf_table[-1]
    out[vocab_size - extra :] = hf_table[1]
    return out

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
          n: {'kernel': get(f'{theirs}.{p}.weight').T.reshape(d, h, d // h),
              'bias': get(f'{theirs}.{p}.bias').reshape(h, d // h)}
          for p, n in _ATTENTION
        }  # fmt: skip
        attention['out'] = {
          'kernel': get(f'{theirs}.out_proj.weight').T.reshape(h, d // h, d),
          'bias': get(f'{theirs}.out_proj.bias'),
        }
        layer[ours] = attention
        ln = f'{theirs}_layer_norm'
        layer[norm] = {'norm': {'scale': get(f'{ln}.weight'), 'bias': get(f'{ln}.bias')}}
      layer['ffn'] = {
        'wi': {'kernel': get('fc1.weight').T, 'bias': get('fc1.bias')},
        'wo': {'kernel': get('fc2.weight').T, 'bias': get('fc2.bias')},
      }
      layer['ffn_block'] = {
        'norm': {'scale': get('final_layer_norm.weight'), 'bias': get('final_layer_norm.bias')}
      }
      layers.append(layer)
    params[f'{side}_layers'] = _stack(layers)
  for embedder in ('source_embedder', 'target_embedder'):
    params[embedder] = {'position_embedding': table[:max_len].copy()}

  source, target, output = _tables(arrays, layout, path)
  scale = 1.0 if layout['scale'] else 1 / math.sqrt(d)  # Ours multiplies by sqrt(d) always.
  if layout['shared_table'] and scale == 1.0:
    params['shared_embedding'] = {'embedding': rows(source)}
  else:
    params['source_embedding'] = {'embedding': rows(source * scale)}
    params['target_embedding'] = {'embedding': rows(target * scale)}
    params['output_projection'] = {'kernel': rows(output).T.copy()}
  bias = rows(arrays.get('final_logits_bias', np.zeros((1, v_hf), np.float32))[0])
  bias[BOS_ID] += MASKED_LOGIT_BIAS
  bias[vocab_size - extra :] += MASKED_LOGIT_BIAS
  params['logits_bias'] = bias
  return params


def _stack(layers: list[dict]) -> dict:
  """Per-layer trees as one tree of [layers, ...] float32 arrays (our scanned stacks)."""
  first = layers[0]
  if isinstance(first, dict):
    return {k: _stack([layer[k] for layer in layers]) for k in first}
  return np.stack([np.asarray(layer, np.float32) for layer in layers])


def _check_agrees(vocab: dict, vocab_path: str, spm_path: str) -> None:
  """Refuses a vocab.json that is not this .spm's (another model's, say). MarianTokenizer would
  read each .spm piece vocab.json lacks as <unk>; a Marian vocabulary built from the data that
  .spm segmented lacks at most its rare pieces, so half of them missing is another vocabulary."""
  import sentencepiece

  processor = sentencepiece.SentencePieceProcessor(model_file=spm_path)  # Read and checked.
  pieces = [
    processor.id_to_piece(i)
    for i in range(processor.get_piece_size())
    if not (processor.is_control(i) or processor.is_unknown(i))
  ]
  missing = [piece for piece in pieces if piece not in vocab]
  if 2 * len(missing) > len(pieces):
    raise UserInputError(
      f'{vocab_path}: disagrees with {os.path.basename(spm_path)}: {len(missing)} of its '
      f"{len(pieces)} pieces are not in it (e.g. {missing[0]!r:.40}): another model's vocabulary"
    )


def read_vocabulary(folder: str, hf_vocab_size: int) -> tuple[bytes, bytes | None, int, list]:
  """(vocabulary, target vocabulary or None, pieces appended as <unk>, files) of a MarianMT
  folder, as MarianTokenizer reads it: vocab.json's ids, source.spm / target.spm segmenting."""
  inside = lambda name: os.path.join(folder, name)  # noqa: E731
  for name in ('vocab.json', 'source.spm', 'target.spm'):
    if not os.path.exists(inside(name)):
      raise UserInputError(f'--model={folder}: {name} is missing (MarianTokenizer needs it)')
  tokenizer_config = inside('tokenizer_config.json')
  if os.path.exists(tokenizer_config):
    settings = hf_files.read_json(tokenizer_config, 'tokenizer config')
    if isinstance(settings, dict) and settings.get('separate_vocabs'):
      raise UserInputError(
        f'{tokenizer_config}: separate_vocabs=true is not supported: separate source and '
        'target vocabularies'
      )
  vocab_path = inside('vocab.json')
  vocab = hf_files.read_json(vocab_path, 'vocabulary')
  if not isinstance(vocab, dict) or not all(
    isinstance(k, str) and is_integer(v) for k, v in vocab.items()
  ):
    raise UserInputError(f'{vocab_path}: not a map of pieces to ids')
  pieces = {v: k for k, v in vocab.items()}
  if sorted(pieces) != list(range(hf_vocab_size)):
    raise UserInputError(
      f'{vocab_path}: ids are not 0..{hf_vocab_size - 1} each once (config.json vocab_size)'
    )
  by_id = [pieces[i] for i in range(hf_vocab_size)]
  if by_id[-1] != '<pad>':
    raise UserInputError(f'{vocab_path}: id {hf_vocab_size - 1} is {by_id[-1]!r:.40}, not <pad>')
  source_spm, target_spm = inside('source.spm'), inside('target.spm')
  with open(source_spm, 'rb') as a, open(target_spm, 'rb') as b:
    same = a.read() == b.read()
  vocabulary, target_vocabulary, extra = sentencepiece_vocabulary(
    by_id[:-1], source_spm, vocab_path, None if same else target_spm
  )
  for spm_path in [source_spm] + ([] if same else [target_spm]):
    _check_agrees(vocab, vocab_path, spm_path)
  # Language tags (>>deu<<) and special tokens are cut out before SentencePiece, as
  # MarianTokenizer cuts them: the rule rides in the vocabulary's bytes (data/tokenizer.py).
  vocabulary = with_marian_rules(vocabulary)
  target_vocabulary = target_vocabulary and with_marian_rules(target_vocabulary)
  return vocabulary, target_vocabulary, extra, ['vocab.json', 'source.spm', 'target.spm']


def read_model(model: str, max_len: int = 512):
  """(config, params, vocabulary, origin, target vocabulary or None) of a MarianMT folder or
  Hub repo id (see the module docstring)."""
  folder = hf_files.resolve_repo(model) if hf_files.is_repo_id(model) else model
  config_path = os.path.join(folder, hf_files.HF_CONFIG)
  if not os.path.exists(config_path):
    raise UserInputError(f'--model={model}: config.json is missing (not a transformers folder)')
  config = hf_files.read_json(config_path, 'config')
  layout = check_config(config, config_path)
  vocabulary, target_vocabulary, extra, vocab_files = read_vocabulary(
    folder, layout['hf_vocab_size']
  )
  arrays, weight_files = hf_files.read_weights(folder)
  where = os.path.join(folder, weight_files[0])
  layout['shared_table'] = layout['tied'] and layout['share']
  max_len = min(max_len, layout['max_position_embeddings'])
  vocab_size = layout['hf_vocab_size'] + 1 + extra  # Without <pad>, with PAD and BOS.
  params = map_params(arrays, layout, vocab_size, extra, max_len, where)
  model_config = TransformerConfig(
    vocab_size=vocab_size,
    max_len=max_len,
    share_embeddings=layout['shared_table'] and layout['scale'],
    pre_norm=False,
    learned_positions=True,
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
    'files': weight_files + vocab_files,
    'model_sha256': [paths.file_sha256(os.path.join(folder, f)) for f in weight_files],
    'config': {k: config[k] for k in sorted(config) if isinstance(config[k], (bool, int, str))},
    'mapped': {**layout, 'pieces_appended_as_unk': extra},
  }
  return model_config, params, vocabulary, origin, target_vocabulary


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
