"""Training: the pure `train_step` (`step`), the `Trainer` that jits it over a device mesh
(`trainer`, sharding rules in `sharding`), the loop (`loop.train_and_evaluate`), run-config
validation (`run_config`), the optimiser and loss, preemption, host memory and metric writers."""

from transformer_jax.training.loop import train_and_evaluate
from transformer_jax.training.step import TrainState, train_step
from transformer_jax.training.trainer import Trainer

__all__ = ['TrainState', 'Trainer', 'train_and_evaluate', 'train_step']
