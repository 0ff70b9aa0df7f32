"""The benchmark's row against transformers (`benchmark/transformers_comparison.py`): both
engines decode the same imported weights, every output is as long as the row says, and the
figures are the row's own arithmetic."""

import numpy as np
import pytest

from transformer_jax.benchmark import report, transformers_comparison
from transformer_jax.benchmark.training import size_spec
from transformer_jax.configs import default

pytest.importorskip('torch', reason='torch is not installed (pip install -e .[test])')
pytest.importorskip('transformers', reason='transformers is not installed (pip install -e .[test])')


def _tiny_config():
  config = size_spec('tiny', default.get_config(), dtype='float32').model_config
  return config.replace(
    d_model=32, d_ff=64, num_heads=2, num_encoder_layers=1, num_decoder_layers=1
  )


@pytest.mark.parametrize('beam_size', [1, 3])
def test_both_engines_decode_the_same_weights_to_the_same_outputs(beam_size):
  decode_length, batch_size = 6, 4
  row = transformers_comparison.compare_transformers(
    'tiny',
    _tiny_config(),
    batch_size=batch_size,
    beam_size=beam_size,
    decode_length=decode_length,
    rounds=2,
    vocab_size=400,
  )
  # EOS suppressed: both decode decode_length + 1 tokens (ours the last a forced EOS).
  assert row['target_tokens_each'] == row['transformers_tokens_each'] == decode_length + 1
  # Greedy must agree exactly; beam search too here, as every hypothesis has the same length
  # (the penalties then rank alike) and our forced EOS is cut from the comparison.
  assert row['same_output'] == 1.0
  for side in ('ours', 'transformers'):
    median = np.median(row[side]['seconds_each_round'])
    tokens = batch_size * (decode_length + 1)
    assert row[side]['target_tokens_per_second'] == pytest.approx(tokens / median)
  ratios = [
    t / o
    for o, t in zip(row['ours']['seconds_each_round'], row['transformers']['seconds_each_round'])
  ]
  assert row['ratio'] == pytest.approx(np.median(ratios))
  assert row['ratio_min'] == pytest.approx(min(ratios))
  table = report.transformers_table([row])
  assert f'{row["ratio"]:.2f}x' in table and 'vocabulary 400' in table
