"""Checkpoints: training state saved and restored with orbax (`checkpointer`, the one module
that imports it), params-only checkpoints with checksums (`checksums`), checkpoint averaging
(`averaging`) and which parameters a workdir serves (`served`)."""

from transformer_jax.checkpoints.averaging import average_checkpoints
from transformer_jax.checkpoints.checkpointer import (
  Checkpointer,
  read_metadata,
  restore_params_from,
  save_params,
)

__all__ = [
  'Checkpointer',
  'average_checkpoints',
  'read_metadata',
  'restore_params_from',
  'save_params',
]
