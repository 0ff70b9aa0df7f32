"""Shared fixtures: a tiny training config on the embedded task's 'tiny' split sizes."""

import atexit
import os
import shutil
import tempfile

import pytest

# Compiling dominates this suite's time (tiny models, a few steps each). XLA's CPU backend
# compiles about twice as fast with LLVM's expensive passes off: the HLO optimisations, and so
# what is computed, are unchanged; only the machine code is less tuned. Its older fusion
# emitters (elemental IR rather than the MLIR fusion emitters) compile the tiny train step ~2x
# faster again (CPU time of its compilation 4.5 s -> 2.0 s, 2026-12-06); they round a few
# fused operations differently, which no test depends on: comparisons within the suite run
# under the same flags, and those with CTranslate2 (the same outputs, scores within tolerances)
# hold under both (2026-12-06: one score test's 1e-6 became 1e-5). It must be set before
# JAX starts, hence here. Subprocesses inherit it; those that set their own XLA_FLAGS (several
# devices) add FAST_COMPILE_FLAGS.
FAST_COMPILE_FLAGS = (
  '--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true'
  ' --xla_cpu_use_fusion_emitters=false'
)
if 'xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' ' + FAST_COMPILE_FLAGS).strip()

# torch (transformers' side of the MarianMT tests) and CTranslate2 run on OpenMP, whose idle
# threads spin by default between parallel regions: on two cores, CPU the other test worker and
# XLA's own threads need. Sleeping instead took the MarianMT test files from 55.8-61.4 s to
# 50.8-52.6 s (2026-12-08, an AMD EPYC, -n 2); what is computed is unchanged. Subprocesses inherit
# it. Set before anything loads an OpenMP runtime, hence here.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

# One persistent compilation cache for the whole session, this process and every subprocess it
# starts (train.py runs, servers, exporters): most of them compile the same tiny programs, which
# then load instead of compiling again (~1/3 off tests/reliability_test.py). Tests that need a
# real compilation (interrupt_test.py) drop it from their subprocesses' environment.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix='transformer_jax_tests_jax_cache_')
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ.update(
    JAX_COMPILATION_CACHE_DIR=_CACHE,
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
  )
COMPILATION_CACHE_VARIABLES = (
  'JAX_COMPILATION_CACHE_DIR',
  'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
  'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES',
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The slowest files, slowest first (seconds of one worker, 2026-12-06: multihost 72, train_lib
# 93, gcs 92, reliability 87, train 81, export 69, decoding_cache 59, sharding 52, imported_workdir
# 52, serve 48), collected first. Workers take whole files (--dist loadfile) in collection order:
# a slow file left to the end kept one worker busy ~40 s after the other had finished (multihost
# ran last). Longest first, the small files fill the end. Within a file the order is unchanged.
SLOWEST_FILES = (
  'multihost_test.py',
  'train_lib_test.py',
  'gcs_test.py',
  'reliability_test.py',
  'train_test.py',
  'export_test.py',
  'decoding_cache_test.py',
  'sharding_test.py',
  'imported_workdir_test.py',
  'serve_test.py',
)


def pytest_collection_modifyitems(items):
  rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # Stable: files stay whole.


# Not host_memory.reuse_freed_memory() (train.py's default; tiny_config turns it off for
# train_and_evaluate too): its single malloc arena slows XLA's multi-threaded compilation
# ~1.5x, and this suite is mostly compilation. Tests of train.py itself keep the default.


def tiny_config(data_dir: str):
  """The default config shrunk to seconds on one CPU core."""
  from transformer_jax.configs import default

  config = default.get_config()
  config.dataset = 'number_words/tiny'
  config.data_dir = data_dir
  config.vocab_size = 96
  config.model.d_model = 32
  config.model.d_ff = 64
  config.model.num_heads = 2
  config.model.num_encoder_layers = 1
  config.model.num_decoder_layers = 1
  config.model.max_len = 32
  config.per_device_batch_size = 16
  config.num_train_steps = 8
  config.warmup_steps = 10
  config.cooldown_fraction = 0.0  # The suite's short runs keep the paper's schedule.
  config.log_every_steps = 4
  config.eval_every_steps = 1000
  config.checkpoint_every_steps = 4
  config.eval_decode_examples = 0
  config.eval_batch_size = 64
  config.final_test_decode = False
  config.reuse_host_memory = False  # See the top of this file.
  return config


# tiny_config's task, vocabulary, model and batch as train.py flags (for subprocess runs).
TINY_FLAGS = [
  '--config.dataset=number_words/tiny',
  '--config.vocab_size=96',
  '--config.model.d_model=32',
  '--config.model.d_ff=64',
  '--config.model.num_heads=2',
  '--config.model.num_encoder_layers=1',
  '--config.model.num_decoder_layers=1',
  '--config.model.max_len=32',
  '--config.per_device_batch_size=16',
  '--config.cooldown_fraction=0',
]


@pytest.fixture(scope='session')
def data_dir(tmp_path_factory):
  """One prepared copy of number_words/tiny for the whole test session."""
  from transformer_jax.data import number_words

  path = str(tmp_path_factory.mktemp('tfds'))
  number_words.prepare(path, 'tiny')
  return path


@pytest.fixture(scope='session')
def tiny_workdir(tmp_path_factory, data_dir):
  """One workdir trained in-process with tiny_config (8 steps, checkpoints at 4 and 8), shared
  by every test that only reads one (translates from it, compares with it, copies it). Tests
  that write into a workdir copy it first (shutil.copytree) or train their own."""
  from transformer_jax.training import loop

  path = str(tmp_path_factory.mktemp('tiny_workdir'))
  loop.train_and_evaluate(tiny_config(data_dir), path)
  return path


# Steps of `number_words_workdir`: number words out, close to the references (~9 s).
NUMBER_WORDS_STEPS = 150


@pytest.fixture(scope='session')
def number_words_workdir(tmp_path_factory, data_dir):
  """tiny_config trained NUMBER_WORDS_STEPS steps in-process, checkpoints at half way and at
  the end (two different models, e.g. to ensemble): outputs are number words and n-best lists
  differ. Trained once per test worker for the files that decode real outputs (alignments,
  hypotheses, export and translate options); they read it through `copied_workdir`, so that
  what one file writes into its workdir never reaches another."""
  from transformer_jax.training import loop

  config = tiny_config(data_dir)
  config.num_train_steps = config.log_every_steps = NUMBER_WORDS_STEPS
  config.checkpoint_every_steps = NUMBER_WORDS_STEPS // 2
  path = str(tmp_path_factory.mktemp('number_words_workdir'))
  loop.train_and_evaluate(config, path)
  return path


def copied_workdir(workdir: str, tmp_path_factory, name: str) -> str:
  """A private copy of a shared workdir (a few hundred KB: milliseconds)."""
  copy = str(tmp_path_factory.mktemp(name) / 'workdir')
  shutil.copytree(workdir, copy)
  return copy


def random_weight_translator(num_encoder_layers: int = 1, num_decoder_layers: int = 1):
  """A random-weight model with a real number-words vocabulary: plumbing, not quality."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from transformer_jax.data import number_words
  from transformer_jax.data.tokenizer import Tokenizer
  from transformer_jax.inference.translator import Translator
  from transformer_jax.model.config import TransformerConfig
  from transformer_jax.model.transformer import Transformer

  sentences = []
  for n in range(0, 3000, 7):
    sentences += [number_words.english_words(n), number_words.german_words(n)]
  tokenizer = Tokenizer.train(sentences, vocab_size=96)
  config = TransformerConfig(
    vocab_size=tokenizer.vocab_size,
    d_model=16,
    d_ff=32,
    num_heads=2,
    num_encoder_layers=num_encoder_layers,
    num_decoder_layers=num_decoder_layers,
    max_len=32,
  )
  model = Transformer(config)
  dummy = jnp.ones((1, 1), jnp.int32)
  params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), dummy, dummy)['params'])
  return Translator(config, params, tokenizer, batch_size=8)
