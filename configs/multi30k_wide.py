"""Multi30k English -> German with a wider, shallower model: the recipe of 2026-11-30.

    python train.py --config=configs/multi30k_wide.py --workdir=runs/multi30k-wide

d_model 256, d_ff 1024, 3+3 layers, 7.6M parameters, 3,000 steps: 38.5 cased sacreBLEU on
test2016 (average of the last 5, beam 4, alpha 0.6; docs/training.md, "Your own parallel
text"). It learns faster per step than `configs/multi30k.py`'s Transformer-tiny shape but runs
~2.5x fewer steps per CPU-second (0.52-0.57 in its first 200 steps against 1.3-1.55 steps/s on
a 2-core Xeon), and within 2 hours it ends behind it (39.33 against 40.38 cased BLEU on
validation, each at its best alpha).
"""

from transformer_jax.configs import multi30k


def get_config():
  config = multi30k.get_config()
  config.model.d_model = 256
  config.model.d_ff = 1024
  config.model.num_heads = 4
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  # 0.2 rather than the tiny shape's 0.3: this wider model underfits less with it.
  config.model.dropout_rate = 0.2
  config.model.attention_dropout_rate = 0.1

  # Its own data setting of 2026-11-30, not the tiny recipe's: 8k pieces, ~4k-token batches.
  config.vocab_size = 8000
  config.tokens_per_batch = 4096
  # 3,000 steps of ~4k tokens = 20 epochs, ~2 h 05 min on 2 cores of an AMD EPYC (2026-11-30).
  config.num_train_steps = 3000
  config.warmup_steps = 500
  # Peak learning rate 0.7 x 256^-0.5 x 500^-0.5 = 1.96e-3 at step 500.
  config.learning_rate_scale = 0.7
  # Its 3,000 steps, however long they take (as measured).
  config.train_time_limit_minutes = 0.0
  config.cooldown_minutes = 0.0  # It has no time budget to end.
  config.eval_every_steps = 500
  config.checkpoint_every_steps = 250
  return config
