"""A trained workdir -> an OPUS-MT-style Marian folder -> import_marian -> the same translations.

    python bench/marian_pretrained.py --workdir=runs/multi30k-marian --out=/tmp/marian-bench \
        [--src=../shared/data/multi30k/test.en --ref=../shared/data/multi30k/test.de]

The workdir's model must have Marian's architecture (attention_bias, swish/relu/gelu FFN,
sinusoid_layout=concatenated, logits_bias, layer_norm_epsilon 1e-6) and zero PAD and BOS
embedding rows: Marian has no PAD and starts decoding from a zero vector where ours embeds BOS
(transformer_jax/testing/marian_export.py, `marian_arrays_from_params`);
bench/train_marian_start.py trains such a model (train.py with those rows held at zero).
Steps, each timed:
  1. `marian_export.write_marian_model_from_workdir` -> OUT/marian (npz, vocab .yml, source.spm,
     target.spm, decoder.yml);
  2. `python -m transformer_jax.import_marian --model=OUT/marian --workdir=OUT/imported`;
     the imported parameters against the workdir's, leaf by leaf;
  3. both workdirs translate --src (beam --beam_size, alpha --alpha): BLEU and chrF of each,
     how many hypotheses are equal;
  4. CTranslate2's MarianConverter on the .npz, Marian-exact (Marian's sinusoids and layer-norm
     epsilon, as tests/import_marian_test.py) and stock: the largest difference of the
     references' teacher-forced log-probs (first --scored pairs) from the imported model's, and
     greedy (and beam) agreement with it, decoded alike (`ctranslate2_runtime.translate`).
Prints one line per number and writes OUT/results.json. A few minutes on 2 CPU cores for the
1,000 Multi30k test sentences and a 7.6M-parameter model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, '..', 'shared', 'data', 'multi30k')

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Trained workdir with a Marian-compatible model.')
flags.DEFINE_string('out', None, 'Folder for the Marian model, the import and the results.')
flags.DEFINE_string('checkpoint', None, "Step, 'averaged' or 'latest' (default: as evaluate).")
flags.DEFINE_string('src', os.path.join(DATA, 'test.en'), 'Source sentences.')
flags.DEFINE_string('ref', os.path.join(DATA, 'test.de'), 'References.')
flags.DEFINE_integer('beam_size', 4, 'Beam size of the BLEU comparison.')
flags.DEFINE_float('alpha', 0.6, 'Length penalty of the BLEU comparison.')
flags.DEFINE_integer('limit', 0, 'Only the first N sentences (0: all).')
flags.DEFINE_integer('scored', 200, 'Pairs whose reference log-probs both sides compute.')
flags.DEFINE_bool('ctranslate2_beam', True, 'Also compare CTranslate2 beam search.')
flags.mark_flags_as_required(['workdir', 'out'])


class Timer:
  def __init__(self):
    self.times: dict[str, float] = {}

  def __call__(self, name):
    self.name = name
    return self

  def __enter__(self):
    self.start = time.monotonic()

  def __exit__(self, *exc):
    self.times[self.name] = round(time.monotonic() - self.start, 1)
    print(f'[{self.name}: {self.times[self.name]:.1f}s]', flush=True)


def leaves(tree) -> dict:
  import jax
  import numpy as np

  return {
    jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)
  }


def teacher_forced_log_probs(translator, sources, targets):
  """Our log-prob of each target piece and the final EOS, per pair (ids from our tokenizer)."""
  import jax
  import numpy as np

  from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, PAD_ID

  tokenizer = translator.tokenizer
  src_ids = [[*ids, EOS_ID] for ids in tokenizer.encode_batch(sources)]
  tgt_ids = [[*ids, EOS_ID] for ids in tokenizer.encode_batch(targets)]
  width = max(map(len, src_ids + tgt_ids))
  src = np.full((len(src_ids), width), PAD_ID, np.int32)
  tgt_in = np.full((len(tgt_ids), width), PAD_ID, np.int32)
  for r, (s, t) in enumerate(zip(src_ids, tgt_ids)):
    src[r, : len(s)], tgt_in[r, : len(t)] = s, [BOS_ID, *t[:-1]]
  logits = jax.jit(translator.model.apply)({'params': translator.params}, src, tgt_in)
  log_probs = np.asarray(jax.nn.log_softmax(logits))
  pieces = [tokenizer.pieces(s[:-1]) for s in src_ids], [tokenizer.pieces(t[:-1]) for t in tgt_ids]
  return [log_probs[r, np.arange(len(t)), t] for r, t in enumerate(tgt_ids)], pieces


def equal_count(a, b):
  return sum(x == y for x, y in zip(a, b))


def main(argv):
  del argv
  import ctranslate2
  import numpy as np
  import sentencepiece

  from transformer_jax import cli
  from transformer_jax.common import text_io
  from transformer_jax.evaluation import metrics
  from transformer_jax.exporters import ctranslate2_runtime
  from transformer_jax.inference.translator import Translator
  from transformer_jax.testing import marian_export, marian_npz_check

  out = os.path.abspath(FLAGS.out)
  os.makedirs(out, exist_ok=True)
  marian_dir, imported = os.path.join(out, 'marian'), os.path.join(out, 'imported')
  timer, results = Timer(), {'workdir': os.path.abspath(FLAGS.workdir)}
  sources = text_io.read_lines(FLAGS.src, '--src')
  references = text_io.read_lines(FLAGS.ref, '--ref')
  if FLAGS.limit:
    sources, references = sources[: FLAGS.limit], references[: FLAGS.limit]
  results['sentences'] = len(sources)

  with timer('1. write the Marian folder'):
    checkpoint = cli.checkpoint_flag_value(FLAGS.checkpoint)
    trained = Translator.from_checkpoint(FLAGS.workdir, checkpoint)
    files = marian_export.write_marian_model_from_params(
      marian_dir, trained.params, trained.model_config, trained.tokenizer.model_bytes
    )
  results['marian_files'] = sorted(os.listdir(marian_dir))
  results['marian_tensors'] = len(files.arrays) - 1
  max_len = trained.model_config.max_len

  with timer('2. import_marian'):
    command = [
      sys.executable,
      '-m',
      'transformer_jax.import_marian',
      f'--model={marian_dir}',
      f'--workdir={imported}',
      f'--max_len={max_len}',
    ]
    if os.path.exists(imported):
      command.append('--force')
    subprocess.run(command, check=True, cwd=REPO)
    back = Translator.from_checkpoint(imported)
  ours, theirs = leaves(trained.params), leaves(back.params)
  differing = sorted(k for k in ours if not np.array_equal(ours[k], theirs[k]))
  results['parameters_differing'] = differing
  if differing:  # Expected: logits_bias at PAD and BOS (MASKED_LOGIT_BIAS after the import).
    results['parameter_differences'] = {
      k: {
        'indices': np.argwhere(ours[k] != theirs[k]).tolist()[:8],
        'before': ours[k][ours[k] != theirs[k]].tolist()[:8],
        'after': theirs[k][ours[k] != theirs[k]].tolist()[:8],
      }
      for k in differing
    }
  results['vocabulary_pieces_equal'] = trained.tokenizer.pieces(
    range(trained.tokenizer.vocab_size)
  ) == back.tokenizer.pieces(range(back.tokenizer.vocab_size))
  results['source_ids_equal'] = equal_count(
    trained.tokenizer.encode_batch(sources), back.tokenizer.encode_batch(sources)
  )

  decode = dict(beam_size=FLAGS.beam_size, alpha=FLAGS.alpha)
  with timer(f'3a. the workdir translates (beam {FLAGS.beam_size})'):
    before = trained.translate(sources, **decode)
  with timer(f'3b. the imported workdir translates (beam {FLAGS.beam_size})'):
    after = back.translate(sources, **decode)
  with timer('3c. the imported workdir translates (greedy)'):
    after_greedy = back.translate(sources, beam_size=1)
  for name, hypotheses in (('trained', before), ('imported', after)):
    score = metrics.score(hypotheses, references)
    results[f'bleu_{name}'], results[f'chrf_{name}'] = score['bleu'], score['chrf']
  results['bleu_imported_greedy'] = metrics.score(after_greedy, references)['bleu']
  results['hypotheses_equal'] = equal_count(before, after)
  text_io.write_lines(before, os.path.join(out, 'hypotheses.trained.de'), flag='--out')
  text_io.write_lines(after, os.path.join(out, 'hypotheses.imported.de'), flag='--out')

  processor = sentencepiece.SentencePieceProcessor(model_file=files.source_spm)
  scored = slice(0, FLAGS.scored)  # Teacher-forced log-probs of the references, both sides.
  ours_scores, (source_pieces, target_pieces) = teacher_forced_log_probs(
    back, sources[scored], references[scored]
  )
  results['scored_pairs'] = len(ours_scores)
  results['scored_tokens'] = int(sum(map(len, ours_scores)))
  for kind in ('exact', 'stock'):
    with timer(f'4. CTranslate2 MarianConverter ({kind}): convert'):
      model = marian_npz_check.convert(
        files, os.path.join(out, f'ct2-{kind}'), marian_exact=kind == 'exact'
      )
      translator = ctranslate2.Translator(model, device='cpu', intra_threads=2)

    def run(**options):
      return ctranslate2_runtime.translate(
        translator, processor, sources, max_len=max_len, **options
      )

    theirs_scores = translator.score_batch(source_pieces, target_pieces)
    results[f'ctranslate2_{kind}_max_log_prob_difference'] = max(
      float(np.max(np.abs(np.array(t.log_probs) - o))) for t, o in zip(theirs_scores, ours_scores)
    )
    with timer(f'4. CTranslate2 ({kind}) translates (greedy)'):
      greedy = run(beam_size=1)
    results[f'ctranslate2_{kind}_greedy_equal'] = equal_count(greedy, after_greedy)
    results[f'ctranslate2_{kind}_greedy_bleu'] = metrics.score(greedy, references)['bleu']
    if FLAGS.ctranslate2_beam:
      with timer(f'4. CTranslate2 ({kind}) translates (beam {FLAGS.beam_size})'):
        beam = run(**decode)
      results[f'ctranslate2_{kind}_beam_equal'] = equal_count(beam, after)
      results[f'ctranslate2_{kind}_beam_bleu'] = metrics.score(beam, references)['bleu']
      if kind == 'exact':
        # CTranslate2's own search on both sides (decode.beam_search rule 'ctranslate2'), no
        # length penalty: the outputs should be equal, not only close.
        with timer(f'4. beam {FLAGS.beam_size}, rule ctranslate2, alpha 0: both sides'):
          ours = back.translate(
            sources, beam_size=FLAGS.beam_size, alpha=0.0, beam_rule='ctranslate2'
          )
          theirs = run(beam_size=FLAGS.beam_size, alpha=0.0)
        results['ctranslate2_rule_beam_equal'] = equal_count(ours, theirs)
  results['seconds'] = timer.times
  with open(os.path.join(out, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2)
  for key, value in results.items():
    print(f'{key}: {value}')


if __name__ == '__main__':
  app.run(main)
