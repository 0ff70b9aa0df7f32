"""Scoring a test set: the `evaluate` command's work (translate sources with a workdir's model,
score the hypotheses against references with `evaluation.metrics`, keep the hypotheses)."""

from __future__ import annotations

import time

from transformer_jax.common import paths, text_io
from transformer_jax.common.errors import UserInputError
from transformer_jax.evaluation.metrics import (
  bleu_is_meaningful,
  exact_match_by_category,
  format_categories,
  score,
  sentence_categories,
)
from transformer_jax.inference import models as model_choice
from transformer_jax.inference.options import DecodingOptions
from transformer_jax.inference.translator import Translator, check_decoding_options
from transformer_jax.workdir.layout import Workdir


def evaluate(
  translator: Translator,
  sources: list[str],
  references: list[str],
  *,
  beam_size: int = 4,
  alpha: float = 0.6,
  progress: bool = False,
  dataset: str | None = None,
  language: str | None = None,
  beam_rule: str = 'exact',
  **options,
) -> tuple[list[str], dict]:
  """(hypotheses, `score` of them plus 'seconds', 'sentences', 'exact_match', 'exact_matches',
  'bleu_reported' and, where the task defines categories, 'by_category' (see
  `exact_match_by_category`)) for aligned sources and references.

  dataset: the config.dataset the model was trained on, which says which scores mean something.
  language: the target language (config.data.tgt_lang), for the tokenized, lowercased BLEU that
  papers report (`metrics.tokenized_lowercase_bleu`); None leaves it out.
  progress: reports the sentences translated with rate and ETA (`Translator.translate`).
  translator: a `Translator` or an `Ensemble`; `options`: the other `DecodingOptions` fields
  (sampling and its settings, seed, mbr): the first hypothesis of each source is scored.
  """
  if isinstance(sources, str) or isinstance(references, str):
    # A str is a sequence too: it would be scored letter by letter.
    raise UserInputError('metrics.evaluate takes lists of sentences, got a single str')
  if len(sources) != len(references):
    raise UserInputError(f'{len(sources)} source lines but {len(references)} reference lines')
  if not sources:
    raise UserInputError('no sentences: nothing to evaluate')
  # A file's byte order mark read as text (open(FILE, encoding='utf-8')) changes no score.
  sources = text_io.without_byte_order_mark(sources)
  references = text_io.without_byte_order_mark(references)
  start = time.time()
  hypotheses = translator.translate(
    sources, beam_size=beam_size, alpha=alpha, beam_rule=beam_rule, progress=progress, **options
  )
  bleu_reported = dataset is None or bleu_is_meaningful(dataset)
  result = score(hypotheses, references, language if bleu_reported else None)
  result['seconds'] = time.time() - start
  result['sentences'] = len(hypotheses)
  result['exact_matches'] = sum(h == r for h, r in zip(hypotheses, references))
  result['exact_match'] = result['exact_matches'] / max(len(references), 1)
  result['bleu_reported'] = bleu_reported
  categories = sentence_categories(dataset, sources) if dataset else None
  if categories is not None:
    result['by_category'] = exact_match_by_category(references, hypotheses, categories)
  return hypotheses, result


def evaluate_files(
  workdir: str | None,
  src: str,
  ref: str,
  *,
  models: str | None = None,
  weights: str | None = None,
  out: str | None = None,
  checkpoint: int | str | None = None,
  beam_size: int = 4,
  alpha: float = 0.6,
  batch_size: int = 64,
  beam_rule: str = 'exact',
  dtype: str | None = None,
  **options,
) -> dict:
  """The `evaluate` command: translates `src` with a workdir's model (or an ensemble,
  `models`/`weights` as `inference.models.choose` takes them), scores it against `ref`, writes
  the hypotheses (to `out`, default in the workdir; an ensemble's need `out`); returns
  `evaluate`'s dict plus 'hypotheses_file' (the file written), 'decoding' (`describe`) and
  'dtype' (the inference dtype decoded in). dtype: the inference dtype (`Translator`; None: the
  model's own); one other than the model's own is named in 'decoding' and in the default
  hypotheses file, so that evaluations in two dtypes keep both outputs. `options`: the other
  `DecodingOptions` fields (sampling, its settings, seed, mbr; one hypothesis per source is
  scored)."""
  decoding = DecodingOptions(beam_size=beam_size, alpha=alpha, beam_rule=beam_rule, **options)
  decoding.check()
  check_decoding_options(beam_size, alpha, batch_size, beam_rule, dtype)
  choice = model_choice.choose(workdir, models, checkpoint, weights)
  sources, references = text_io.read_lines(src, '--src'), text_io.read_lines(ref, '--ref')
  for flag, path, lines in (('--src', src, sources), ('--ref', ref, references)):
    if not lines:
      raise UserInputError(f'{flag}={path} is empty: nothing to evaluate')
  if len(sources) != len(references):
    raise UserInputError(f'{src} has {len(sources)} lines but {ref} has {len(references)}')
  first_workdir = choice.workdirs[0]
  saved = Workdir(first_workdir).read_run_config_if_present() or {}
  own_dtype = saved.get('model', {}).get('dtype', 'float32')
  # Named only where it changes the computation: the model's own dtype, given or not, keeps the
  # names and descriptions evaluations had before --dtype.
  named_dtype = dtype if dtype not in (None, own_dtype) else None
  # Before the test set is translated: the hypotheses must have somewhere to go.
  if out:
    text_io.check_writable_output(out, '--out')
  elif choice.ensemble:
    raise UserInputError("--models needs --out: an ensemble's hypotheses belong to no one workdir")
  else:
    out = _default_hypotheses_file(Workdir(first_workdir), src, checkpoint, decoding, named_dtype)
    text_io.check_writable_output(out, '--out', make_folders=True)
  for folder in choice.workdirs:
    paths.check_outputs_apart(
      {'--out': out},
      {'--src': src, '--ref': ref},
      {choice.flag: folder},
      run_outputs=(Workdir(folder).hypotheses_folder,) if not choice.ensemble else (),
    )
  translator = model_choice.load(choice=choice, batch_size=batch_size, dtype=dtype)
  dataset = saved.get('config', {}).get('dataset')
  language = saved.get('config', {}).get('data', {}).get('tgt_lang')
  hypotheses, result = evaluate(
    translator,
    sources,
    references,
    beam_size=beam_size,
    alpha=alpha,
    progress=True,
    dataset=dataset if isinstance(dataset, str) else None,
    language=language if isinstance(language, str) else None,
    beam_rule=beam_rule,
    **options,
  )
  text_io.write_lines(hypotheses, out, flag='--out')
  return dict(
    result,
    hypotheses_file=out,
    decoding=describe(decoding, named_dtype),
    dtype=dtype or own_dtype,
  )


def _default_hypotheses_file(
  workdir: Workdir, src: str, checkpoint, decoding: DecodingOptions, dtype: str | None = None
):
  """`Workdir.hypotheses_file`, its name also saying how sampling and MBR were set and the
  inference dtype where one is named (so that a sweep over them keeps each run's output); beam
  search's names in the model's own dtype are unchanged."""
  path = workdir.hypotheses_file(
    src, checkpoint, decoding.beam_size, decoding.alpha, decoding.beam_rule
  )
  mode = ''
  if decoding.sampling:
    mode += (
      f'.sampling.t{decoding.sampling_temperature:g}.k{decoding.sampling_topk}'
      f'.p{decoding.sampling_topp:g}.seed{decoding.seed}'
    )
  if decoding.mbr:
    mode += f'.mbr{decoding.mbr}'
  if dtype:
    mode += f'.{dtype}'
  return path.with_name(path.name.removesuffix('.txt') + mode + '.txt') if mode else path


def describe(decoding: DecodingOptions, dtype: str | None = None) -> str:
  """How the hypotheses were made, for evaluate's summary line; dtype: the inference dtype,
  where it is not the model's own."""
  if decoding.sampling:
    text = f'sampling, temperature {decoding.sampling_temperature:g}, seed {decoding.seed}'
    if decoding.sampling_topk:
      text += f', top-k {decoding.sampling_topk}'
    if decoding.sampling_topp < 1:
      text += f', top-p {decoding.sampling_topp:g}'
  else:
    text = f'beam {decoding.beam_size}, alpha {decoding.alpha:g}'
  if decoding.mbr:
    text = f'MBR over {decoding.mbr} candidates ({text})'
  return f'{text}, {dtype}' if dtype else text


def report_lines(result: dict) -> list[str]:
  """What `evaluate` prints: exact match (by category where defined), BLEU where it means
  something, chrF, with sacreBLEU's signatures."""
  lines = [
    f'exact match {100 * result["exact_match"]:.2f}% '
    f'({result["exact_matches"]:,}/{result["sentences"]:,})'
  ]
  if 'by_category' in result:
    lines += format_categories(result['by_category'])
  if result['bleu_reported']:
    lines += [result['bleu_text'], f'  signature: {result["bleu_signature"]}']
    if 'bleu_tokenized_lowercase' in result:
      lines += [
        f'comparable with papers: {result["bleu_tokenized_lowercase_text"]}',
        f'  computed on: {result["bleu_tokenized_lowercase_signature"]}',
      ]
  else:
    lines.append('BLEU not reported: most outputs of this task are one word, with no 4-grams')
  lines += [result['chrf_text'], f'  signature: {result["chrf_signature"]}']
  return lines
