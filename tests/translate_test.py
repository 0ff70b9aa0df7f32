"""Translator: exactly one output line per input line, in order, whatever the input."""

import copy
import functools

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transformer_jax.benchmark import decoding as decode_benchmark
from transformer_jax.common.errors import UserInputError
from transformer_jax.inference import decoding
from transformer_jax.inference import translator as translator_module
from transformer_jax.inference.decoding import source_bucket
from transformer_jax.inference.translator import Translator
from transformer_jax.search import decode

from conftest import random_weight_translator


@functools.lru_cache(maxsize=1)
def _translator() -> Translator:
  return random_weight_translator()


def test_bucket_sizes():
  assert [source_bucket(n, 64) for n in (1, 8, 9, 16, 17, 40, 64, 65)] == [
    8,
    8,
    16,
    16,
    32,
    64,
    64,
    64,
  ]


def test_empty_and_blank_lines_give_empty_lines():
  outputs = _translator().translate(['', 'one', '  ', '\t', 'two hundred'], beam_size=1)
  assert len(outputs) == 5
  assert outputs[0] == outputs[2] == outputs[3] == ''


def test_a_single_string_is_refused_not_translated_letter_by_letter():
  with pytest.raises(
    TypeError, match=r'takes a list of sentences, got a single str; pass \[sentence\]'
  ):
    _translator().translate('seven hundred one')


def test_overlong_input_is_truncated_with_a_warning_not_a_crash(caplog):
  outputs = _translator().translate(['one ' * 500], beam_size=1)
  assert len(outputs) == 1
  assert any('truncated' in r.getMessage() for r in caplog.records)


def test_output_does_not_depend_on_batch_companions():
  translator = _translator()
  for beam_size in (1, 4):
    alone = translator.translate(['seven hundred one'], beam_size=beam_size)
    together = translator.translate(
      ['three', 'seven hundred one', 'nine thousand ' * 3], beam_size=beam_size
    )
    assert together[1] == alone[0]


def test_the_beam_rule_reaches_the_search():
  """Translator.translate(beam_rule=...) is beam_decode(rule=...) on each sentence alone, with
  the translator's caps (source length + 50, EOS counted), and each rule is its own compiled
  search (random weights rarely make the rules' outputs differ: tests/decode_test.py does)."""
  from transformer_jax.data.tokenizer import EOS_ID, PAD_ID

  translator_module.forget_programs()  # Counted from none (earlier Translators share them).
  translator = random_weight_translator()
  sentences = ['seven hundred one', 'three thousand forty', 'nine']
  for beam_rule in decode.BEAM_RULES:
    expected = []
    for sentence in sentences:
      ids = [*translator.tokenizer.encode(sentence), EOS_ID]
      length = source_bucket(len(ids), translator.model_config.max_len)
      src = np.full((1, length), PAD_ID, np.int32)
      src[0, : len(ids)] = ids
      max_decode_len = min(translator.model_config.max_len, length + 50)
      tokens, _ = decoding.beam_decode(
        translator.model,
        translator.params,
        src,
        beam_size=4,
        alpha=0.6,
        max_decode_len=max_decode_len,
        max_lengths=np.array([min(len(ids) + 50, max_decode_len)], np.int32),
        rule=beam_rule,
      )
      (best,) = decode.strip_after_eos(np.asarray(tokens)[:, 0], EOS_ID, pad_id=PAD_ID)
      expected.append(translator.tokenizer.decode(best))
    assert translator.translate(sentences, beam_size=4, beam_rule=beam_rule) == expected
  # One search program, compiled once per spec: here the two rules' (one batch shape).
  assert translator._search._cache_size() == len(decode.BEAM_RULES)


def test_an_unknown_beam_rule_is_a_one_line_error():
  with pytest.raises(UserInputError, match=r"beam_rule must be one of \('exact', 'ctranslate2'\)"):
    _translator().translate(['seven'], beam_rule='fairseq')


def test_model_beam_search_beam1_is_greedy_and_cache_changes_nothing():
  """On the real model: beam 1 without penalty == greedy; cached == uncached; sorted scores."""
  translator = _translator()
  src = np.zeros((2, 8), np.int32)
  src[0, :4] = [20, 30, 40, 1]
  src[1, :3] = [50, 60, 1]
  model, params = translator.model, translator.params
  tokens, scores = jax.jit(
    functools.partial(decoding.beam_decode, model, beam_size=4, alpha=0.6, max_decode_len=10)
  )(params, src)
  greedy = jax.jit(functools.partial(decoding.greedy_decode, model, max_decode_len=10))(params, src)
  beam1, _ = jax.jit(
    functools.partial(decoding.beam_decode, model, beam_size=1, alpha=0.0, max_decode_len=10)
  )(params, src)
  np.testing.assert_array_equal(beam1[:, 0], greedy)  # Beam 1 without penalty is greedy.
  assert np.all(np.diff(np.asarray(scores), axis=1) <= 1e-6)  # Sorted best first.
  # Uncached beam search agrees with the cached one.
  tokens_uncached, scores_uncached = jax.jit(
    functools.partial(
      decoding.beam_decode, model, beam_size=4, alpha=0.6, max_decode_len=10, use_cache=False
    )
  )(params, src)
  np.testing.assert_array_equal(tokens, tokens_uncached)
  np.testing.assert_allclose(scores, scores_uncached, atol=1e-5)


_lines = st.lists(
  st.one_of(
    st.text(max_size=40),  # Any Unicode, including control characters.
    st.just(''),
    st.text(alphabet='abcdefghijklmnopqrstuvwxyz- ', min_size=100, max_size=400),
  ),
  min_size=0,
  max_size=12,
)


@settings(
  max_examples=40,
  deadline=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(_lines)
def test_one_output_per_input_in_order(lines):
  lines = [line.replace('\n', ' ').replace('\r', ' ') for line in lines]
  outputs = _translator().translate(lines, beam_size=1)
  assert len(outputs) == len(lines)
  for line, output in zip(lines, outputs):
    assert isinstance(output, str) and '\n' not in output
    if not line.strip():
      assert output == ''


def test_a_cudnn_trained_model_translates_on_cpu_through_xla_attention(tmp_path):
  """attention_impl='cudnn' exists only on NVIDIA GPUs; its checkpoints still load elsewhere."""
  import json
  import os

  from transformer_jax.checkpoints.checkpointer import save_params
  from transformer_jax.workdir.layout import Workdir

  reference = _translator()
  cudnn_config = reference.model_config.replace(attention_impl='cudnn', dtype='bfloat16')
  (tmp_path / 'config.json').write_text(json.dumps({'config': {}, 'model': cudnn_config.to_dict()}))
  reference.tokenizer.save(str(tmp_path / 'vocab.model'))
  os.makedirs(tmp_path / 'checkpoints')
  save_params(Workdir(str(tmp_path)).averaged, reference.params)
  loaded = Translator.from_checkpoint(str(tmp_path), 'averaged')
  assert loaded.model_config == cudnn_config.replace(attention_impl='xla')
  float32 = Translator(
    loaded.model_config.replace(dtype='float32'), loaded.params, loaded.tokenizer, batch_size=8
  )
  sentences = ['three hundred forty-two', 'seven']
  assert float32.translate(sentences, beam_size=1) == reference.translate(sentences, beam_size=1)
  assert len(loaded.translate(sentences, beam_size=1)) == 2  # bfloat16 runs too


def test_repeated_batch_shapes_compile_once():
  """Batches are padded to fixed rows and power-of-two source lengths: new sentences of
  already-seen bucket lengths reuse the compiled decoders (issue 7: no recompilation)."""
  translator_module.forget_programs()  # Counted from none (earlier Translators share them).
  translator = random_weight_translator()
  max_len = translator.model_config.max_len

  def bucket(sentences):  # one batch each here: the bucket of its longest sentence (+ EOS)
    return source_bucket(max(len(translator.tokenizer.encode(s)) + 1 for s in sentences), max_len)

  first = ['one', 'two hundred', 'three thousand four hundred five']
  again = ['nine', 'eight hundred one', 'seven thousand four hundred six']
  longer = [' '.join(['nine hundred ninety-nine thousand'] * 4)]
  assert bucket(first) == bucket(again) == 16 and bucket(longer) == 32
  translator.translate(first, beam_size=1)
  translator.translate(first, beam_size=2)
  assert translator._search._cache_size() == 2  # Greedy's and beam search's.
  translator.translate(again, beam_size=1)
  translator.translate(again, beam_size=2)
  assert translator._search._cache_size() == 2
  translator.translate(longer, beam_size=1)
  assert translator._search._cache_size() == 3


def test_translators_of_one_model_share_their_programs_and_no_other():
  """Restoring a model again (a notebook, a sweep, the server's reloads) traces and compiles
  nothing again: Translators of equal models share the jitted searches; the parameters are
  arguments, so each translates with its own."""
  translator_module.forget_programs()
  first = random_weight_translator()
  sources = ['one', 'two hundred', 'three thousand four hundred five']
  expected = first.translate(sources, beam_size=2)
  assert first._search._cache_size() == 1
  # Other parameters of the same model: the same programs, nothing compiled, its own outputs.
  params = jax.tree_util.tree_map(lambda x: x * 1.5, first.params)
  second = Translator(first.model_config, params, first.tokenizer, batch_size=first.batch_size)
  programs = ('_search', '_token_log_probs', '_attention_apply')
  assert all(getattr(second, name) is getattr(first, name) for name in programs)
  rescaled = second.translate(sources, beam_size=2)
  assert first._search._cache_size() == 1
  assert rescaled != expected  # Computed with its parameters, not the first's.
  # Another model (each config field is the model's: the frozen dataclass is the key).
  other = Translator(
    first.model_config.replace(max_len=first.model_config.max_len + 8),
    first.params,
    first.tokenizer,
    batch_size=first.batch_size,
  )
  assert not any(getattr(other, name) is getattr(first, name) for name in programs)
  # After forget_programs (code patched in between), new programs.
  translator_module.forget_programs()
  again = Translator(first.model_config, first.params, first.tokenizer, batch_size=4)
  assert again._search is not first._search and again.translate(sources, beam_size=2) == expected


@pytest.mark.parametrize('beam_size', [1, 4])
def test_output_is_capped_at_input_length_plus_50_tokens(beam_size):
  # With EOS suppressed the model never stops by itself, so every output is exactly as long as
  # the cap: its own source's token count + 50, also when a longer sentence shares its batch,
  # and never more than the model's max_len (EOS counted on both sides, stripped from output).
  base = _translator()
  params, suppressed = decode_benchmark.suppress_eos(base.params, base.model_config)
  assert suppressed
  translator = Translator(
    base.model_config.replace(max_len=96), params, base.tokenizer, batch_size=4
  )
  translator.tokenizer = copy.copy(base.tokenizer)
  translator.tokenizer.decode = lambda ids: str(len(ids))  # Output token counts, not text.
  sentences = ['one', 'seven hundred forty-two thousand three hundred one', 'one ' * 60]
  counts = [int(n) for n in translator.translate(sentences, beam_size=beam_size)]
  source_tokens = [len(base.tokenizer.encode(s)) + 1 for s in sentences]
  assert source_tokens[0] < source_tokens[1] < 96 - 50 < source_tokens[2]
  assert counts == [source_tokens[0] + 49, source_tokens[1] + 49, 95]
