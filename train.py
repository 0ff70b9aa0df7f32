"""Trains a Transformer: `python train.py --workdir=DIR [--config=configs/default.py]`.

Any config field can be overridden, e.g. `--config.num_train_steps=100`. Rerunning the same
command resumes from the workdir's latest checkpoint.
"""

import sys

from absl import app, flags

from transformer_jax import host_memory, run_config, sharding, train_lib
from transformer_jax.checkpointing import CorruptCheckpointError
from transformer_jax.config import UserInputError
from transformer_jax.metric_writers import quiet_library_logs

FLAGS = flags.FLAGS
flags.DEFINE_string('workdir', None, 'Directory for checkpoints, vocabulary, config and logs.')
run_config.define_config_flag('configs/default.py', 'Training configuration file.')
flags.DEFINE_string('coordinator_address', None,
                    'host:port of process 0, to run as one of several processes (multi-GPU '
                    'hosts, processes launched by hand); needs --num_processes, --process_id.')
flags.DEFINE_integer('num_processes', None, 'Number of processes in the job.')
flags.DEFINE_integer('process_id', None, 'This process\'s index in the job (0 writes logs).')
flags.DEFINE_bool('jax_distributed', False,
                  'Call jax.distributed.initialize() and let it find the other processes '
                  '(Cloud TPU, SLURM, Open MPI). Automatic where the environment shows a '
                  'multi-process job.')
flags.mark_flags_as_required(['workdir'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  quiet_library_logs()
  config = run_config.loaded_config(FLAGS)
  host_memory.reuse_freed_memory_if_configured(config)  # Before JAX starts threads.
  try:
    sharding.initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                    FLAGS.process_id, force=FLAGS.jax_distributed)
    train_lib.train_and_evaluate(config, FLAGS.workdir)
  except (UserInputError, FileNotFoundError) as error:
    # A mistake in what was given, not a bug: one line, no traceback, non-zero exit.
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  except CorruptCheckpointError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(2)
  except train_lib.NonFiniteError as error:
    print(f'error: {error}', file=sys.stderr)
    sys.exit(3)


if __name__ == '__main__':
  app.run(main, flags_parser=run_config.parse_flags)
