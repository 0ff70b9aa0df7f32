"""Our model written as a Marian / OPUS-MT model: the inverse of
`transformer_jax.importers.marian.read_model`, so that an import can be checked bit for bit."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import numpy as np

from transformer_jax.testing.marian_npz import (
  EOS,
  EOS_ID,
  LAYER_NORM_EPS,
  MARIAN_VERSION,
  UNK,
  UNK_ID,
  marian_meta_array,
  marian_model_config,
  marian_tensor_shapes,
  marian_yaml,
  write_vocab_yml,
)

# ---------------------------------------------------------------------------------------------
# Our model -> Marian: the inverse of transformer_jax.importers.marian.read_model

# The version strings written for our ffn_activation (Marian's 'gelu' changed meaning in v1.12.3).
_MARIAN_ACTIVATIONS = {
  'swish': ('swish', MARIAN_VERSION),
  'silu': ('swish', MARIAN_VERSION),
  'relu': ('relu', MARIAN_VERSION),
  'gelu_sigmoid': ('gelu', MARIAN_VERSION),  # v1.11: x * sigmoid(1.702 x)
  'gelu': ('gelu', 'v1.12.14 2d067afb 2024-02-16 11:44:13 -0500'),  # erf
}
# TransformerConfig fields a Marian transformer has these values of (marian._MARIAN).
_MARIAN_FIELDS = dict(
  attention_bias=True,
  logits_bias=True,
  sinusoid_layout='concatenated',
  learned_positions=False,
  layer_norm_epsilon=LAYER_NORM_EPS,
  qk_dim=None,
  v_dim=None,
)


def marian_arrays_from_params(
  params: Mapping, model_config, *, allow_nonzero_bos: bool = False
) -> dict[str, np.ndarray]:
  """Our parameters as the tensors Marian saves, with `special:model.yml`: exactly what
  `transformer_jax.importers.marian.read_model` maps back (its `map_params`, inverted row by row).

  params: our tree (numpy or JAX arrays, float32), that of `Transformer(model_config)`; layer
    stacks have a leading layer axis. model_config: a `TransformerConfig` with Marian's
    switches (attention_bias, logits_bias, sinusoid_layout='concatenated', no learned
    positions, layer_norm_epsilon 1e-6, no qk_dim / v_dim); post- or pre-norm; any
    FFN_ACTIVATIONS; shared embeddings (`Wemb`, `tied-embeddings-all`) or not (`encoder_Wemb`,
    `decoder_Wemb`, `decoder_ff_logit_out_Wt`, no tying).

  Shapes (d = d_model, f = d_ff, h = heads, dk = d / h, V = vocab_size, Vm = V - 2):
    ours  {encoder,decoder}_layers/*_attention/{query,key,value}/kernel [L, d, h, dk] -> Marian
          {side}_l{i}_{self,context}_W{q,k,v} [d, d] (head j = columns j*dk:(j+1)*dk);
          .../bias [L, h, dk] -> _b{q,k,v} [1, d]; out/kernel [L, h, dk, d] -> _Wo [d, d];
          out/bias [L, d] -> _bo [1, d]; ffn/wi [L, d, f] + [L, f] -> ffn_W1 [d, f], ffn_b1
          [1, f]; ffn/wo [L, f, d] + [L, d] -> ffn_W2, ffn_b2; each block's norm [L, d] ->
          `{prefix}_ln_{scale,bias}` [1, d] (`_pre` suffix if pre-norm); pre-norm's
          {encoder,decoder}_norm [d] -> {side}_top_ln_* [1, d].
    vocab shared_embedding [V, d] -> Wemb [Vm, d] (or source/target_embedding [V, d] ->
          encoder_Wemb / decoder_Wemb, output_projection/kernel [d, V] ->
          decoder_ff_logit_out_Wt [Vm, d]); logits_bias [V] -> decoder_ff_logit_out_b [1, Vm].
          Marian row k is our row `marian.our_ids(Vm)[k]`: 0 (</s>) = our EOS 1, 1 (<unk>) = our
          UNK 3, k >= 2 = our k + 2.

  Marian has no PAD and no BOS, so their rows and logit biases are dropped; importing gives
  them zero rows and bias `marian.MASKED_LOGIT_BIAS`. The PAD row is never a real input (padded
  keys are masked, padded queries unused), so only the PAD logit changes. The BOS row is our
  decoder's first input, where Marian feeds a zero vector: a non-zero BOS row would change every
  translation, so it is refused unless `allow_nonzero_bos` (then the model written is another).
  """
  from transformer_jax.data.tokenizer import BOS_ID
  from transformer_jax.importers import marian

  for name, value in _MARIAN_FIELDS.items():
    if name == 'logits_bias':
      continue  # False is written as output-omit-bias: true.
    if getattr(model_config, name) != value:
      raise ValueError(
        f'Marian has {name}={value!r}; this model has {getattr(model_config, name)!r}'
      )
  if model_config.ffn_activation not in _MARIAN_ACTIVATIONS:
    raise ValueError(f'no Marian FFN activation for {model_config.ffn_activation!r}')
  activation, version = _MARIAN_ACTIVATIONS[model_config.ffn_activation]
  params = _numpy_tree(params)
  shared = model_config.share_embeddings
  layout = {
    'd_model': model_config.d_model,
    'd_ff': model_config.d_ff,
    'num_heads': model_config.num_heads,
    'num_encoder_layers': model_config.num_encoder_layers,
    'num_decoder_layers': model_config.num_decoder_layers,
    'pre_norm': model_config.pre_norm,
  }
  arrays: dict[str, np.ndarray] = {}
  for side, rows in marian._layer_tensors(layout).items():  # (name, our path, Marian shape, ours)
    stack = params[f'{side}_layers']
    for name, path, marian_shape, _ in rows:
      node = stack
      for key in path:
        node = node[key]
      for i in range(1, layout[f'num_{side}_layers'] + 1):
        arrays[f'{side}_l{i}_{name}'] = node[i - 1].reshape(marian_shape)
    if model_config.pre_norm:
      for key in ('scale', 'bias'):
        arrays[f'{side}_top_ln_{key}'] = params[f'{side}_norm'][key][None]

  vocab_size = model_config.vocab_size
  rows = marian.our_ids(vocab_size - 2)  # Our row of each Marian id.
  bos_rows = []
  if shared:
    table = params['shared_embedding']['embedding']
    arrays['Wemb'] = table[rows]
    bos_rows.append(table[BOS_ID])
  else:
    source = params['source_embedding']['embedding']
    target = params['target_embedding']['embedding']
    arrays['encoder_Wemb'], arrays['decoder_Wemb'] = source[rows], target[rows]
    arrays['decoder_ff_logit_out_Wt'] = params['output_projection']['kernel'].T[rows]
    bos_rows.append(target[BOS_ID])
  if not allow_nonzero_bos and any(np.any(row) for row in bos_rows):
    raise ValueError(
      'the BOS embedding row is not zero: Marian starts decoding from a zero vector, so this '
      'model is not representable (allow_nonzero_bos=True writes it with a zero start)'
    )
  if model_config.logits_bias:
    arrays['decoder_ff_logit_out_b'] = params['logits_bias'][rows][None]
  config = marian_model_config(
    vocab_size=vocab_size - 2,
    d_model=model_config.d_model,
    d_ff=model_config.d_ff,
    heads=model_config.num_heads,
    encoder_layers=model_config.num_encoder_layers,
    decoder_layers=model_config.num_decoder_layers,
    tied_embeddings='all' if shared else 'none',
    activation=activation,
    pre_norm=model_config.pre_norm,
    logits_bias=model_config.logits_bias,
    extra_config={'version': version},
  )
  arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}
  expected = marian_tensor_shapes(config)
  got = {k: v.shape for k, v in arrays.items()}
  if got != expected:  # A guard on this function: Marian's names and shapes, independently.
    raise AssertionError(f'written {sorted(got.items())}, Marian has {sorted(expected.items())}')
  arrays['special:model.yml'] = marian_meta_array(marian_yaml(config))
  return arrays


def _numpy_tree(tree):
  if isinstance(tree, Mapping):
    return {k: _numpy_tree(v) for k, v in tree.items()}
  return np.asarray(tree, dtype=np.float32)


def marian_vocabulary_from_ours(vocabulary: bytes) -> tuple[list[str], bytes]:
  """(Marian's pieces by id, a `.spm` with those ids) of our SentencePiece model (pad 0, eos 1,
  bos 2, unk 3): `</s>`=0, `<unk>`=1, then our pieces 4.. as Marian ids 2.. (`marian.our_ids`),
  bos and pad off, as Marian trains one (`train_sentencepiece`). Normaliser, model type, scores
  and piece types are ours, so it segments text into the same pieces."""
  from sentencepiece import sentencepiece_model_pb2

  ours = sentencepiece_model_pb2.ModelProto.FromString(vocabulary)
  reserved = [p.piece for p in ours.pieces[:4]]
  if reserved != ['<pad>', EOS, '<s>', UNK]:
    raise ValueError(f'expected our reserved pieces <pad>, </s>, <s>, <unk>, got {reserved}')
  Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
  proto = sentencepiece_model_pb2.ModelProto()
  for field in ('trainer_spec', 'normalizer_spec', 'denormalizer_spec'):
    if ours.HasField(field):
      getattr(proto, field).CopyFrom(getattr(ours, field))
  proto.pieces.add(piece=EOS, score=0.0, type=Piece.CONTROL)
  proto.pieces.add(piece=UNK, score=0.0, type=Piece.UNKNOWN)
  for piece in ours.pieces[4:]:
    proto.pieces.add().CopyFrom(piece)
  spec = proto.trainer_spec
  spec.vocab_size = len(proto.pieces)
  spec.eos_id, spec.unk_id, spec.bos_id, spec.pad_id = EOS_ID, UNK_ID, -1, -1
  spec.eos_piece, spec.unk_piece = EOS, UNK
  return [p.piece for p in proto.pieces], proto.SerializeToString()


@dataclasses.dataclass(frozen=True)
class MarianExport:
  """A folder written by `write_marian_model_from_params`, laid out as OPUS-MT releases are."""

  directory: str
  npz: str
  vocab: str  # The vocab .yml, listed twice in decoder.yml (one shared vocabulary).
  source_spm: str
  target_spm: str
  decoder_yml: str
  pieces: list[str]  # Marian's, by id
  arrays: dict

  @property
  def vocabs(self) -> list[str]:  # As MarianFiles.vocabs (marian_npz_check.convert).
    return [self.vocab, self.vocab]


def write_marian_model_from_params(
  directory,
  params: Mapping,
  model_config,
  vocabulary: bytes,
  *,
  name: str = 'opus',
  allow_nonzero_bos: bool = False,
) -> MarianExport:
  """Writes our model as an OPUS-MT folder: `{name}.model1.npz` (`marian_arrays_from_params`),
  `{name}.vocab.yml` and `source.spm` (`marian_vocabulary_from_ours`; `target.spm` a copy, one
  shared vocabulary), `decoder.yml` (OPUS-MT's settings). vocabulary: our SentencePiece model's
  bytes (a workdir's vocab.model). `python -m transformer_jax.import_marian --model=DIRECTORY`
  reads it back."""
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  arrays = marian_arrays_from_params(params, model_config, allow_nonzero_bos=allow_nonzero_bos)
  pieces, spm = marian_vocabulary_from_ours(vocabulary)
  if len(pieces) != model_config.vocab_size - 2:
    raise ValueError(
      f'{len(pieces) + 2} vocabulary pieces, the model has {model_config.vocab_size}'
    )
  npz = os.path.join(directory, f'{name}.model1.npz')
  np.savez(npz, **arrays)  # Uncompressed, like cnpy::npz_save.
  vocab = write_vocab_yml(os.path.join(directory, f'{name}.vocab.yml'), pieces)
  spms = [os.path.join(directory, f'{side}.spm') for side in ('source', 'target')]
  for path in spms:
    with open(path, 'wb') as f:
      f.write(spm)
  decoder_yml = os.path.join(directory, 'decoder.yml')
  with open(decoder_yml, 'w', encoding='utf-8') as f:
    f.write(f'models:\n  - {os.path.basename(npz)}\nvocabs:\n')
    f.write(f'  - {os.path.basename(vocab)}\n' * 2)
    f.write('beam-size: 6\nnormalize: 0.6\nword-penalty: 0\nmini-batch: 16\nmaxi-batch: 100\n')
    f.write('maxi-batch-sort: src\nrelative-paths: true\n')
  return MarianExport(directory, npz, vocab, spms[0], spms[1], decoder_yml, pieces, arrays)


def write_marian_model_from_workdir(directory, workdir: str, checkpoint=None, **kwargs):
  """`write_marian_model_from_params` of a trained workdir's parameters (`checkpoint` as
  `inference.Translator.from_checkpoint`: default the averaged if current, else the latest)."""
  from transformer_jax.inference.translator import Translator

  translator = Translator.from_checkpoint(workdir, checkpoint)
  return write_marian_model_from_params(
    directory,
    translator.params,
    translator.model_config,
    translator.tokenizer.model_bytes,
    **kwargs,
  )
