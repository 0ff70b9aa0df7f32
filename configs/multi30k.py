"""Multi30k English -> German (29k caption pairs) from the local files, on a CPU budget.

    python train.py --config=configs/multi30k.py --workdir=runs/multi30k \
        [--config.data.dir=PATH/TO/multi30k]

    python -m transformer_jax.average --workdir=runs/multi30k --last=5
    python -m transformer_jax.evaluate --workdir=runs/multi30k --alpha=1.5 \
        --src=../shared/data/multi30k/test.en --ref=../shared/data/multi30k/test.de

The paper's base model is far too big for 29k pairs. This is the Transformer-tiny shape of Wu
et al. (ACL 2021): 4+4 layers of width 128, d_ff 256, dropout 0.3, 2.0M parameters, trained for
2 hours on 2 CPU cores (118 minutes of train.py, however many steps that is) in 2k-token
batches, ending in a 15-minute cooldown whose last 5 checkpoints are averaged. It learns more
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
  # A joint BPE vocabulary sized for a 29k-pair corpus: 5,000 pieces learn as well as 8,000
  # and make the output projection cheaper (1.11x per step; bench/README.md, issue 28).
  config.vocab_size = 5000
  config.vocab_max_examples = 29_000

  config.batching = 'tokens'
  # 2k-token batches: a step's time is linear in its tokens, so this is twice the updates per
  # epoch at the same tokens per second, and per token seen it learns ahead of 4k-token batches.
  config.tokens_per_batch = 2048

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
  # (evaluations and checkpoints included), or at 30,000 steps of ~2k tokens if that comes first.
  # A 2-core Xeon ran 3.3-4.0 steps/s (26,691 steps in the time, ~98 epochs).
  config.num_train_steps = 30_000
  config.train_time_limit_minutes = 118.0
  # A long warmup to a high peak: 1.8 x 128^-0.5 x 4000^-0.5 = 2.5e-3 at step 4,000 (the tokens
  # of 2,000 steps of 4k; Wu et al. use 5e-3 at 2k steps of ~8k tokens).
  config.warmup_steps = 4000
  config.learning_rate_scale = 1.8
  # The last 15 minutes: a linear cooldown to 0 of the steps that fit (measured as the run goes).
  # Its checkpoints averaged: validation 40.83 cased BLEU against 40.42 for the same run without
  # it, averaged over its last 10 (bench/README.md, "Multi30k recipe levers").
  config.cooldown_minutes = 15.0
  config.cooldown_fraction = 0.0
  config.label_smoothing = 0.1

  config.log_every_steps = 100
  # Every 2,000 steps: each evaluation (validation loss, greedy BLEU on 256 captions) costs
  # ~6 s of the 2-h budget.
  config.eval_every_steps = 2000
  # Greedy BLEU on the first 256 validation captions at each evaluation (beam search and the
  # whole test set: `python -m transformer_jax.evaluate`).
  config.eval_decode_examples = 256
  config.final_test_decode = False
  config.eval_batch_size = 128
  config.checkpoint_every_steps = 400
  # The last 5 (the last ~7 minutes of the cooldown) are averaged.
  config.keep_checkpoints = 10
  return config
