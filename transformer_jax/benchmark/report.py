"""Plain-text tables of a benchmark report (`python -m transformer_jax.benchmark`)."""

from __future__ import annotations

from typing import Sequence

from transformer_jax.benchmark.decoding import DECODE_MODES
from transformer_jax.benchmark.flops import FLOPS_FORMULA


def _si(value: float | None, unit: str = '') -> str:
  if value is None:
    return '-'
  for factor, prefix in ((1e12, 'T'), (1e9, 'G'), (1e6, 'M'), (1e3, 'k')):
    if abs(value) >= factor:
      return f'{value / factor:.2f}{prefix}{unit}'
  return f'{value:.2f}{unit}'


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  widths = [
    max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
  ]

  def line(cells):
    return '  '.join(c.rjust(w) for c, w in zip(cells, widths))

  return '\n'.join([line(headers), line(['-' * w for w in widths])] + [line(r) for r in rows])


_SETTING_NAMES = {'beam': 'beam {beam}', 'greedy': 'greedy', 'beam_latency': 'beam {beam}'}


def ctranslate2_table(rows: Sequence[dict]) -> str:
  """Ours against CTranslate2 per model and setting (`ctranslate2_comparison.py`)."""
  first = rows[0]['ctranslate2']
  lines = []
  for r in rows:
    for name, s in r['ctranslate2']['settings'].items():
      lines.append(
        [
          r['model'],
          f'{_SETTING_NAMES[name].format(beam=s["beam_size"])}, batch {s["batch_size"]}',
          f'{s["ours"]["tokens_per_second"]:.0f}',
          f'{s["ctranslate2"]["tokens_per_second"]:.0f}',
          f'{s["ours"]["milliseconds_per_sentence"]:.1f}',
          f'{s["ctranslate2"]["milliseconds_per_sentence"]:.1f}',
          f'{s["ratio"]:.2f}x [{s["ratio_min"]:.2f}, {s["ratio_max"]:.2f}]',
          f'{s["same_best_hypothesis"]:.0%}',
        ]
      )
  return '\n'.join(
    [
      f'decoding vs CTranslate2 {first["version"]} ({first["compute_type"]}, '
      f'intra_threads={first["intra_threads"]}; same weights and sources, '
      f'{rows[0]["max_decode_len"]} tokens per sentence; {first["settings"]["beam"]["rounds"]} '
      'alternating rounds, medians; speed = ours / CTranslate2 per round: median [min, max])',
      _table(
        [
          'model',
          'decoding',
          'ours tok/s',
          'CT2 tok/s',
          'ours ms/sent',
          'CT2 ms/sent',
          'speed',
          'same best',
        ],
        lines,
      ),
    ]
  )


_TOOLKIT_VARIANTS = {
  'greedy': 'translate(beam_size=1)',
  'score': 'score(sources, greedy outputs)',
  'score_program': "score's program alone (padded batches)",
  'score_program_where_mask': 'whole logits: PAD mask by where, one log-sum-exp',
  'ctranslate2_score_1_thread': 'CTranslate2 score_batch, 1 thread',
  'ctranslate2_score_threads': 'CTranslate2 score_batch, {threads} threads',
  'sampling': 'hypotheses(sampling=True)',
  'sampling_top_p': 'hypotheses(sampling=True, sampling_topp={top_p})',
  'beam': 'translate(beam_size={beam})',
  'nbest': 'hypotheses(beam_size={beam}, num_hypotheses={beam})',
}


def toolkit_table(rows: Sequence[dict]) -> str:
  """Issue 27's toolkit rows (`toolkit.py`): each variant's speed, then the asked-for ratios."""
  first = rows[0]
  variants, ratios = [], []
  for r in rows:
    threads = (r.get('ctranslate2') or {}).get('intra_threads')
    for name, v in r['variants'].items():
      label = _TOOLKIT_VARIANTS[name].format(threads=threads, top_p=r['top_p'], beam=r['beam_size'])
      variants.append(
        [
          r['model'],
          label,
          f'{v["sentences_per_second"]:.1f}',
          f'{v["tokens_per_second"]:.0f}',
          f'{v["mean_output_tokens"]:.1f}',
          f'{v["first_call_seconds"]:.1f}',
          '-' if 'fraction_of_peak' not in v else f'{v["fraction_of_peak"]:.0%}',
        ]
      )
    for name, q in r['ratios'].items():
      target, ceiling = q['target'], q.get('ceiling')
      met = '-' if target is None else ('yes' if q['median'] >= target else 'no')
      if met == 'no' and ceiling is not None and target > ceiling:
        met = 'no: over the ceiling'
      ratios.append(
        [
          r['model'],
          name,
          q['figure'].replace('_per_second', '/s'),
          f'{q["median"]:.2f}x [{q["min"]:.2f}, {q["max"]:.2f}]',
          '-' if target is None else f'>= {target:.2f}x',
          '-' if ceiling is None else f'{ceiling:.2f}x',
          met,
        ]
      )
  loads = '; '.join(
    f'{r["model"]} {r["load_average_before"][0]:.1f} -> {r["load_average_after"][0]:.1f}'
    for r in rows
  )
  return '\n'.join(
    [
      f'toolkit (issue 27; Translator API, batch {first["batch_size"]}, {first["sentences"]} '
      f'sentences, every output {first["max_len"]} tokens (EOS suppressed, length cap); '
      f'{first["rounds"]} rotated rounds, medians; load average {loads}; of peak: '
      'one forward pass of FLOPs per pair / the fastest peak product timed before the rounds)',
      _table(
        ['model', 'variant', 'sent/s', 'tok/s', 'tok/sent', 'first call s', 'of peak'], variants
      ),
      '',
      'toolkit ratios (per round: median [min, max]; ceiling: scoring / greedy can reach at most '
      "1 / greedy's fraction of the peak, both doing one forward pass of FLOPs per pair)",
      _table(['model', 'ratio', 'of', 'measured', 'issue 27 asks', 'ceiling', 'met'], ratios),
    ]
  )


def end_to_end_table(rows: Sequence[dict]) -> str:
  """What users run against the search program alone and CTranslate2 (`end_to_end.py`)."""
  lines = []
  for r in rows:
    for batch_size, modes in r['batch_sizes'].items():
      for mode, f in modes.items():
        theirs = f.get('ctranslate2')
        lines.append(
          [
            r['model'],
            mode,
            batch_size,
            f'{f["end_to_end"]["sentences_per_second"]:.1f}',
            f'{f["end_to_end"]["target_tokens_per_second"]:.0f}',
            f'{f["program"]["target_tokens_per_second"]:.0f}',
            f'{f["host_share"]:.1%}',
            f'{f["dispatches_per_batch"]:.1f}',
            '-' if theirs is None else f'{theirs["target_tokens_per_second"]:.0f}',
            '-'
            if theirs is None
            else f'{f["ratio"]:.2f}x [{f["ratio_min"]:.2f}, {f["ratio_max"]:.2f}]',
          ]
        )
  first = rows[0]
  engine = first['ctranslate2']
  versus = (
    f'; CTranslate2 {engine["version"]} {engine["compute_type"]}, intra_threads='
    f'{engine["intra_threads"]}, translate_batch'
    if engine
    else ''
  )
  return '\n'.join(
    [
      'end to end (Translator.translate / hypotheses, text in and out; '
      f'{first["batches"]} batches, '
      f'{first["max_len"]} tokens per output; {first["rounds"]} rotated rounds, medians; host '
      f'share = (end to end - program) / end to end{versus})',
      _table(
        [
          'model',
          'mode',
          'batch',
          'sent/s',
          'tok/s',
          'program tok/s',
          'host share',
          'dispatches/batch',
          'ct2 tok/s',
          'ours / ct2',
        ],
        lines,
      ),
    ]
  )


def transformers_table(rows: Sequence[dict]) -> str:
  """Ours against MarianMTModel.generate on the same weights (`transformers_comparison.py`)."""
  first = rows[0]
  return '\n'.join(
    [
      f'against transformers {first["versions"]["transformers"]} MarianMTModel.generate (torch '
      f'{first["versions"]["torch"]}, {first["threads"]} threads; the same imported random '
      f'weights, vocabulary {first["vocab_size"]:,}; text in and out; '
      f'{first["target_tokens_each"]} tokens per output; {first["rounds"]} alternating rounds, '
      'medians)',
      _table(
        [
          'model',
          'beam',
          'batch',
          'ours tok/s',
          'transformers tok/s',
          'ours / transformers',
          'same',
        ],
        [
          [
            r['model'],
            str(r['beam_size']),
            str(r['batch_size']),
            f'{r["ours"]["target_tokens_per_second"]:.0f}',
            f'{r["transformers"]["target_tokens_per_second"]:.0f}',
            f'{r["ratio"]:.2f}x [{r["ratio_min"]:.2f}, {r["ratio_max"]:.2f}]',
            f'{r["same_output"]:.0%}',
          ]
          for r in rows
        ],
      ),
    ]
  )


def file_table(row: dict) -> str:
  """The `translate` command over a file against CTranslate2's translate_file."""
  theirs = row.get('ctranslate2_seconds')
  return (
    f'file: translate of {row["lines"]:,} lines (beam {row["beam_size"]}, batch '
    f"{row['batch_size']}), from the command's start: {row['ours_seconds']:.1f} s "
    f'({row["ours_sentences_per_second"]:.0f} sentences/s)'
    + (
      ''
      if theirs is None
      else f'; CTranslate2 translate_file {theirs:.1f} s: ours {row["ratio"]:.2f}x, '
      f'same output {row["same_output"]:.0%}'
    )
  )


def format_report(report: dict) -> str:
  m, peak = report['machine'], report['peak']
  out = [
    f'machine: {m["device_count"]} x {m["device_kind"]} ({m["platform"]}), '
    f'{m["cpu_count"]} CPUs, jax {m["jax"]}, {m["date"]}',
    f'peak: {peak["n"]}x{peak["n"]} {peak["dtype"]} matmul: '
    f'{_si(peak["flops_per_second"], "FLOP/s")} per device (the fastest in the run; '
    f'best of {peak["repeats"]} at the start: '
    f'{_si(peak.get("initial_flops_per_second", peak["flops_per_second"]), "FLOP/s")})',
    '',
  ]
  if report.get('training'):
    out += [
      'training (FLOPs: ' + FLOPS_FORMULA + ')',
      _table(
        [
          'size',
          'params',
          'batch',
          'tgt tok/s',
          'FLOPs/step',
          'FLOP/s',
          'MFU',
          'useful MFU',
          'MFU med/best',
          'MFU paired',
          'step s',
          'first step s',
          'compile s',
          'peak mem',
          'XLA step mem',
        ],
        [
          [
            r['size'],
            _si(r['params']),
            f'{r["batch_rows"]}x{r["source_length"]}/{r["target_length"]}',
            _si(r['target_tokens_per_second']),
            _si(r['flops_per_step']),
            _si(r['achieved_flops_per_second']),
            f'{r["mfu"]:.1%}',
            f'{r["useful_mfu"]:.1%}',
            f'{r["mfu_median_step"]:.1%}/{r["mfu_best_step"]:.1%}',
            '-' if r.get('mfu_paired_median') is None else f'{r["mfu_paired_median"]:.1%}',
            f'{r["step_seconds"]:.3f}',
            f'{r["first_step_seconds"]:.1f}',
            f'{r["compile_seconds"]:.1f}',
            _si(r['peak_memory_bytes'], 'B'),
            _si(r.get('xla_step_memory_bytes'), 'B'),
          ]
          for r in report['training']
        ],
      ),
      '',
    ]
  if report.get('decoding'):
    rows = []
    for r in report['decoding']:
      for mode in DECODE_MODES:
        d = r['modes'][mode]
        kind = mode.split('_')[0]
        rows.append(
          [
            r['model'],
            mode,
            f'{d["sentences_per_second"]:.1f}',
            f'{d["tokens_per_second"]:.0f}',
            f'{d["mean_output_tokens"]:.1f}',
            f'{d["first_call_seconds"]:.1f}',
            f'{r["cache_speedup"][kind]:.2f}x' if mode.endswith('_cached') else '',
          ]
        )
    out += [
      f'decoding (beam {report["decoding"][0]["beam_size"]}; '
      + '; '.join(f'{r["model"]}: {r["note"]}' for r in report['decoding'])
      + ')',
      _table(
        ['model', 'mode', 'sent/s', 'tok/s', 'tok/sent', 'first call s', 'cache speedup'], rows
      ),
      '',
    ]
  compared = [r for r in report.get('decoding', []) if r.get('ctranslate2')]
  if compared:
    out += [ctranslate2_table(compared), '']
  if report.get('end_to_end'):
    out += [end_to_end_table(report['end_to_end']), '']
  if report.get('transformers'):
    out += [transformers_table(report['transformers']), '']
  if report.get('file_translation'):
    out += [file_table(report['file_translation']), '']
  if report.get('toolkit'):
    out += [toolkit_table(report['toolkit']), '']
  if report.get('pipeline'):
    p = report['pipeline']
    out += [
      f'input pipeline ({p["examples"]:,} synthetic Multi30k-like pairs, max length '
      f'{p["max_length"]}, {p["tokens_per_batch"]} padded tokens per batch and side; '
      f'compared with the {p["size"]} training step)',
      _table(
        ['mode', 'examples/s', 'examples/batch', 'padding', 'training needs', 'ratio'],
        [
          [
            mode,
            f'{d["examples_per_second"]:,.0f}',
            f'{d["examples_per_batch"]:.1f}',
            f'{d["padding_fraction"]:.1%}',
            f'{d["training_examples_per_second"]:,.0f}/s'
            if 'training_examples_per_second' in d
            else '-',
            f'{d["ratio_to_training"]:.1f}x' if 'ratio_to_training' in d else '-',
          ]
          for mode, d in p['modes'].items()
        ],
      ),
      '',
    ]
  return '\n'.join(out)


# ------------------------------------------------------------------------------- Main --
