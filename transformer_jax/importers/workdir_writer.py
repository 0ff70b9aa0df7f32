"""Writes a workdir from a pretrained model's parameters and vocabulary (`write`), and
`python -m transformer_jax.import_marian`'s whole job (`import_marian_model`: a Marian model read
by `importers.marian`, written here). What such a workdir holds and the rules training and
translation follow for it: `workdir.imported`."""

from __future__ import annotations

import json
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from transformer_jax.checkpoints import checkpointer
from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.configs import default
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.importers import marian
from transformer_jax.model.config import TransformerConfig, architecture_fields
from transformer_jax.model.transformer import Transformer
from transformer_jax.workdir.imported import IMPORTED_KEY, is_imported
from transformer_jax.workdir.layout import Workdir, check_folder_writable


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
  imported workdir no training has used (never a training run's checkpoints). Locally the new
  one is written beside it and then takes its place (`paths.staged_folder`): a crash at any
  instant leaves the old workdir or the new one, whole. A bucket has no rename of a folder:
  there the old one is removed first (docs/reliability.md).
  """
  target = Workdir(workdir)
  target.check_not_a_file()
  replacing = False
  if target.path.exists() and any(target.path.iterdir()):
    saved = target.read_run_config_if_present()
    trained = checkpointer.list_steps(target.checkpoints)[0] if target.checkpoints.exists() else []
    if not is_imported(saved) or trained:
      raise UserInputError(
        f'--workdir={target.path} is not empty and holds no untrained imported model; '
        'give a new folder'
      )
    if not force:
      raise UserInputError(
        f'--workdir={target.path} holds an imported model already; --force replaces it'
      )
    replacing = True
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
  if replacing and not paths.is_gcs(target.path):
    check_folder_writable(target.path.parent, "--workdir's parent folder")
    with paths.staged_folder(os.fspath(target.path)) as staging:
      _write_files(
        Workdir(staging), model_config, config, params, vocabulary, origin, target_vocabulary
      )
    return
  if replacing:
    target.path.rmtree()
  _write_files(target, model_config, config, params, vocabulary, origin, target_vocabulary)


def _write_files(target, model_config, config, params, vocabulary, origin, target_vocabulary):
  """The imported workdir's files into `target`, config.json last."""
  target.path.mkdir(parents=True, exist_ok=True)
  target.vocab_file.write_bytes(vocabulary)
  if target_vocabulary is not None:
    target.target_vocab_file.write_bytes(target_vocabulary)
  checkpointer.save_params(str(target.imported), params, {IMPORTED_KEY: origin})
  target.write_run_config(
    {
      'config': json.loads(config.to_json()),
      'model': model_config.to_dict(),
      IMPORTED_KEY: origin,
    }
  )


def import_marian_model(
  model: str,
  workdir: str,
  *,
  vocab: str | None = None,
  spm: str | None = None,
  target_spm: str | None = None,
  max_len: int = 512,
  force: bool = False,
) -> None:
  """`python -m transformer_jax.import_marian`: reads a Marian model (`marian.read_model`:
  a .npz, or an OPUS-MT folder, with its vocabulary) and writes it as the imported workdir
  `workdir` (`write`)."""
  paths.check_outputs_apart(
    {'--workdir': workdir},
    {'--model': model, '--vocab': vocab, '--spm': spm, '--target_spm': target_spm},
  )
  model_config, params, vocabulary, origin, target_vocabulary = marian.read_model(
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
