"""The benchmark: its FLOP formula by hand, its sizes, and the CLI end to end (no timings
asserted)."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.benchmark import ctranslate2_comparison, end_to_end, runner, toolkit, training
from transformer_jax.benchmark import decoding as decode_benchmark
from transformer_jax.benchmark import flops as flop_count
from transformer_jax.benchmark import pipeline as input_benchmark
from transformer_jax.benchmark.report import (
  ctranslate2_table,
  end_to_end_table,
  file_table,
  toolkit_table,
)
from transformer_jax.common.errors import UserInputError
from transformer_jax.configs import default
from transformer_jax.inference import scoring
from transformer_jax.model.config import TransformerConfig
from transformer_jax.model.transformer import Transformer, count_params

from conftest import REPO_ROOT, copied_workdir


def _abstract_params(cfg: TransformerConfig):
  dummy = jnp.ones((1, 1), jnp.int32)
  variables = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.PRNGKey(0), dummy, dummy))
  return nn.meta.unbox(variables['params'])


def _toy_model():
  """The comparisons' random model: small enough to decode in milliseconds."""
  cfg = TransformerConfig(
    vocab_size=50, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=2
  )
  dummy = jnp.ones((1, 1), jnp.int32)
  return cfg, Transformer(cfg).init(jax.random.PRNGKey(0), dummy, dummy)['params']


def test_training_flops_equal_a_hand_computation():
  cfg = TransformerConfig(
    vocab_size=10, d_model=4, d_ff=8, num_heads=2, num_encoder_layers=1, num_decoder_layers=2
  )
  # Per attention: query, key, value, out = 4 x 4 each = 64; FFN: 2 x 4 x 8 = 64.
  # Encoder: 1 x (64 + 64) = 128. Decoder: 2 x (2 x 64 + 64) = 384, of which the
  # cross-attention key and value kernels (2 x 2 x 16 = 64) multiply source tokens.
  # Output: 4 x 10 = 40.
  assert flop_count.matmul_params(cfg) == {
    'encoder': 128,
    'decoder': 320,
    'decoder_cross_kv': 64,
    'output': 40,
  }
  # Two rows: sources of 3 and 5 tokens (S = 8), targets of 2 and 4 (T = 6).
  flops = flop_count.training_flops(cfg, [3, 5], [2, 4])
  # Dense: 6 x ((128 + 64) x 8 + (320 + 40) x 6) = 6 x 3696.
  assert flops['dense'] == 22176
  # Attention: 6 x h (d_k + d_v) = 6 x 2 x (2 + 2) = 48 per (query, key) pair and layer:
  # encoder 1 x (3^2 + 5^2) = 34, decoder 2 x ((2^2 + 4^2) + (2 x 3 + 4 x 5)) = 92.
  assert flops['attention'] == 48 * (34 + 92) == 6048
  assert flops['total'] == 22176 + 6048


def test_attention_flops_match_the_issue_statement_on_padded_batches():
  """6 x 2 x (layers x len^2 x d_model x batch) per attention when h x d_k = d_model."""
  cfg = TransformerConfig(
    vocab_size=256, d_model=128, d_ff=512, num_heads=4, num_encoder_layers=3, num_decoder_layers=3
  )
  rows, s, t, d = 64, 24, 16, 128
  flops = flop_count.training_flops(cfg, [s] * rows, [t] * rows)
  expected = 6 * 2 * (3 * s * s * d * rows + 3 * t * t * d * rows + 3 * t * s * d * rows)
  assert flops['attention'] == expected


@pytest.mark.parametrize('pre_norm,share_embeddings', [(False, True), (True, False)])
def test_matmul_params_are_the_model_kernels(pre_norm, share_embeddings):
  """Every parameter is a matmul weight counted by the formula, except biases, LayerNorms and
  the input embeddings (the shared embedding counts once, as the output projection)."""
  cfg = TransformerConfig(
    vocab_size=50,
    d_model=16,
    d_ff=24,
    num_heads=2,
    qk_dim=4,
    v_dim=6,
    num_encoder_layers=2,
    num_decoder_layers=3,
    pre_norm=pre_norm,
    share_embeddings=share_embeddings,
  )
  params = _abstract_params(cfg)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  kernels = sum(
    int(np.prod(leaf.shape)) for path, leaf in flat if getattr(path[-1], 'key', None) == 'kernel'
  )
  if share_embeddings:
    kernels += int(np.prod(params['shared_embedding']['embedding'].shape))
  assert sum(flop_count.matmul_params(cfg).values()) == kernels


def test_sizes_are_the_documented_models():
  config = default.get_config()
  tiny = training.size_spec('tiny', config, dtype='float32')
  assert (tiny.model_config.d_model, tiny.model_config.vocab_size) == (128, 256)
  assert (tiny.rows_per_device, tiny.source_length, tiny.target_length) == (64, 24, 16)
  small = training.size_spec('small', config, dtype='bfloat16')
  assert (
    small.model_config.d_model,
    small.model_config.d_ff,
    small.model_config.num_heads,
    small.model_config.num_encoder_layers,
    small.model_config.vocab_size,
    small.model_config.dtype,
  ) == (256, 1024, 4, 3, 8000, 'bfloat16')
  assert 1900 <= small.target_tokens_per_device <= 2100
  base = training.size_spec('base', config, dtype='float32', dropout=0.0)
  assert base.model_config.replace(dropout_rate=0.1) == TransformerConfig.base(37000)
  assert 3900 <= base.target_tokens_per_device <= 4200
  assert 60e6 < count_params(_abstract_params(base.model_config)) < 66e6  # The paper: ~65M.
  big = training.size_spec('big', config, dtype='bfloat16', rows_per_device=256)
  assert big.model_config == TransformerConfig.big(37000, dtype='bfloat16')
  assert (big.rows_per_device, big.target_tokens_per_device) == (256, 256 * 64)
  assert 205e6 < count_params(_abstract_params(big.model_config)) < 215e6  # The paper: ~213M.
  with pytest.raises(UserInputError):
    runner.run(config, runner.Options(sizes=['huge']))


@pytest.mark.parametrize(
  'change, message',
  [
    (dict(train_steps=0), '--train_steps must be an integer >= 1, got 0'),
    (dict(rows_per_device=-1), '--rows_per_device must be an integer >= 0, got -1'),
    (dict(beam_size=0), '--beam_size must be an integer >= 1, got 0'),
    (dict(alpha=-1.0), '--alpha must be >= 0, got -1.0'),
    (dict(dropout=1.0), '--dropout must be in [0, 1), got 1.0'),
    (
      dict(compare=['onnx']),
      "--compare: unknown engine 'onnx'; expected ctranslate2, transformers",
    ),
    (
      dict(compare=['transformers'], sections=['toolkit']),
      '--compare=transformers compares decoding: add decode to --sections',
    ),
    (
      dict(compare=['ctranslate2'], sections=['train']),
      '--compare compares decoding: add decode to --sections',
    ),
    (dict(compare_rounds=0), '--compare_rounds must be an integer >= 1, got 0'),
    (
      dict(end_to_end_batch_sizes=['32', 'x']),
      "--end_to_end_batch_sizes: each must be an integer >= 1, got 'x'",
    ),
    (
      dict(end_to_end_modes=['beam', 'topk']),
      "--end_to_end_modes: unknown mode 'topk'; expected some of greedy, beam, sampling, nbest",
    ),
  ],
)
def test_impossible_options_are_one_line_errors_before_anything_runs(change, message):
  # Before: --train_steps=0 failed in the report ('float' object is not iterable) and
  # --rows_per_device=-1 in numpy, both after compiling.
  with pytest.raises(UserInputError) as raised:
    runner.run(default.get_config(), runner.Options(**change))
  assert str(raised.value) == message


def test_compare_without_ctranslate2_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, 'ctranslate2', None)  # As if not installed.
  with pytest.raises(UserInputError) as raised:
    runner.run(default.get_config(), runner.Options(sections=['decode'], compare=['ctranslate2']))
  assert str(raised.value) == (
    "--compare=ctranslate2 needs the ctranslate2 package: pip install -e '.[export]'"
  )


def test_ctranslate2_decodes_the_same_model_beside_ours():
  """The comparison's CTranslate2 model (built by the exporter's converter) decodes the EOS-
  suppressed random model to the same best hypotheses as ours, for every setting, and the
  report prints the ratios."""
  cfg, params = _toy_model()
  params, suppressed = decode_benchmark.suppress_eos(params, cfg)
  assert suppressed
  rng = np.random.default_rng(0)
  sources = [training.synthetic_ids(rng, np.array([5, 3, 6]), 6, cfg.vocab_size)]
  result = ctranslate2_comparison.compare_ctranslate2(
    cfg, params, sources, beam_size=3, decode_length=4, alpha=0.6, rounds=2
  )
  assert result['intra_threads'] == ctranslate2_comparison.xla_cpu_threads() >= 1
  assert set(result['settings']) == {'beam', 'greedy', 'beam_latency'}
  for name, setting in result['settings'].items():
    assert setting['same_best_hypothesis'] == 1.0, name
    assert setting['batch_size'] == (1 if name == 'beam_latency' else 3)
    assert setting['beam_size'] == (1 if name == 'greedy' else 3)
    for side in ('ours', 'ctranslate2'):
      assert setting[side]['mean_output_tokens'] == 4  # min = max decoding length, EOS never
      assert len(setting[side]['seconds_each_round']) == 2
      assert setting[side]['tokens_per_second'] > 0
    assert setting['ratio_min'] <= setting['ratio'] <= setting['ratio_max']
  table = ctranslate2_table([{'model': 'toy', 'max_decode_len': 4, 'ctranslate2': result}])
  assert 'decoding vs CTranslate2' in table and 'beam 3, batch 1' in table, table


@pytest.mark.parametrize('pre_norm,share_embeddings', [(False, True), (True, False)])
def test_eos_suppression_finds_its_parameters(pre_norm, share_embeddings):
  """The edit makes feature 0 of the decoder output the constant 1 and gives EOS a -30 weight
  on it (the CLI test checks that decoding then runs to full length)."""
  cfg = TransformerConfig(
    vocab_size=40,
    d_model=16,
    d_ff=32,
    num_heads=2,
    num_encoder_layers=1,
    num_decoder_layers=2,
    pre_norm=pre_norm,
    share_embeddings=share_embeddings,
  )
  params = jax.tree_util.tree_map(lambda x: np.ones(x.shape, x.dtype), _abstract_params(cfg))
  edited, suppressed = decode_benchmark.suppress_eos(params, cfg)
  assert suppressed
  norm = (
    edited['decoder_norm']
    if pre_norm
    else jax.tree_util.tree_map(lambda x: x[-1], edited['decoder_layers']['ffn_block']['norm'])
  )
  assert (norm['scale'][0], norm['bias'][0]) == (0.0, 1.0)
  output = (
    edited['shared_embedding']['embedding']
    if share_embeddings
    else edited['output_projection']['kernel'].T
  )
  assert output[1, 0] == -30.0
  assert np.sum(output == -30.0) == 1
  assert params is not edited and np.all(jax.tree_util.tree_leaves(params)[0] == 1)


def test_cli_writes_a_complete_report(tmp_path):
  out = tmp_path / 'bench.json'
  env = dict(
    os.environ,
    JAX_PLATFORMS='cpu',
    # Compilation dominates this run; optimising the programs would only slow it down.
    JAX_DISABLE_MOST_OPTIMIZATIONS='1',
  )
  command = [
    sys.executable,
    '-m',
    'transformer_jax.benchmark',
    '--sizes=tiny',
    f'--json={out}',
    '--train_steps=2',
    '--warmup_steps=1',
    '--peak_n=256',
    '--peak_repeats=2',
    '--decode_batches=1',
    '--decode_batch_size=4',
    '--decode_source_length=8',
    '--decode_length=5',
    '--end_to_end_batch_sizes=4',
    '--end_to_end_batches=1',
    '--end_to_end_modes=greedy,beam',
    '--compare_rounds=1',
    '--pipeline_examples=2000',
    '--pipeline_batches=5',
    # A smaller 'tiny' (fewer FLOPs, same programs) keeps the test fast.
    '--config.model.d_model=32',
    '--config.model.d_ff=64',
    '--config.model.num_heads=2',
    '--config.model.num_encoder_layers=1',
    '--config.model.num_decoder_layers=1',
    '--config.vocab_size=96',
    '--config.per_device_batch_size=8',
  ]
  result = subprocess.run(
    command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-3000:]
  for header in ('MFU', 'greedy_cached', 'beam_uncached', 'packed'):
    assert header in result.stdout, result.stdout
  report = json.loads(out.read_text())

  assert report['machine']['device_count'] >= 1 and report['machine']['cpu_count'] >= 1
  assert report['settings']['flops_formula'] == flop_count.FLOPS_FORMULA
  # Like train.py, the benchmark keeps freed host memory (config.reuse_host_memory).
  assert report['settings']['reuse_host_memory'] == sys.platform.startswith('linux')
  assert report['peak']['flops_per_second'] > 0
  # The limit is the fastest peak product of the whole run, the start's or a probe's.
  assert report['peak']['flops_per_second'] == max(
    report['peak']['initial_flops_per_second'], *report['training'][0]['peak_flops_each']
  )

  (row,) = report['training']
  for key in (
    'params',
    'batch_rows',
    'step_seconds',
    'steps_per_second',
    'target_tokens_per_second',
    'padded_target_tokens_per_second',
    'flops_per_step',
    'useful_flops_per_step',
    'achieved_flops_per_second',
    'mfu',
    'useful_mfu',
    'first_step_seconds',
    'trace_seconds',
    'compile_seconds',
    'peak_memory_bytes',
    'xla_step_memory_bytes',
  ):
    assert row[key] > 0, (key, row[key])
  assert 0 < row['useful_mfu'] < row['mfu'] < 1.5
  assert row['step_seconds_min'] <= row['step_seconds_median'] <= row['step_seconds'] * 2
  assert len(row['step_seconds_each']) == row['timed_steps']
  assert np.isclose(np.mean(row['step_seconds_each']), row['step_seconds'])
  assert min(row['step_seconds_each']) == row['step_seconds_min']
  # Each step paired with the peak timed just before it.
  assert len(row['peak_flops_each']) == row['timed_steps']
  paired = [
    row['flops_per_step'] / (t * p)
    for t, p in zip(row['step_seconds_each'], row['peak_flops_each'])
  ]
  assert np.isclose(row['mfu_paired_median'], np.median(paired))
  assert 0 < row['mfu_paired_median'] < 1.5
  assert row['peak_flops_used'] == report['peak']['flops_per_second']
  assert np.isclose(row['mfu'], row['achieved_flops_per_second'] / row['peak_flops_used'])
  assert row['mfu'] <= row['mfu_best_step'] and row['mfu_median_step'] <= row['mfu_best_step']
  assert row['trace_seconds'] + row['compile_seconds'] < row['first_step_seconds']
  assert row['useful_flops_per_step'] < row['flops_per_step']
  assert row['target_tokens_per_second'] < row['padded_target_tokens_per_second']
  assert np.isfinite(row['final_loss'])

  (decoding,) = report['decoding']
  assert decoding['eos_suppressed'] and not decoding['trained']
  assert set(decoding['modes']) == set(decode_benchmark.DECODE_MODES)
  for mode, figures in decoding['modes'].items():
    for key in ('sentences_per_second', 'tokens_per_second', 'seconds', 'first_call_seconds'):
      assert figures[key] > 0, (mode, key)
    assert figures['mean_output_tokens'] == 5  # EOS suppressed: exactly --decode_length.
  assert all(decoding['cache_speedup'][kind] > 0 for kind in ('greedy', 'beam'))
  (rows,) = report['end_to_end']
  assert set(rows['batch_sizes']['4']) == {'greedy', 'beam'}
  assert 'end to end (Translator.translate' in result.stdout

  pipeline = report['pipeline']
  assert set(pipeline['modes']) == set(input_benchmark.BATCHING_MODES)
  for mode, figures in pipeline['modes'].items():
    for key in (
      'examples_per_second',
      'examples_per_batch',
      'training_examples_per_second',
      'ratio_to_training',
    ):
      assert figures[key] > 0, (mode, key)
    assert 0 <= figures['padding_fraction'] < 1
  # Packing leaves the least padding, fixed-size batches padded to the maximum the most.
  modes = pipeline['modes']
  assert (
    modes['packed']['padding_fraction']
    < modes['tokens']['padding_fraction']
    < modes['fixed']['padding_fraction']
  )


def test_run_trains_and_decodes_every_size_against_the_runs_fastest_peak(monkeypatch):
  """run()'s bookkeeping, with the timing functions replaced by fakes: every size is trained
  and decoded, and every row's MFU divides by the fastest peak seen in the whole run."""
  from transformer_jax.configs import default

  probe_peaks = {'tiny': [100e9, 300e9], 'small': [200e9, 250e9]}

  def fake_training(spec, *, peak_flops, peak_probe, **unused):
    del unused
    assert peak_probe() > 0  # the real probe works (the peak product at --peak_n)
    row = {
      'size': spec.name,
      'devices': 1,
      'steps_per_second': 1.0,
      'achieved_flops_per_second': 60e9,
      'flops_per_step': 60e9,
      'useful_flops_per_step': 30e9,
      'step_seconds': 1.0,
      'step_seconds_median': 1.0,
      'step_seconds_min': 0.5,
      'peak_flops_each': probe_peaks[spec.name],
    }
    training.set_mfu(row, peak_flops)
    return row, {'params': spec.name}

  decoded = []
  monkeypatch.setattr(runner, 'benchmark_training', fake_training)
  monkeypatch.setattr(
    runner,
    'synthetic_decoding',
    lambda spec, params, **unused: decoded.append((spec.name, params)) or {},
  )
  monkeypatch.setattr(
    runner, 'end_to_end_rows', lambda name, cfg, params, **unused: {'model': name}
  )
  report = runner.run(
    default.get_config(),
    runner.Options(
      sizes=['tiny', 'small'], sections=['train', 'decode'], peak_n=64, peak_repeats=1
    ),
  )
  assert [row['size'] for row in report['training']] == ['tiny', 'small']
  assert decoded == [('tiny', {'params': 'tiny'}), ('small', {'params': 'small'})]
  assert report['peak']['flops_per_second'] == 300e9  # a probe of tiny's steps
  for row in report['training']:
    assert row['peak_flops_used'] == 300e9
    assert row['mfu'] == pytest.approx(0.2) and row['mfu_best_step'] == pytest.approx(0.4)
    assert row['useful_mfu'] == pytest.approx(0.1)


def test_toolkit_rows_time_every_variant_on_full_length_outputs():
  """The toolkit rows (issue 27): every variant runs the same sentences to the length cap, the
  whole-logits scoring variant gives the scoring program's values, CTranslate2's score_batch
  agrees with ours, and each ratio is the per-round quotient the table prints."""
  cfg, params = _toy_model()
  row = toolkit.benchmark_toolkit(
    'toy',
    cfg,
    params,
    batch_size=4,
    source_length=8,
    decode_length=6,
    batches=2,
    beam_size=3,
    alpha=0.6,
    rounds=2,
    compare=['ctranslate2'],
    peak_flops=1e11,
    peak_probe=lambda: 2e11,  # Faster than the start's: the rows divide by the fastest.
  )
  assert set(row['variants']) == {
    'greedy',
    'score',
    'score_program',
    'score_program_where_mask',
    'sampling',
    'sampling_top_p',
    'beam',
    'nbest',
    'ctranslate2_score_1_thread',
    'ctranslate2_score_threads',
  }
  assert row['eos_suppressed'] and row['max_len'] == 8 and row['sentences'] == 8
  for name, figures in row['variants'].items():
    # EOS suppressed, max_len 8: every search runs to the cap, every pair scores 8 tokens.
    assert figures['mean_output_tokens'] == 8, name
    assert len(figures['seconds_each_round']) == 2
    assert figures['sentences_per_second'] == pytest.approx(
      8 / np.median(figures['seconds_each_round'])
    )
  assert row['ctranslate2']['max_sentence_log_prob_difference'] < 1e-4
  assert set(row['ratios']) == set(toolkit.RATIOS)
  for name, ratio in row['ratios'].items():
    top, bottom, _ = toolkit.RATIOS[name]
    seconds = [row['variants'][v]['seconds_each_round'] for v in (top, bottom)]
    # Equal output lengths: the tokens/s ratios are the sentences/s ones.
    each = [b / t for t, b in zip(*seconds)]
    assert ratio['median'] == pytest.approx(np.median(each)), name
    assert ratio['min'] <= ratio['median'] <= ratio['max']
  # 2 batches padded to 8 + 8 tokens: the formula's forward FLOPs, a training step's third.
  per_batch = flop_count.training_flops(cfg, [8] * 4, [8] * 4)['total'] / 3
  assert row['forward_flops_per_sentence'] == pytest.approx(2 * per_batch / 8)
  assert row['peak_flops_per_second'] == 2e11
  score = row['variants']['score']
  assert score['fraction_of_peak'] == pytest.approx(
    2 * per_batch / np.median(score['seconds_each_round']) / 2e11
  )
  # Scoring and cached greedy do the same FLOPs per pair: the most scoring / greedy can reach
  # is greedy's distance from the peak.
  greedy = row['variants']['greedy']
  for name in ('score_vs_greedy', 'score_program_vs_greedy'):
    assert row['ratios'][name]['ceiling'] == pytest.approx(1 / greedy['fraction_of_peak'])
  assert 'ceiling' not in row['ratios']['nbest_vs_beam']
  table = toolkit_table([row])
  assert 'score_vs_greedy' in table and 'CTranslate2 score_batch, 1 thread' in table, table
  score_line = next(line for line in table.splitlines() if ' score_vs_greedy ' in line)
  assert f'{1 / greedy["fraction_of_peak"]:.2f}x' in score_line, score_line
  # A target over the ceiling says so; one under it, or no ceiling, is a plain no.
  over = {**row['ratios']['score_vs_greedy'], 'median': 0.5, 'ceiling': 2.0, 'target': 3.0}
  under = {**over, 'ceiling': 4.0}
  for ratios, expected in (
    ({'score_vs_greedy': over}, 'no: over the ceiling'),
    ({'score_vs_greedy': under}, ' no'),
  ):
    line = toolkit_table([{**row, 'ratios': ratios}]).splitlines()[-1]
    assert line.endswith(expected), line

  src = np.array([[5, 6, 7, 1, 0, 0, 0, 0]], np.int32)
  tgt = np.array([[8, 9, 1, 0, 0, 0, 0, 0]], np.int32)
  model = Transformer(cfg.replace(max_len=8))
  ours = scoring.jitted_target_log_probs(model, params, src, tgt)
  prototype = toolkit._where_mask_log_probs(model, params, src, tgt)
  np.testing.assert_allclose(prototype, ours, atol=1e-5)
  assert np.all(np.asarray(ours)[0, 3:] == 0) and np.all(np.asarray(ours)[0, :3] < 0)


def test_toolkit_section_runs_per_size_after_the_decoding_rows(monkeypatch):
  calls = []
  monkeypatch.setattr(
    runner,
    'benchmark_toolkit',
    lambda name, model_config, params, **options: calls.append((name, options)) or {},
  )
  config = default.get_config()
  config.model.num_encoder_layers = config.model.num_decoder_layers = 1  # A faster init.
  report = runner.run(
    config, runner.Options(sizes=['tiny'], sections=['toolkit'], peak_n=64, peak_repeats=1)
  )
  ((name, options),) = calls
  assert name == 'tiny' and report['toolkit'] == [{}] and report['decoding'] == []
  assert options['rounds'] == runner.Options().compare_rounds
  assert options['peak_flops'] == report['peak']['flops_per_second']


def test_end_to_end_rows_time_the_translator_beside_its_own_program_and_ctranslate2():
  """The decode section's end-to-end rows (issue 49 item 5): every mode's Translator call, the
  same search program alone on the arguments the Translator passed it, and CTranslate2 decoding
  the same sentences to the same best hypotheses; one XLA execution per batch."""
  cfg, params = _toy_model()
  row = end_to_end.end_to_end_rows(
    'toy',
    cfg,
    params,
    batch_sizes=[4, 8],
    batches=2,
    source_length=8,
    decode_length=6,
    beam_size=3,
    alpha=0.6,
    rounds=2,
    compare=['ctranslate2'],
  )
  assert row['eos_suppressed'] and row['max_len'] == 8
  assert set(row['batch_sizes']) == {'4', '8'}
  for batch_size, modes in row['batch_sizes'].items():
    assert set(modes) == set(end_to_end.MODES)
    for mode, figures in modes.items():
      # 2 batches of each size: one program per batch, and nothing else dispatched (the old
      # loop ran jnp length penalties per hypothesis: 9 executions per beam batch here).
      assert figures['batches_launched'] == 2, (batch_size, mode)
      assert figures['dispatches_per_batch'] == 1, (batch_size, mode)
      sentences = 2 * int(batch_size)
      for variant in ('end_to_end', 'program'):
        each = figures[variant]['seconds_each_round']
        assert len(each) == 2
        assert figures[variant]['target_tokens_per_second'] == pytest.approx(
          sentences * 8 / np.median(each)
        )
      share = [
        (e - p) / e
        for e, p in zip(
          figures['end_to_end']['seconds_each_round'], figures['program']['seconds_each_round']
        )
      ]
      assert figures['host_share'] == pytest.approx(np.median(share))
      if mode == 'greedy':
        assert figures['same_best_hypothesis'] == 1.0, batch_size
      if mode == 'beam':
        # Ours scores the EOS forced at the cap (suppressed by -30, its log-prob depends on the
        # last token); CTranslate2 stopped by max_decoding_length does not: the same beams,
        # ranked a little differently (7 of 8 agree here).
        assert figures['same_best_hypothesis'] >= 0.5, batch_size
      if mode in ('greedy', 'beam'):
        assert figures['ratio_min'] <= figures['ratio'] <= figures['ratio_max']
      else:
        assert 'ctranslate2' not in figures
  table = end_to_end_table([row])
  assert 'host share' in table and len(table.splitlines()) == 1 + 2 + 8, table  # Title, header.


def test_the_file_row_runs_the_translate_command_and_ctranslate2s_translate_file(
  number_words_workdir, tmp_path_factory
):
  workdir = copied_workdir(number_words_workdir, tmp_path_factory, 'file_row')
  row = end_to_end.file_translation(
    workdir, lines=40, batch_size=16, beam_size=4, alpha=0.6, compare=['ctranslate2']
  )
  assert row['lines'] == 40 and row['ours_seconds'] > 0 and row['ctranslate2_seconds'] > 0
  assert row['ratio'] == pytest.approx(row['ctranslate2_seconds'] / row['ours_seconds'])
  # The same trained model and beam on both: most lines agree (the length penalties differ).
  assert row['same_output'] >= 0.5, row
  assert 'translate_file' in file_table(row)
