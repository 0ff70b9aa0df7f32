"""Pretrained models into workdirs: Marian / OPUS-MT models (`marian`) and their vocabularies
(`marian_vocabulary`), written as an imported workdir (`workdir_writer`)."""

from transformer_jax.importers.workdir_writer import import_marian_model

__all__ = ['import_marian_model']
