"""A workdir made from a pretrained model (`python -m transformer_jax.import_marian`): what it
holds, and the rules training and translation follow for it.

    DIR/config.json   {'config': a run config (configs/default.py with the model's fields),
                       'model': the TransformerConfig, 'imported_from': where it came from}
    DIR/vocab.model   the model's vocabulary, a SentencePiece model in our id order
    DIR/target_vocab.model  optional: the same pieces and ids, segmenting target text as the
                      model's training did (OPUS-MT's target.spm), for fine-tuning
    DIR/imported/     the parameters, a params-only checkpoint (as DIR/averaged/)

Translation (`inference`): with no training checkpoint, the imported parameters are the latest.

Training (`train.py --workdir=DIR ...`, to fine-tune): the architecture and the vocabulary are
the imported model's whatever the command line says (`adopt`: a flag cannot resize a trained
model); the data, the schedule and the training-only model fields (dropout, dtype, remat,
attention kernel) are the command line's. The first run starts from the imported parameters
with a fresh optimiser state (`train_lib`); until its first checkpoint the data fields may
differ from config.json's (`run_config.save_run_config`), after which resuming follows the
usual rules.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from transformer_jax import checkpointing, marian
from transformer_jax.config import TransformerConfig
from transformer_jax.configs import default
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import UserInputError
from transformer_jax.models import Transformer
from transformer_jax.workdir import Workdir, check_folder_writable

# The key of config.json that marks an imported workdir (its value: where the model came from).
IMPORTED_KEY = 'imported_from'
# TransformerConfig fields a fine-tuning run may set itself: they change how the model trains
# or computes, not what its parameters mean. Every other field is the imported model's.
TRAINING_FIELDS = ('dropout_rate', 'attention_dropout_rate', 'remat', 'attention_impl', 'dtype')


def architecture_fields() -> tuple[str, ...]:
  """The TransformerConfig fields an imported model fixes (vocab_size: config.vocab_size)."""
  names = (field.name for field in dataclasses.fields(TransformerConfig))
  return tuple(n for n in names if n not in TRAINING_FIELDS and n != 'vocab_size')


def is_imported(saved: dict | None) -> bool:
  """Whether a saved run config (`Workdir.read_run_config_if_present`) is an imported model's."""
  return saved is not None and isinstance(saved.get(IMPORTED_KEY), dict)


def run_config(model_config: TransformerConfig, vocab_model_type: str) -> ml_collections.ConfigDict:
  """configs/default.py with the model's architecture and vocabulary, data 'text' (a model of
  natural language: BLEU is reported) and dropout 0.1 (the paper's; fine-tuning sets its own)."""
  config = default.get_config()
  for name in architecture_fields():
    config.model[name] = getattr(model_config, name)
  config.model.dropout_rate = 0.1
  config.vocab_size = model_config.vocab_size
  config.vocab_model_type = vocab_model_type
  config.dataset = 'text'
  return config


def _model_type(vocabulary: bytes) -> str:
  """The SentencePiece model's algorithm as config.vocab_model_type names it ('bpe', ...)."""
  from sentencepiece import sentencepiece_model_pb2

  proto = sentencepiece_model_pb2.ModelProto.FromString(vocabulary)
  return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(proto.trainer_spec.model_type).lower()


def _check_params(model_config: TransformerConfig, params: Any) -> None:
  """The tree `Transformer(model_config)` creates, leaf by leaf: names, shapes, float32."""
  dummy = jnp.ones((1, 1), jnp.int32)
  expected = nn.meta.unbox(
    jax.eval_shape(Transformer(model_config).init, jax.random.PRNGKey(0), dummy, dummy)['params']
  )
  want = {
    jax.tree_util.keystr(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(expected)
  }
  got = {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(params)}
  if set(want) != set(got):
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    raise ValueError(f'imported parameters: missing {missing[:5]}, unexpected {extra[:5]}')
  for name, shape in want.items():
    if np.shape(got[name]) != shape or np.asarray(got[name]).dtype != np.float32:
      raise ValueError(
        f'imported parameter {name}: {np.asarray(got[name]).dtype}{list(np.shape(got[name]))}, '
        f'expected float32{list(shape)}'
      )


def write(
  workdir: str,
  model_config: TransformerConfig,
  params: Any,
  vocabulary: bytes,
  origin: dict,
  *,
  target_vocabulary: bytes | None = None,
  force: bool = False,
) -> None:
  """Writes an imported workdir (the module docstring); config.json last, so that a crash
  leaves no folder that looks complete.

  An existing folder that holds anything is refused unless `force`, which replaces only an
  imported workdir no training has used (never a training run's checkpoints).
  """
  target = Workdir(workdir)
  target.check_not_a_file()
  if target.path.exists() and any(target.path.iterdir()):
    saved = target.read_run_config_if_present()
    trained = checkpointing.list_steps(target.checkpoints)[0] if target.checkpoints.exists() else []
    if not is_imported(saved) or trained:
      raise UserInputError(
        f'--workdir={target.path} is not empty and holds no untrained imported model; '
        'give a new folder'
      )
    if not force:
      raise UserInputError(
        f'--workdir={target.path} holds an imported model already; --force replaces it'
      )
    target.path.rmtree()
  check_folder_writable(target.path, '--workdir')
  tokenizer = Tokenizer(vocabulary, '<imported vocabulary>')
  if tokenizer.vocab_size != model_config.vocab_size:
    raise ValueError(
      f'the imported vocabulary has {tokenizer.vocab_size} pieces, the model '
      f'{model_config.vocab_size}'
    )
  if target_vocabulary is not None:
    targets = Tokenizer(target_vocabulary, '<imported target vocabulary>')
    if targets.pieces(range(targets.vocab_size)) != tokenizer.pieces(range(tokenizer.vocab_size)):
      raise ValueError('the imported target vocabulary has other pieces than the vocabulary')
  _check_params(model_config, params)
  config = run_config(model_config, _model_type(vocabulary))
  target.path.mkdir(parents=True, exist_ok=True)
  target.vocab_file.write_bytes(vocabulary)
  if target_vocabulary is not None:
    target.target_vocab_file.write_bytes(target_vocabulary)
  checkpointing.save_params(str(target.imported), params, {IMPORTED_KEY: origin})
  target.write_run_config(
    {
      'config': json.loads(config.to_json()),
      'model': model_config.to_dict(),
      IMPORTED_KEY: origin,
    }
  )


def import_marian(
  model: str,
  workdir: str,
  *,
  vocab: str | None = None,
  spm: str | None = None,
  target_spm: str | None = None,
  max_len: int = 512,
  force: bool = False,
) -> None:
  """`python -m transformer_jax.import_marian`: reads a Marian model (`marian.import_marian`:
  a .npz, or an OPUS-MT folder, with its vocabulary) and writes it as the imported workdir
  `workdir` (`write`)."""
  model_config, params, vocabulary, origin, target_vocabulary = marian.import_marian(
    model, vocab, spm, max_len=max_len, target_spm=target_spm
  )
  write(
    workdir,
    model_config,
    params,
    vocabulary,
    origin,
    target_vocabulary=target_vocabulary,
    force=force,
  )


def adopt(config: ml_collections.ConfigDict, workdir: Workdir) -> None:
  """For a run in an imported workdir: the model's architecture and vocabulary into `config`
  (in place), logging any field the command line set otherwise. Other workdirs: nothing."""
  saved = workdir.read_run_config_if_present()
  if not is_imported(saved):
    return
  changed = []
  for name in architecture_fields():
    value = saved['model'][name]
    if config.model[name] != value:
      changed.append(f'model.{name}: {config.model[name]!r} -> {value!r}')
      config.model[name] = value
  for name, value in (
    ('vocab_size', saved['model']['vocab_size']),
    ('vocab_model_type', saved['config']['vocab_model_type']),
  ):
    if config[name] != value:
      changed.append(f'{name}: {config[name]!r} -> {value!r}')
      config[name] = value
  if changed:
    logging.info(
      '%s holds an imported model: its architecture and vocabulary replace the config (%s)',
      workdir.path,
      ', '.join(changed),
    )
