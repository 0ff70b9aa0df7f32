"""The paper's base model on WMT14 English -> German (Vaswani et al., 2017, Table 3 'base').

    pip install -e '.[prepare]'
    python -m transformer_jax.prepare_data --dataset=wmt14_translate/de-en --data_dir=DATA
    python train.py --config=configs/base.py --workdir=runs/base --config.data_dir=DATA

100k steps of ~25,000 source and ~25,000 target tokens (the paper: 12 hours on 8 P100s),
a shared ~37k BPE vocabulary, checkpoints averaged over the last 5 for evaluation.
"""

from transformer_jax.configs import default


def get_config():
  config = default.get_config()
  # tfds 'wmt14_translate/de-en' (features 'de' and 'en'; newstest2013 is 'validation',
  # newstest2014 'test'), prepared beforehand by `python -m transformer_jax.prepare_data`.
  config.dataset = 'wmt14_translate/de-en'
  # English -> German: the feature names of the source and the target.
  config.data.src_lang = 'en'
  config.data.tgt_lang = 'de'
  # Pairs longer than 256 pieces on either side (a fraction of a percent of WMT14) are skipped
  # in training; evaluation inputs are truncated to it.
  config.max_source_length = 256
  config.max_target_length = 256

  # The paper's shared byte-pair vocabulary of ~37,000 pieces, trained on both sides of the
  # first 500k training pairs (one million sentences, SentencePiece's sample bound).
  config.vocab_size = 37_000
  config.vocab_model_type = 'bpe'
  config.vocab_max_examples = 500_000

  # The paper's base model (TransformerConfig.base): N=6, d_model=512, d_ff=2048, h=8, 0.1.
  config.model.d_model = 512
  config.model.d_ff = 2048
  config.model.num_heads = 8
  config.model.num_encoder_layers = 6
  config.model.num_decoder_layers = 6
  config.model.dropout_rate = 0.1
  config.model.attention_dropout_rate = 0.0
  # Room for the longest input plus the 50 extra tokens decoding may emit.
  config.model.max_len = 512

  # Length-bucketed batches of ~25,000 padded tokens per side (global, over all devices).
  config.batching = 'tokens'
  config.tokens_per_batch = 25_000

  # The paper's schedule: 100k steps, 4,000 warmup steps, scale 1; Adam(0.9, 0.98, 1e-9).
  config.num_train_steps = 100_000
  config.warmup_steps = 4_000
  config.learning_rate_scale = 1.0
  config.cooldown_fraction = 0.0  # The paper's schedule has no cooldown.
  config.label_smoothing = 0.1

  config.log_every_steps = 200
  config.eval_every_steps = 5_000
  # Greedy BLEU on the first 500 newstest2013 sentences at each evaluation (the paper's
  # beam-4 figures: `python -m transformer_jax.average` then `transformer_jax.evaluate`).
  config.eval_decode_examples = 500
  config.eval_batch_size = 64
  config.final_test_decode = False
  # The paper wrote a checkpoint every 10 minutes (~1,400 base steps on 8 P100s) and averaged
  # the last 5; keep a few more than that.
  config.checkpoint_every_steps = 1_000
  config.keep_checkpoints = 8
  return config
