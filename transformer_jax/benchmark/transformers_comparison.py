"""Ours beside transformers' `MarianMTModel.generate` on the same weights (issue 50, part 5):
`python -m transformer_jax.benchmark --sections=decode --compare=transformers`.

For one model size, a random `MarianMTModel` of that size (transformers' own initialisation,
swish FFN, shared tied embeddings, as Helsinki-NLP ships) with OPUS-MT en-de's vocabulary size
(58,101) is saved by `save_pretrained` and imported by `import_marian --model=` (importers/
hf_marian.py): both engines then hold the same weights. EOS is suppressed on both sides by one
parameter edit (its final_logits_bias -1e4 before saving, so the import carries it; <unk> and
the ids no piece has likewise), so every
sentence decodes exactly `decode_length` + 1 tokens: ours `decode_length` and the EOS its cap
forces, transformers `max_new_tokens` = `decode_length` + 1 (it never ends a beam itself).

Timed end to end, text in and text out, in alternating rounds:
  * ours: `Translator.translate(sources, beam_size, alpha)` of the imported workdir;
  * transformers: `MarianTokenizer` (padded batch) -> `generate(num_beams=beam_size)` ->
    `batch_decode`, under `torch.inference_mode()`, on `torch.set_num_threads(threads)` with
    threads = the cores XLA uses.
`ratio` = transformers' seconds / ours per round (ours' speed over theirs), median [min, max].
The sources are `batch_size` synthetic sentences of a SentencePiece model trained here on
synthetic words (the vocabulary's other ids are pieces no sentence uses, which changes no
product's shape). The two beam searches rank by different penalties (ours GNMT with `alpha`,
theirs |y|^length_penalty, 0 here) and end at the cap differently (ours forces EOS, theirs
returns the unfinished beams, one token longer, which is cut off to compare), so `same_output`
(the fraction of equal strings) is reported, not required.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

import numpy as np

from transformer_jax.benchmark import ctranslate2_comparison
from transformer_jax.benchmark.toolkit import _capped_model, _timed_rounds
from transformer_jax.common.errors import UserInputError
from transformer_jax.model.config import TransformerConfig

# Helsinki-NLP/opus-mt-en-de's config.json vocab_size: what CTranslate2's OPUS-MT benchmark runs.
OPUS_MT_VOCAB_SIZE = 58_101
# EOS's final_logits_bias: exp(-1e4) is 0 in float32, so EOS is never chosen nor scored.
_EOS_SUPPRESSION = -1e4
# The synthetic words the SentencePiece model is trained on and the sentences drawn from.
_WORDS = 400
_PIECES = 1_000


def require_transformers():
  """(torch, transformers), or a one-line UserInputError saying how to install them."""
  try:
    import torch
    import transformers
  except ImportError as error:
    raise UserInputError(
      f'--compare=transformers needs torch and transformers ({error}); '
      "pip install -e '.[test]' installs both"
    ) from None
  return torch, transformers


def _words(rng: np.random.Generator) -> list[str]:
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  return sorted({''.join(rng.choice(letters, rng.integers(3, 9))) for _ in range(_WORDS)})


def _tokenizer_files(folder: str, rng: np.random.Generator, vocab_size: int):
  """source.spm = target.spm, trained on synthetic words, and vocab.json of vocab_size ids as
  Marian's are laid out (</s> 0, <unk> 1, the pieces, unused pieces to fill, <pad> last).
  Returns (the words, the number of pieces the .spm has)."""
  import json
  import shutil

  from transformer_jax.testing import marian_npz

  words = _words(rng)
  text = [' '.join(rng.choice(words, rng.integers(8, 20))) for _ in range(3_000)]
  prefix = os.path.join(folder, 'source')
  pieces = marian_npz.train_sentencepiece(prefix, text, min(_PIECES, vocab_size - 1))
  for name in ('source.spm', 'target.spm'):  # Copies: a scratch folder, nothing to replace.
    shutil.copy(prefix + '.model', os.path.join(folder, name))
  fillers = [f'unused{i}' for i in range(vocab_size - 1 - len(pieces))]
  with open(os.path.join(folder, 'vocab.json'), 'w') as f:
    json.dump({p: i for i, p in enumerate([*pieces, *fillers, '<pad>'])}, f)
  return words, len(pieces)


def marian_folder(folder: str, model_config: TransformerConfig, vocab_size: int, seed: int):
  """A random MarianMTModel of model_config's sizes saved into `folder` as transformers saves
  one, EOS suppressed; returns (the model, the words its sentences are made of).

  <unk> and the unused ids are suppressed like EOS: outputs are then pieces both tokenizers
  turn into the same text (MarianTokenizer's skip_special_tokens drops <unk>, ours shows it),
  and every product keeps its shape."""
  torch, transformers = require_transformers()
  cfg = model_config
  os.makedirs(folder)
  words, pieces = _tokenizer_files(folder, np.random.default_rng(seed), vocab_size)
  config = transformers.MarianConfig(
    vocab_size=vocab_size,
    decoder_vocab_size=vocab_size,
    d_model=cfg.d_model,
    encoder_layers=cfg.num_encoder_layers,
    decoder_layers=cfg.num_decoder_layers,
    encoder_attention_heads=cfg.num_heads,
    decoder_attention_heads=cfg.num_heads,
    encoder_ffn_dim=cfg.d_ff,
    decoder_ffn_dim=cfg.d_ff,
    max_position_embeddings=512,
    activation_function='swish',
    pad_token_id=vocab_size - 1,
    decoder_start_token_id=vocab_size - 1,
    eos_token_id=0,
    forced_eos_token_id=None,
    scale_embedding=True,
  )
  torch.manual_seed(seed)
  model = transformers.MarianMTModel(config).eval()
  with torch.no_grad():
    model.final_logits_bias[0, 0] = _EOS_SUPPRESSION
    model.final_logits_bias[0, 1] = _EOS_SUPPRESSION  # <unk>
    model.final_logits_bias[0, pieces:] = _EOS_SUPPRESSION  # Unused, and <pad>.
  model.save_pretrained(folder)
  return model, words


def _sources(rng, words, tokenizer, count: int, decode_length: int) -> list[str]:
  """`count` sentences of 8-16 words, cut (at words) to fit our max_len (decode_length + 1) with
  their EOS: a longer one would be cut on our side only."""
  sources = []
  for _ in range(count):
    sentence = list(rng.choice(words, rng.integers(8, 17)))
    while len(sentence) > 1 and len(tokenizer(' '.join(sentence))['input_ids']) > decode_length + 1:
      sentence.pop()
    sources.append(' '.join(sentence))
  return sources


def compare_transformers(
  name: str,
  model_config: TransformerConfig,
  *,
  batch_size: int = 32,
  beam_size: int = 4,
  decode_length: int = 24,
  alpha: float = 0.6,
  rounds: int = 3,
  vocab_size: int = OPUS_MT_VOCAB_SIZE,
  seed: int = 0,
  dtype: str = 'float32',
  progress: Callable[[str], None] = lambda message: None,
) -> dict:
  """One row: model_config's sizes (d_model, layers, heads, d_ff; the vocabulary is
  `vocab_size`), ours and transformers end to end over one batch of `batch_size` sentences,
  both computing in `dtype` (ours: Translator's inference dtype, `cast_params`; theirs: the
  model cast by `model.to`, as `from_pretrained(..., dtype=)` loads it)."""
  torch, transformers = require_transformers()
  from transformer_jax.importers import hf_marian
  from transformer_jax.inference.translator import Translator

  threads = ctranslate2_comparison.xla_cpu_threads()
  torch.set_num_threads(threads)
  with tempfile.TemporaryDirectory(prefix='transformers-benchmark-') as directory:
    folder, workdir = os.path.join(directory, 'hf'), os.path.join(directory, 'workdir')
    progress(f'transformers: a random {name} MarianMTModel, saved and imported')
    model, words = marian_folder(folder, model_config, vocab_size, seed)
    hf_marian.import_hf_model(folder, workdir)
    restored = Translator.from_checkpoint(workdir, batch_size=batch_size)
    # Our cap: min(source + 50, max_len) tokens, EOS counted, so max_len = decode_length + 1.
    cfg, params = _capped_model(restored.model_config, restored.params, decode_length + 1)
    ours = Translator(
      cfg, params, restored.tokenizer, batch_size, restored.target_tokenizer, dtype=dtype
    )
    model = model.to(getattr(torch, dtype))
    tokenizer = transformers.MarianTokenizer.from_pretrained(folder)
  sources = _sources(np.random.default_rng(seed + 1), words, tokenizer, batch_size, decode_length)
  source_tokens = [len(tokenizer(s)['input_ids']) for s in sources]

  def translate_ours():
    return ours.translate(sources, beam_size=beam_size, alpha=alpha)

  beam_options = dict(length_penalty=0.0, early_stopping=False) if beam_size > 1 else {}

  def translate_theirs():
    with torch.inference_mode():
      batch = tokenizer(sources, return_tensors='pt', padding=True)
      generated = model.generate(
        **batch,
        num_beams=beam_size,
        max_new_tokens=decode_length + 1,
        do_sample=False,
        **beam_options,
      )
    return tokenizer.batch_decode(generated, skip_special_tokens=True), generated

  progress(f'transformers: {name}, beam {beam_size}, batch {batch_size}: first calls')
  translate_ours()  # Compilation.
  _, generated = translate_theirs()
  # Every output is decode_length + 1 tokens on both sides (after transformers' start token).
  their_tokens = int(generated.shape[1]) - 1
  progress(f'transformers: {name}: {rounds} alternating rounds')
  seconds, outputs = _timed_rounds(
    {'ours': translate_ours, 'transformers': translate_theirs}, rounds
  )
  tokens = batch_size * (decode_length + 1)
  ratios = [t / o for o, t in zip(seconds['ours'], seconds['transformers'])]
  figures = {}
  for side in ('ours', 'transformers'):
    median = float(np.median(seconds[side]))
    figures[side] = {
      'seconds_each_round': seconds[side],
      'sentences_per_second': batch_size / median,
      'target_tokens_per_second': tokens / median,
    }
  # Theirs cut where our cap forced the EOS: the first decode_length tokens of each.
  theirs = tokenizer.batch_decode(
    outputs['transformers'][1][:, 1 : decode_length + 1], skip_special_tokens=True
  )
  return {
    'model': name,
    'd_model': model_config.d_model,
    'layers': [model_config.num_encoder_layers, model_config.num_decoder_layers],
    'vocab_size': vocab_size,
    'batch_size': batch_size,
    'beam_size': beam_size,
    'alpha': alpha,
    'decode_length': decode_length,
    'target_tokens_each': decode_length + 1,
    'transformers_tokens_each': their_tokens,
    'mean_source_tokens': float(np.mean(source_tokens)),
    'threads': threads,
    'dtype': dtype,
    'rounds': rounds,
    'versions': {'transformers': transformers.__version__, 'torch': torch.__version__},
    'load_before': os.getloadavg(),
    **figures,
    'ratio': float(np.median(ratios)),
    'ratio_min': float(min(ratios)),
    'ratio_max': float(max(ratios)),
    'same_output': float(np.mean([a == b for a, b in zip(outputs['ours'], theirs)])),
  }
