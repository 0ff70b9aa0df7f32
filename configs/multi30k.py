"""Multi30k English -> German (29k caption pairs) from the local files, on a CPU budget.

    python train.py --config=configs/multi30k.py --workdir=runs/multi30k \
        [--config.data.dir=PATH/TO/multi30k]

    python -m transformer_jax.average --workdir=runs/multi30k --last=10
    python -m transformer_jax.evaluate --workdir=runs/multi30k --alpha=1.5 \
        --src=../shared/data/multi30k/test.en --ref=../shared/data/multi30k/test.de

The paper's base model is far too big for 29k pairs. This is the Transformer-tiny shape of Wu
et al. (ACL 2021): 4+4 layers of width 128, d_ff 256, dropout 0.3, 2.3M parameters, trained for
2 hours on 2 CPU cores (118 minutes of train.py, however many steps that is). It learns more
slowly per step than a wider model (`configs/multi30k_wide.py`) but runs ~2.5x more steps per
CPU-second, and ends ahead of it on the validation captions (docs/training.md, "Your own
parallel text").
"""

import os

from transformer_jax.configs import default


def get_config():
  config = default.get_config()
  config.dataset = 'text'
  # The shared data directory beside the repository checkout (override for your own copy).
  config.data.dir = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), '..', 'shared', 'data', 'multi30k'
  )
  config.data.src_lang = 'en'
  config.data.tgt_lang = 'de'
  # The text dataset's splits: valid.* becomes 'validation'.
  config.eval_split = 'validation'
  # Captions are short: 64 BPE pieces covers all but a handful of pairs (the rest are dropped).
  config.max_source_length = 64
  config.max_target_length = 64
  # A joint BPE vocabulary sized for a 29k-pair corpus.
  config.vocab_size = 8000
  config.vocab_max_examples = 29_000

  config.batching = 'tokens'
  config.tokens_per_batch = 4096

  config.model.d_model = 128
  config.model.d_ff = 256
  config.model.num_heads = 4
  config.model.num_encoder_layers = 4
  config.model.num_decoder_layers = 4
  # Wu et al.'s dropout 0.3, and no attention dropout, as theirs.
  config.model.dropout_rate = 0.3
  config.model.attention_dropout_rate = 0.0
  config.model.max_len = 128
  # Straight-line layers (same parameters): 1.07-1.09x per 4k-token step on 2 CPU cores. The
  # loss a few positions at a time: no faster at this vocabulary (1.01x), but the [4096, 8000]
  # logits never exist whole (bench/levers.py --size=multi30k; bench/README.md).
  config.model.unroll_layers = True
  config.loss_rows_per_chunk = 512

  # Two hours of train.py on 2 CPU cores, whatever their speed: stop at 118 minutes
  # (evaluations and checkpoints included), or at 14,000 steps of ~4k tokens (94 epochs) if that
  # comes first. A 2-core Xeon ran 1.56-1.75 steps/s (11,509 steps in the time; 1.3-1.45
  # before the unrolled layers above and the argmax-free accuracy). The rsqrt schedule does not
  # depend on num_train_steps (no cooldown), so a run stopped by the limit is the 14,000-step
  # run stopped early.
  config.num_train_steps = 14_000
  config.train_time_limit_minutes = 118.0
  # A long warmup to a high peak: 1.8 x 128^-0.5 x 2000^-0.5 = 3.56e-3 at step 2,000 (Wu et al.
  # use 5e-3 at 2k steps). Lower peaks (1.0 x: 2.0e-3) learned alike by step 2,500.
  config.warmup_steps = 2000
  config.learning_rate_scale = 1.8
  # No cooldown: averaging the last 10 checkpoints does its work.
  config.cooldown_fraction = 0.0
  config.label_smoothing = 0.1

  config.log_every_steps = 100
  # Every 1,000 steps: each evaluation (validation loss, greedy BLEU on 256 captions) costs
  # ~10 s of the 2-h budget.
  config.eval_every_steps = 1000
  # Greedy BLEU on the first 256 validation captions at each evaluation (beam search and the
  # whole test set: `python -m transformer_jax.evaluate`).
  config.eval_decode_examples = 256
  config.final_test_decode = False
  config.eval_batch_size = 128
  config.checkpoint_every_steps = 200
  # The last 10 (~30 minutes of training) are averaged: Wu et al. average their last 10 too.
  config.keep_checkpoints = 10
  return config
