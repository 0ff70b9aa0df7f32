"""Multi30k English -> German (29k caption pairs) from the local files, on a CPU budget.

    python train.py --config=configs/multi30k.py --workdir=runs/multi30k \
        [--config.data.dir=PATH/TO/multi30k]

The paper's base model is far too big for 29k pairs; a small model with strong dropout does well
(d_model 256, 3+3 layers, 7.6M parameters; the data README's Transformer-tiny reference, 4+4
layers of width 128, learns much more slowly per CPU-hour).
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

  config.model.d_model = 256
  config.model.d_ff = 1024
  config.model.num_heads = 4
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  # 0.2 rather than the reference's 0.3: this wider model underfits less with it.
  config.model.dropout_rate = 0.2
  config.model.attention_dropout_rate = 0.1
  config.model.max_len = 128

  # 3,000 steps of ~4k tokens = 20 epochs (the run measured in README.md, "Your own parallel
  # text", with its BLEU and the length penalty chosen on the validation captions).
  config.num_train_steps = 3000
  config.warmup_steps = 500
  # Peak learning rate 0.7 x 256^-0.5 x 500^-0.5 = 1.96e-3 at step 500.
  config.learning_rate_scale = 0.7
  # No cooldown: the measured run (README) had none, and checkpoint averaging does its work.
  config.cooldown_fraction = 0.0
  config.label_smoothing = 0.1

  config.log_every_steps = 100
  config.eval_every_steps = 500
  # Greedy BLEU on the first 256 validation captions at each evaluation (beam search and the
  # whole test set: `python -m transformer_jax.evaluate`).
  config.eval_decode_examples = 256
  config.final_test_decode = False
  config.eval_batch_size = 128
  config.checkpoint_every_steps = 250
  # Enough checkpoints for the paper's last-5 averaging and more.
  config.keep_checkpoints = 10
  return config
