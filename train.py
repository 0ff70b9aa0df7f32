"""Trains a Transformer: `python train.py --workdir=DIR [--config=configs/default.py]`.

Any config field can be overridden, e.g. `--config.num_train_steps=100`. Rerunning the same
command resumes from the workdir's latest checkpoint. Exit status: 0 done (or stopped by
SIGTERM/SIGINT with a checkpoint saved), 2 a mistake in the config, flags or data, 3 the loss
stayed NaN/Inf, 4 the storage failed a write (a full disk: the last good checkpoint kept), 130
(143 for SIGTERM) stopped during start-up, before the first step (see
transformer_jax/common/errors.py).
"""

from absl import flags

from transformer_jax import cli
from transformer_jax.configs import default_config_file
from transformer_jax.training import host_memory, loop, sharding

FLAGS = flags.FLAGS
cli.define_workdir_flag('Directory for checkpoints, vocabulary, config and logs.')
cli.define_config_flag(
  default_config_file(),
  'Training config file, default configs/default.py, which comments every field. Override any '
  'field with --config.FIELD=VALUE, e.g. --config.num_train_steps=100 or '
  '--config.model.d_model=256.',
)
flags.declare_key_flag('config')  # Listed by --help, not only by --helpfull.
flags.DEFINE_string(
  'coordinator_address',
  None,
  'host:port of process 0, to run as one of several processes (multi-GPU '
  'hosts, processes launched by hand); needs --num_processes, --process_id.',
)
flags.DEFINE_integer('num_processes', None, 'Number of processes in the job.')
flags.DEFINE_integer('process_id', None, "This process's index in the job (0 writes logs).")
flags.DEFINE_bool(
  'jax_distributed',
  False,
  'Call jax.distributed.initialize() and let it find the other processes '
  '(Cloud TPU, SLURM, Open MPI). Automatic where the environment shows a '
  'multi-process job.',
)
flags.mark_flags_as_required(['workdir'])


def main(argv):
  del argv
  config = cli.loaded_config(FLAGS)
  host_memory.reuse_freed_memory_if_configured(config)  # Before JAX starts threads.
  sharding.initialize_distributed(
    FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id, force=FLAGS.jax_distributed
  )
  loop.train_and_evaluate(config, FLAGS.workdir)


if __name__ == '__main__':
  cli.run(main, config_flag=True)
