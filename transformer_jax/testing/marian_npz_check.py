"""By-hand check that `marian_npz` writes what CTranslate2 reads as a Marian model.

    . .venv/bin/activate && python -m transformer_jax.testing.marian_npz_check [--keep DIR]

For several layouts (shared vocabulary / `Wemb`, separate vocabularies / `encoder_Wemb` +
`decoder_Wemb`, untied output, no logits bias, pre-norm, relu, ...): writes a tiny random
model (d_model 32, 2 heads, 2+2 layers, vocab ~50), converts it with
`ctranslate2.converters.MarianConverter(npz, vocabs)`, translates greedy and beam 4, and
compares CTranslate2's teacher-forced log-probs (`score_batch`) with
`marian_reference.marian_reference_logits`:
  * stock conversion vs the reference run with CTranslate2's sinusoid table and eps 1e-5;
  * a "Marian-exact" conversion (converter's sinusoid replaced by Marian's formula,
    `layer_norm_epsilon: 1e-6` in config.json) vs the reference with Marian's semantics;
  * CTranslate2 greedy output vs greedy decoding of the reference.
One CPU thread, a few seconds. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile

import ctranslate2
import numpy as np
from ctranslate2.converters import marian as ct2_marian

from transformer_jax.testing import marian_npz, marian_reference

SMALL = dict(d_model=32, d_ff=64, heads=2, encoder_layers=2, decoder_layers=2)
LAYOUTS = {
  'shared vocab, tied-embeddings-all (Wemb)': dict(vocab_size=50, tied_embeddings='all'),
  'separate vocabs, tied-embeddings (encoder_Wemb, decoder_Wemb)': dict(
    vocab_size=50, target_vocab_size=43, tied_embeddings='target'
  ),
  'separate vocabs, untied output (decoder_ff_logit_out_Wt)': dict(
    vocab_size=50, target_vocab_size=43, tied_embeddings='none'
  ),
  'separate vocabs, untied legacy output (decoder_ff_logit_out_W)': dict(
    vocab_size=50, target_vocab_size=43, tied_embeddings='none', legacy_output_w=True
  ),
  'shared vocab, tied-embeddings-src (Wemb in, _Wt out)': dict(
    vocab_size=50, tied_embeddings='src'
  ),
  'shared vocab, no logits bias (output-omit-bias)': dict(vocab_size=50, logits_bias=False),
  'separate vocabs, no logits bias': dict(
    vocab_size=50, target_vocab_size=43, tied_embeddings='target', logits_bias=False
  ),
  'relu activation': dict(vocab_size=50, activation='relu'),
  'pre-norm (n / da / top n)': dict(vocab_size=50, pre_norm=True),
  'post-norm + layer-normalised embeddings (postprocess-emb n)': dict(
    vocab_size=50, layernorm_embedding=True
  ),
}


@contextlib.contextmanager
def marian_exact_sinusoids():
  """Makes MarianConverter store Marian's own position table instead of its HF-style one."""
  original = ct2_marian._make_sinusoidal_position_encodings
  ct2_marian._make_sinusoidal_position_encodings = lambda dim, num_positions=2048: (
    marian_reference.marian_sinusoids(num_positions, dim)
  )
  try:
    yield
  finally:
    ct2_marian._make_sinusoidal_position_encodings = original


def convert(files, out_dir, *, marian_exact=False):
  converter = ct2_marian.MarianConverter(files.npz, files.vocabs)
  if marian_exact:
    with marian_exact_sinusoids():
      converter.convert(out_dir, force=True)
    path = os.path.join(out_dir, 'config.json')
    with open(path) as f:
      config = json.load(f)
    config['layer_norm_epsilon'] = marian_npz.LAYER_NORM_EPS
    with open(path, 'w') as f:
      json.dump(config, f, indent=2)
  else:
    converter.convert(out_dir, force=True)
  return out_dir


def reference_greedy(files, source_ids, max_len, **ref_kwargs):
  out = []
  for _ in range(max_len):
    logits = marian_reference.marian_reference_logits(files.arrays, source_ids, out, **ref_kwargs)
    nxt = int(np.argmax(logits[-1]))
    if nxt == marian_npz.EOS_ID:
      break
    out.append(nxt)
  return out


def check_layout(name, kwargs, root, seed):
  print(f'== {name}')
  files = marian_npz.write_random_marian_model(
    os.path.join(root, f'm{seed}'), seed=seed, **SMALL, **kwargs
  )
  with np.load(files.npz) as npz:
    names = sorted(n for n in npz.files if 'embedding' in n or 'Wemb' in n or 'logit' in n)
  print(f'   npz: {len(files.arrays)} arrays; embeddings/output: {names}')
  print(f'   vocabs: {[os.path.basename(v) for v in files.vocabs]}')
  assert ct2_marian.load_vocab(files.vocabs[0]) == files.source_tokens
  assert ct2_marian.load_vocab(files.vocabs[-1]) == files.target_tokens

  stock = convert(files, os.path.join(root, f'ct2_{seed}'))
  exact = convert(files, os.path.join(root, f'ct2_exact_{seed}'), marian_exact=True)
  with open(os.path.join(stock, 'config.json')) as f:
    ct2_config = json.load(f)
  print(
    '   converted; config.json:',
    {
      k: ct2_config.get(k)
      for k in (
        'decoder_start_token',
        'bos_token',
        'eos_token',
        'unk_token',
        'add_source_eos',
        'layer_norm_epsilon',
      )
    },
  )

  src_tokens = [files.source_tokens[i] for i in (2, 7, 30, 36, 12, 45)]  # '▁a' ... incl. '"'
  src_ids = [files.source_tokens.index(t) for t in src_tokens] + [marian_npz.EOS_ID]
  tgt_tokens = [files.target_tokens[i] for i in (3, 40, 9, 28)]
  tgt_ids = [files.target_tokens.index(t) for t in tgt_tokens]

  ok = True
  ct2_semantics = dict(
    position_table=lambda n, d: marian_reference.ctranslate2_marian_sinusoids(n, d), eps=1e-5
  )
  for label, model_dir, ref_kwargs in (
    ('stock CT2 vs reference(CT2 sinusoids, eps 1e-5)', stock, ct2_semantics),
    ('Marian-exact CT2 vs reference(Marian)', exact, {}),
  ):
    translator = ctranslate2.Translator(model_dir, device='cpu', intra_threads=1, inter_threads=1)
    greedy = translator.translate_batch([src_tokens], beam_size=1, max_decoding_length=12)
    beam = translator.translate_batch(
      [src_tokens], beam_size=4, num_hypotheses=2, max_decoding_length=12, return_scores=True
    )
    score = translator.score_batch([src_tokens], [tgt_tokens])[0]
    logp = marian_reference.log_softmax(
      marian_reference.marian_reference_logits(files.arrays, src_ids, tgt_ids, **ref_kwargs)
    )
    ref = [float(logp[j, t]) for j, t in enumerate(tgt_ids + [marian_npz.EOS_ID])]
    err = float(np.max(np.abs(np.array(score.log_probs) - np.array(ref))))
    ref_greedy = [
      files.target_tokens[i] for i in reference_greedy(files, src_ids, 12, **ref_kwargs)
    ]
    good = err < 1e-3 and greedy[0].hypotheses[0] == ref_greedy
    ok &= good
    print(f'   {label}: {"OK" if good else "MISMATCH"}')
    print(f'     greedy : {greedy[0].hypotheses[0]}')
    print(f'     ref    : {ref_greedy}')
    print(f'     beam 4 : {beam[0].hypotheses} scores {np.round(beam[0].scores, 3).tolist()}')
    print(
      f'     score_batch log-probs {np.round(score.log_probs, 4).tolist()}, '
      f'max |CT2 - reference| = {err:.2e}'
    )
    del translator
  # How far stock CTranslate2 is from Marian itself on this random model.
  marian_logp = marian_reference.log_softmax(
    marian_reference.marian_reference_logits(files.arrays, src_ids, tgt_ids)
  )
  ct2_logp = marian_reference.log_softmax(
    marian_reference.marian_reference_logits(files.arrays, src_ids, tgt_ids, **ct2_semantics)
  )
  print(
    f'   reference(Marian) vs reference(CT2 semantics): max |dlogp| = '
    f'{float(np.max(np.abs(marian_logp - ct2_logp))):.2e}'
  )
  return ok


def check_padded_meta(root):
  print('== special:model.yml NUL-padded to 256 bytes (Marian >= 2025-05)')
  files = marian_npz.write_random_marian_model(
    os.path.join(root, 'padded'), seed=99, vocab_size=50, pad_meta=True, **SMALL
  )
  assert marian_npz.read_marian_config(files.npz)['enc-depth'] == 2
  with np.load(files.npz) as npz:
    print(
      f'   special:model.yml: {npz["special:model.yml"].dtype} '
      f'{npz["special:model.yml"].shape}; read_marian_config OK'
    )
  try:
    ct2_marian.MarianConverter(files.npz, files.vocabs).convert(
      os.path.join(root, 'ct2_padded'), force=True
    )
    print('   CTranslate2 converted it')
  except Exception as e:  # noqa: BLE001
    print(f'   CTranslate2 rejects it, as expected: {type(e).__name__}: {str(e).splitlines()[0]}')


def check_ctranslate2_limits(root):
  """Options CTranslate2 4.8's converter accepts without representing them (documented)."""
  print('== options CTranslate2 converts silently but does not represent')
  src_tokens, src_ids, tgt_ids = ['\u2581a', '\u2581f', '\u2581b'], [2, 7, 3, 0], [3, 40, 9]
  for label, kwargs in (
    ('transformer-ffn-depth: 3 (W3 ignored)', dict(ffn_depth=3)),
    (
      'right-left: true (Marian reverses the output; CT2 does not)',
      dict(extra_config={'right-left': True}),
    ),
  ):
    files = marian_npz.write_random_marian_model(
      os.path.join(root, 'limit'), seed=3, vocab_size=50, **SMALL, **kwargs
    )
    out = convert(files, os.path.join(root, 'ct2_limit'))
    translator = ctranslate2.Translator(out, device='cpu', intra_threads=1, inter_threads=1)
    score = translator.score_batch([src_tokens], [[files.target_tokens[i] for i in tgt_ids]])[0]
    logp = marian_reference.log_softmax(
      marian_reference.marian_reference_logits(
        files.arrays,
        src_ids,
        tgt_ids,
        position_table=marian_reference.ctranslate2_marian_sinusoids,
        eps=1e-5,
      )
    )
    ref = [float(logp[j, t]) for j, t in enumerate(tgt_ids + [marian_npz.EOS_ID])]
    err = float(np.max(np.abs(np.array(score.log_probs) - np.array(ref))))
    print(f'   {label}: converted, max |CT2 - reference| = {err:.2e}')


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--keep', help='write the models here and keep them')
  args = parser.parse_args()
  print(f'ctranslate2 {ctranslate2.__version__}')
  with contextlib.ExitStack() as stack:
    root = args.keep or stack.enter_context(tempfile.TemporaryDirectory())
    ok = True
    for seed, (name, kwargs) in enumerate(LAYOUTS.items()):
      ok &= check_layout(name, kwargs, root, seed)
    check_padded_meta(root)
    check_ctranslate2_limits(root)
  print('ALL OK' if ok else 'SOME CHECKS FAILED')
  sys.exit(0 if ok else 1)


if __name__ == '__main__':
  main()
