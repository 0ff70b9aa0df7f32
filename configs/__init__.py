"""Training configs, installed as the package `transformer_jax.configs` (pyproject.toml maps this
directory there), so that a config imports its base as `from transformer_jax.configs import
default` wherever it is loaded from, and `--config=configs/x.py` works from the checkout."""

import os


def default_config_file() -> str:
  """The path of `default.py`, the config commands load when `--config` is not given."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'default.py')
