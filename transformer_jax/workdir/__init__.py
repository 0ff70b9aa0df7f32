"""A training run's folder: its on-disk layout (`layout`, the one place that names its files),
its lock (`lock` locally, `gcs_lock` in Cloud Storage) and the rules for a workdir made from a
pretrained model (`imported`)."""

from transformer_jax.workdir.layout import Workdir, check_folder_writable

__all__ = ['Workdir', 'check_folder_writable']
