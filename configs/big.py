"""The paper's big model on WMT14 English -> German (Table 3 'big': 28.4 BLEU on newstest2014).

    python train.py --config=configs/big.py --workdir=runs/big --config.data_dir=DATA

Same data and vocabulary as configs/base.py; 300k steps, dropout 0.3, last 20 checkpoints
averaged.
"""

from transformer_jax.configs import base


def get_config():
  config = base.get_config()
  # TransformerConfig.big: d_model=1024, d_ff=4096, h=16, P_drop=0.3 (for en->de).
  config.model.d_model = 1024
  config.model.d_ff = 4096
  config.model.num_heads = 16
  config.model.dropout_rate = 0.3
  # The paper trained big for 300k steps (3.5 days on 8 P100s).
  config.num_train_steps = 300_000
  config.eval_every_steps = 10_000
  # Checkpoints every ~10 minutes of the paper's big run, the last 20 averaged.
  config.checkpoint_every_steps = 2_000
  config.keep_checkpoints = 24
  # The parameters, Adam moments and activations of ~213M parameters at 25k tokens: shard
  # parameters and optimiser state over the devices (FSDP) rather than replicate them.
  config.mesh_shape = (1, -1, 1)
  return config
