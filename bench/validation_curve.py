"""Validation curves of training runs: a metric logged at each evaluation (default: greedy BLEU on
the validation captions, `eval/bleu`) against training minutes, as a PNG and a Markdown table.

    python bench/validation_curve.py --workdir=runs/a --workdir=LABEL=runs/b \
        --out=bench/results/curve.png [--metric=eval/bleu]

Minutes count from the start of training: the first logged window's start (its wall time less
its steps over its steps per second), so compilation and data preparation are left out and
evaluations and checkpoints are counted, as the wall clock of an uninterrupted `train.py` run
counts them. A run resumed after a pause shows the pause too: compare uninterrupted runs.
"""

from __future__ import annotations

import os

from absl import app, flags

from transformer_jax.training.metric_writers import read_scalars

_WORKDIRS = flags.DEFINE_multi_string(
  'workdir', None, 'A training workdir, optionally LABEL=DIR (the label in the legend).'
)
_METRIC = flags.DEFINE_string('metric', 'eval/bleu', 'The scalar to plot.')
_OUT = flags.DEFINE_string('out', None, 'The PNG to write.')
flags.mark_flags_as_required(['workdir', 'out'])


def curve(workdir: str, metric: str) -> list[tuple[int, float, float]]:
  """[(step, minutes since training started, value)] of one run's `metric`."""
  scalars = read_scalars(os.path.join(workdir, 'tensorboard'))
  if metric not in scalars:
    raise app.UsageError(f'{workdir} logged no {metric!r}; it logged {sorted(scalars)}')
  first_step, first_time, first_rate = scalars['train/steps_per_second'][0]
  start = first_time - first_step / first_rate
  return [(step, (time - start) / 60, value) for step, time, value in scalars[metric]]


def main(argv):
  del argv
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  figure, axes = plt.subplots(figsize=(7, 4.5), dpi=120)
  for entry in _WORKDIRS.value:
    label, _, workdir = entry.rpartition('=') if '=' in entry else ('', '', entry)
    label = label or os.path.basename(os.path.normpath(workdir))
    points = curve(workdir, _METRIC.value)
    print(f'\n{label} ({workdir}): {_METRIC.value}\n\n| step | minutes | value |\n|---|---|---|')
    for step, minutes, value in points:
      print(f'| {step:,} | {minutes:.1f} | {value:.2f} |')
    axes.plot([p[1] for p in points], [p[2] for p in points], marker='o', label=label)
  axes.set_xlabel('training minutes (evaluations included)')
  axes.set_ylabel(_METRIC.value)
  axes.grid(alpha=0.3)
  axes.legend()
  figure.tight_layout()
  figure.savefig(_OUT.value)
  print(f'\nwrote {_OUT.value}')


if __name__ == '__main__':
  app.run(main)
