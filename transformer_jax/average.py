"""Averages the last checkpoints' parameters, as the paper does for its results:

    python -m transformer_jax.average --workdir=DIR --last=5     # paper: 5 (base), 20 (big)

Writes DIR/averaged, which `translate` and `evaluate` then load by default while it is current
(see `averaging.py`).
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.checkpoints import averaging

FLAGS = flags.FLAGS


def _define_flags():
  cli.define_workdir_flag('Training workdir (its checkpoints are averaged).')
  flags.DEFINE_integer(
    'last', 5, 'Average the newest this many checkpoints (paper: 5 for base, 20 for big).'
  )
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  del argv
  result = averaging.average_checkpoints(FLAGS.workdir, FLAGS.last)
  steps = result['averaged_steps']
  print(
    f'averaged {len(steps)} checkpoint(s) (steps {", ".join(map(str, steps))}) '
    f'into {result["path"]}'
  )


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
