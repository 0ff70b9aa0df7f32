"""Our parameters as `MarianMTModel`'s tensors, for `exporters.huggingface` (whose docstring
says what is bridged and why): the inverse of `importers.hf_marian.map_params`.

`tensors` takes the HF ids of each side as arrays of our ids (`source_ids[j]`: our id at
MarianMT's id j; the last, MarianMT's <pad>, is our BOS) and the order of the hidden units
(`hidden_order[j]`: our feature at MarianMT's feature j, `feature_order`), and returns
name -> float32 array as `MarianMTModel.save_pretrained` names them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transformer_jax.common.errors import UserInputError
from transformer_jax.data.tokenizer import BOS_ID, PAD_ID
from transformer_jax.importers.hf_marian import interleaved_order, sinusoids
from transformer_jax.importers.marian import MASKED_LOGIT_BIAS
from transformer_jax.model.config import TransformerConfig

# How far a learned position table may be from MarianMTModel's sinusoids (the importer's own
# check of a checkpoint's stored tables, hf_marian.map_params): an import's tables are them.
POSITION_TOLERANCE = 1e-6


def feature_order(config: TransformerConfig, params) -> np.ndarray:
  """The permutation of the hidden units that makes our positions MarianMTModel's, or a
  one-line UserInputError naming the field where none does."""
  d = config.d_model
  if d % 2:  # MarianMTModel: d // 2 + 1 sines; ours: d // 2 and a zero feature.
    raise UserInputError(
      f'TransformerConfig.d_model={d}: MarianMTModel has no sinusoids for an odd width '
      '(its last feature is a sine, ours is zero)'
    )
  if not config.learned_positions:
    if config.sinusoid_layout != 'interleaved':
      raise UserInputError(
        f'TransformerConfig.sinusoid_layout={config.sinusoid_layout!r}: its timescales '
        "10000^(i/(d/2-1)) are not MarianMTModel's 10000^(2i/d), which only 'interleaved' "
        'has (MarianMTModel has no other positions)'
      )
    return interleaved_order(d)
  # Learned tables (an import of an odd width, or one written before imports were permuted to
  # our sinusoids): exportable only where they are the sinusoids MarianMTModel computes, in its
  # order or in our interleaved one.
  theirs = sinusoids(config.max_len, d)
  tables = [
    np.asarray(params[f'{side}_embedder']['position_embedding'], np.float32)
    for side in ('source', 'target')
  ]
  distances = {}
  for name, order in (('its', np.arange(d)), ('interleaved', interleaved_order(d))):
    distances[name] = max(float(np.abs(table[:, order] - theirs).max()) for table in tables)
    if distances[name] <= POSITION_TOLERANCE:
      return order
  raise UserInputError(
    'TransformerConfig.learned_positions=True: the position tables are not the sinusoids '
    f'MarianMTModel computes (at best {min(distances.values()):.3g} away; fine-tuning moves '
    'them), and MarianMTModel has no learned positions'
  )


def _array(x) -> np.ndarray:
  return np.asarray(x, np.float32)


def _layer(tree, index: int):
  """One layer's parameters out of a scanned stack (leading 'layers' axis)."""
  if isinstance(tree, dict):
    return {name: _layer(value, index) for name, value in tree.items()}
  return _array(tree[index])


def _linear_in(kernel: np.ndarray, order: np.ndarray) -> np.ndarray:
  """A kernel [d_model, ...] reading the hidden units -> torch Linear weight [out, d_model]."""
  return np.ascontiguousarray(kernel[order].reshape(len(order), -1).T)


def _linear_out(kernel: np.ndarray, order: np.ndarray) -> np.ndarray:
  """A kernel [..., d_model] writing the hidden units -> torch Linear weight [d_model, in]."""
  d = kernel.shape[-1]
  return np.ascontiguousarray(kernel.reshape(-1, d)[:, order].T)


def _attention(attention: dict, order: np.ndarray, prefix: str, out: dict) -> None:
  d = len(order)
  for ours, theirs in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
    projection = attention[ours]
    out[f'{prefix}.{theirs}.weight'] = _linear_in(projection['kernel'], order)
    bias = projection.get('bias')  # [heads, head]; none without attention_bias: zeros.
    out[f'{prefix}.{theirs}.bias'] = (
      np.zeros(d, np.float32) if bias is None else bias.reshape(-1).astype(np.float32)
    )
  out[f'{prefix}.out_proj.weight'] = _linear_out(attention['out']['kernel'], order)
  bias = attention['out'].get('bias')
  out[f'{prefix}.out_proj.bias'] = np.zeros(d, np.float32) if bias is None else bias[order]


def _norm(norm: dict, order: np.ndarray, prefix: str, out: dict) -> None:
  out[f'{prefix}.weight'] = norm['scale'][order]
  out[f'{prefix}.bias'] = norm['bias'][order]


def _ffn(ffn: dict, order: np.ndarray, prefix: str, out: dict) -> None:
  out[f'{prefix}fc1.weight'] = _linear_in(ffn['wi']['kernel'], order)
  out[f'{prefix}fc1.bias'] = ffn['wi']['bias']
  out[f'{prefix}fc2.weight'] = _linear_out(ffn['wo']['kernel'], order)
  out[f'{prefix}fc2.bias'] = ffn['wo']['bias'][order]


def pad_is_predicted(config: TransformerConfig, params) -> bool:
  """Whether MarianMT's <pad> logit must be our PAD's rather than our BOS's. An HF import's BOS
  is masked (hf_marian: PAD's bias + MASKED_LOGIT_BIAS), so our softmax sums PAD's logit, the
  checkpoint's <pad>, and not BOS's; fine-tuning moves PAD's row and bias, not BOS's (e^-30 of
  the softmax), so the margin, not the equality, says so. A model trained here masks neither:
  <pad>'s logit is BOS's (module docstring of exporters.huggingface)."""
  if not config.logits_bias:
    return False
  bias = _array(params['logits_bias'])
  return bool(bias[BOS_ID] - bias[PAD_ID] <= MASKED_LOGIT_BIAS / 2)


def one_table(config: TransformerConfig, params, separate_vocabularies: bool) -> bool:
  """Whether one MarianMT table (share_encoder_decoder_embeddings and tie_word_embeddings) holds
  our model exactly: ours share one over one vocabulary, and <pad>'s one row can be both the
  decoder's start (our BOS) and the logit (our PAD, `pad_is_predicted`). A fine-tuned import's
  PAD and BOS rows differ: its tables are written apart."""
  if not config.share_embeddings or separate_vocabularies:
    return False
  if not pad_is_predicted(config, params):
    return True
  table = _array(params['shared_embedding']['embedding'])
  return bool(np.array_equal(table[PAD_ID], table[BOS_ID]))


def output_ids(config: TransformerConfig, params, target_ids: np.ndarray) -> np.ndarray:
  """Our id of each MarianMT output class: the target's ids, whose last (<pad>) is our BOS, or
  our PAD where PAD's logit is the prediction (`pad_is_predicted`)."""
  ids = np.array(target_ids)
  if pad_is_predicted(config, params):
    ids[-1] = PAD_ID
  return ids


def output_bias(config: TransformerConfig, params, output: np.ndarray) -> np.ndarray:
  """final_logits_bias [1, V_target]: our logits_bias (or zeros) at `output_ids`; import ->
  export gives the checkpoint's own bias back (its <pad>'s is our PAD's)."""
  if not config.logits_bias:
    return np.zeros((1, len(output)), np.float32)
  return _array(params['logits_bias'])[output][None]


def tensors(
  config: TransformerConfig,
  params: Any,
  source_ids: np.ndarray,
  target_ids: np.ndarray,
  hidden_order: np.ndarray,
  one_table: bool,
) -> dict[str, np.ndarray]:
  """MarianMTModel's state dict (float32, positions left out: it computes them) of our
  parameters; one_table (the function's): `model.shared.weight` alone
  (share_encoder_decoder_embeddings and tie_word_embeddings), else the encoder's, decoder's
  and output tables apart (neither)."""
  order = hidden_order
  out: dict[str, np.ndarray] = {}
  layers = params['encoder_layers']
  for i in range(config.num_encoder_layers):
    layer, prefix = _layer(layers, i), f'model.encoder.layers.{i}.'
    _attention(layer['self_attention'], order, f'{prefix}self_attn', out)
    _norm(layer['attention_block']['norm'], order, f'{prefix}self_attn_layer_norm', out)
    _ffn(layer['ffn'], order, prefix, out)
    _norm(layer['ffn_block']['norm'], order, f'{prefix}final_layer_norm', out)
  layers = params['decoder_layers']
  for i in range(config.num_decoder_layers):
    layer, prefix = _layer(layers, i), f'model.decoder.layers.{i}.'
    _attention(layer['self_attention'], order, f'{prefix}self_attn', out)
    _norm(layer['self_attention_block']['norm'], order, f'{prefix}self_attn_layer_norm', out)
    _attention(layer['cross_attention'], order, f'{prefix}encoder_attn', out)
    _norm(layer['cross_attention_block']['norm'], order, f'{prefix}encoder_attn_layer_norm', out)
    _ffn(layer['ffn'], order, prefix, out)
    _norm(layer['ffn_block']['norm'], order, f'{prefix}final_layer_norm', out)

  def rows(table, ids) -> np.ndarray:  # Our [V, d] table at a side's ids, hidden units ordered.
    return np.ascontiguousarray(_array(table)[ids][:, order])

  if config.share_embeddings:
    source = target = output = params['shared_embedding']['embedding']
  else:
    source = params['source_embedding']['embedding']
    target = params['target_embedding']['embedding']
    output = _array(params['output_projection']['kernel']).T  # [d, V] -> [V, d]
  outputs = output_ids(config, params, target_ids)
  if one_table:  # `one_table`: here <pad>'s rows at outputs and at target_ids are equal.
    out['model.shared.weight'] = rows(source, source_ids)
  else:
    out['model.encoder.embed_tokens.weight'] = rows(source, source_ids)
    out['model.decoder.embed_tokens.weight'] = rows(target, target_ids)
    out['lm_head.weight'] = rows(output, outputs)
  out['final_logits_bias'] = output_bias(config, params, outputs)
  return {name: np.ascontiguousarray(value, np.float32) for name, value in out.items()}
