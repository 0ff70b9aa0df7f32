"""Random Marian (OPUS-MT) transformer checkpoints, written the way Marian writes them.

For tests of `python -m transformer_jax.import_marian`. Plain functions, no pytest fixtures:

    files = marian_npz.write_random_marian_model(tmp_dir, vocab_size=50, d_model=32, d_ff=64,
                                                 heads=2, encoder_layers=2, decoder_layers=2,
                                                 seed=0)
    files.npz, files.vocabs, files.decoder_yml   # model.npz, [src.yml, tgt.yml], decoder.yml

What Marian's C++ does and this file copies (marian-dev, src/...):
  * every tensor is float32, row-major; linear weights are [in, out] (`x @ W + b`,
    layers/generic.h denseInline, models/transformer.h MultiHead); biases and layer-norm
    parameters are [1, dim]; embeddings are [vocab, dim]; an untied output layer is
    `decoder_ff_logit_out_Wt` [vocab, dim] (layers/output.cpp; legacy models: `_W` [dim, vocab]).
  * `special:model.yml` is an int8 array: the YAML text of the model options (sorted keys,
    block style, common/cli_helper.h OutputYaml) plus one NUL (common/io.cpp addMetaToItems).
    Marian builds since May 2025 (af099491) pad it with NULs to a multiple of 256 bytes;
    CTranslate2 4.8 strips only the last byte and then fails on the padding (`pad_meta=True`).
  * vocabularies are YAML maps `piece: id` with `</s>: 0` and `<unk>: 1` first
    (data/default_vocab.cpp); `.spm` vocabularies are SentencePiece models trained with
    `--bos_id=-1 --eos_id=0 --unk_id=1` (data/sentencepiece_vocab.cpp).

`marian_reference_logits` is a NumPy forward pass with Marian's exact inference semantics
(sinusoids, eps, zero start embedding) to check an importer against, independent of
CTranslate2, whose converter differs in small ways (see /tmp/marian_notes.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence

import numpy as np

EOS, UNK = '</s>', '<unk>'
EOS_ID, UNK_ID = 0, 1
# What a Marian 1.11 build writes as `version` (any string works).
MARIAN_VERSION = 'v1.11.0 f00d0621 2022-02-08 08:39:24 -0800'
LAYER_NORM_EPS = 1e-6  # layers/generic.h layerNorm(): marian::layerNorm(x, scale, bias, 1e-6f)
TIED_EMBEDDINGS = ('all', 'target', 'src', 'none')
SPACE = '\u2581'  # SentencePiece's word-start mark '▁'


# ---------------------------------------------------------------------------------------------
# special:model.yml


def marian_model_config(
  *,
  vocab_size: int,
  target_vocab_size: int | None = None,
  d_model: int,
  d_ff: int,
  heads: int,
  encoder_layers: int,
  decoder_layers: int,
  tied_embeddings: str = 'all',
  activation: str = 'swish',
  pre_norm: bool = False,
  layernorm_embedding: bool = False,
  logits_bias: bool = True,
  ffn_depth: int = 2,
  extra_config: Mapping | None = None,
) -> dict:
  """The options Marian stores in `special:model.yml` for a `--type transformer` model.

  The keys are EncoderDecoder::modelFeatures_ (models/encoder_decoder.cpp), values the
  defaults of common/config_parser.cpp unless set here; `extra_config` overrides any key.
  """
  if tied_embeddings not in TIED_EMBEDDINGS:
    raise ValueError(f'tied_embeddings must be one of {TIED_EMBEDDINGS}, got {tied_embeddings!r}')
  target_vocab_size = vocab_size if target_vocab_size is None else target_vocab_size
  if tied_embeddings in ('all', 'src') and target_vocab_size != vocab_size:
    raise ValueError(f'tied_embeddings={tied_embeddings!r} shares one vocabulary')
  config = {
    'bert-train-type-embeddings': True,
    'bert-type-vocab-size': 2,
    'dec-cell': 'gru',
    'dec-cell-base-depth': 2,
    'dec-cell-high-depth': 1,
    'dec-depth': decoder_layers,
    'dim-emb': d_model,
    'dim-rnn': 1024,
    'dim-vocabs': [vocab_size, target_vocab_size],
    'enc-cell': 'gru',
    'enc-cell-depth': 1,
    'enc-depth': encoder_layers,
    'enc-type': 'bidirectional',
    'factors-combine': 'sum',
    'factors-dim-emb': 0,
    'input-types': [],
    'layer-normalization': False,
    'lemma-dependency': '',
    'lemma-dim-emb': 0,
    'output-omit-bias': not logits_bias,
    'right-left': False,
    'skip': False,
    'tied-embeddings': tied_embeddings == 'target',
    'tied-embeddings-all': tied_embeddings == 'all',
    'tied-embeddings-src': tied_embeddings == 'src',
    'transformer-aan-activation': 'swish',
    'transformer-aan-depth': 2,
    'transformer-aan-nogate': False,
    'transformer-decoder-autoreg': 'self-attention',
    'transformer-decoder-dim-ffn': 0,
    'transformer-decoder-ffn-depth': 0,
    'transformer-dim-aan': 2048,
    'transformer-dim-ffn': d_ff,
    'transformer-ffn-activation': activation,
    'transformer-ffn-depth': ffn_depth,
    'transformer-guided-alignment-layer': 'last',
    'transformer-heads': heads,
    'transformer-no-projection': False,
    'transformer-pool': False,
    'transformer-postprocess': 'da' if pre_norm else 'dan',
    'transformer-postprocess-emb': 'n' if layernorm_embedding else 'd',
    'transformer-postprocess-top': 'n' if pre_norm else '',
    'transformer-preprocess': 'n' if pre_norm else '',
    'transformer-rnn-projection': False,
    'transformer-tied-layers': [],
    'transformer-train-position-embeddings': False,
    'type': 'transformer',
    'ulr': False,
    'ulr-dim-emb': 0,
    'ulr-trainable-transformation': False,
    'version': MARIAN_VERSION,
  }
  config.update(extra_config or {})
  return config


_PLAIN = re.compile(r'[A-Za-z0-9_./<>\u0080-\U0010ffff][A-Za-z0-9_./<>() :+\-\u0080-\U0010ffff]*')
_YAML_WORDS = {'true', 'false', 'yes', 'no', 'on', 'off', 'null', 'y', 'n', '~'}


def _yaml_scalar(value) -> str:
  """One scalar as yaml-cpp's emitter writes it (plain when it can, else double-quoted)."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (int, np.integer)):
    return str(int(value))
  if isinstance(value, float):
    return repr(value)
  value = str(value)
  plain = (
    _PLAIN.fullmatch(value)
    and not value.endswith(' ')
    and ': ' not in value
    and value.lower() not in _YAML_WORDS
    and not re.fullmatch(r'[-+]?(\d[\d_]*)?(\.\d*)?([eE][-+]?\d+)?|0x[0-9a-fA-F]+', value)
  )
  if plain:
    return value
  return json.dumps(value, ensure_ascii=False)  # "..." with \" and \\ escapes


def marian_yaml(config: Mapping) -> str:
  """`config` as Marian's cli::OutputYaml emits it: sorted keys, block lists, `[]` alone."""
  lines = []
  for key in sorted(config):
    value = config[key]
    if isinstance(value, (list, tuple)):
      lines.append(f'{key}:')
      if value:
        lines.extend(f'  - {_yaml_scalar(v)}' for v in value)
      else:
        lines.append('  []')
    else:
      lines.append(f'{key}: {_yaml_scalar(value)}')
  return '\n'.join(lines)


def marian_meta_array(yaml_text: str, *, pad_meta: bool = False) -> np.ndarray:
  """`special:model.yml` as stored: int8 bytes of the YAML text + NUL (+ NULs to 256n)."""
  data = yaml_text.encode('utf-8') + b'\0'
  if pad_meta:
    data += b'\0' * (-len(data) % 256)
  return np.frombuffer(data, dtype=np.int8).copy()


def read_marian_config(npz) -> dict:
  """The YAML options of a Marian .npz (path or loaded NpzFile), tolerant of NUL padding."""
  import yaml

  if isinstance(npz, (str, os.PathLike)):
    with np.load(npz) as f:
      meta = f['special:model.yml']
  else:
    meta = npz['special:model.yml']
  text = meta.tobytes().split(b'\0', 1)[0]
  return yaml.safe_load(text)


# ---------------------------------------------------------------------------------------------
# vocabularies


def make_tokens(vocab_size: int, *, style: str = 'lower') -> list[str]:
  """`</s>`, `<unk>`, then distinct SentencePiece-like pieces ('▁a', 'a', ...).

  style='lower' or 'upper' gives different pieces for a source and a target vocabulary. A few
  pieces need YAML quoting (':', '"', '#', 'true', '1', ...) to exercise vocabulary parsers.
  """
  if vocab_size < 8:
    raise ValueError('vocab_size must be at least 8')
  letters = 'abcdefghijklmnopqrstuvwxyz'
  if style == 'upper':
    letters = letters.upper()
  elif style != 'lower':
    raise ValueError(f'style must be lower or upper, got {style!r}')
  awkward = [SPACE + ',', ':', '"', SPACE + '#', 'true', '1', "'s", '\\']
  pieces = [SPACE + c for c in letters] + awkward + list(letters)
  pieces += [SPACE + a + b for a in letters for b in letters]
  tokens = [EOS, UNK] + pieces
  if vocab_size > len(tokens):
    raise ValueError(f'vocab_size must be at most {len(tokens)}')
  return tokens[:vocab_size]


def vocab_yaml(tokens: Sequence[str]) -> str:
  """A Marian vocabulary file: `piece: id` per line, ids in order (data/default_vocab.cpp)."""
  if tokens[EOS_ID] != EOS or tokens[UNK_ID] != UNK:
    raise ValueError('Marian vocabularies start with </s> (id 0) and <unk> (id 1)')
  return ''.join(f'{_yaml_scalar(tok)}: {i}\n' for i, tok in enumerate(tokens))


def write_vocab_yml(path, tokens: Sequence[str]) -> str:
  with open(path, 'w', encoding='utf-8') as f:
    f.write(vocab_yaml(tokens))
  return os.fspath(path)


def read_vocab_yml(path) -> list[str]:
  """Tokens by id of a Marian vocab .yml (PyYAML; CTranslate2 parses it by hand instead)."""
  import yaml

  with open(path, encoding='utf-8') as f:
    mapping = yaml.safe_load(f)
  tokens = [None] * (max(mapping.values()) + 1)
  for tok, i in mapping.items():
    tokens[i] = str(tok) if not isinstance(tok, str) else tok
  return tokens


def train_sentencepiece(model_prefix, sentences: Sequence[str], vocab_size: int) -> list[str]:
  """A real `.spm` as Marian trains it (bos off, `</s>`=0, `<unk>`=1); returns its pieces.

  Offline and a fraction of a second for a few hundred short sentences. Marian uses these ids
  directly for a `.spm` vocabulary; OPUS-MT releases instead pair the .spm (segmentation) with
  a vocab .yml whose ids are what the model uses.
  """
  import sentencepiece as spm

  path = os.fspath(model_prefix) + '.txt'
  with open(path, 'w', encoding='utf-8') as f:
    f.write('\n'.join(sentences) + '\n')
  spm.SentencePieceTrainer.train(
    input=path,
    model_prefix=os.fspath(model_prefix),
    vocab_size=vocab_size,
    model_type='unigram',
    bos_id=-1,
    eos_id=0,
    unk_id=1,
    eos_piece=EOS,
    unk_piece=UNK,
    hard_vocab_limit=False,
    num_threads=1,
    minloglevel=2,
  )
  processor = spm.SentencePieceProcessor(model_file=os.fspath(model_prefix) + '.model')
  return [processor.id_to_piece(i) for i in range(processor.get_piece_size())]


# ---------------------------------------------------------------------------------------------
# weights


def marian_tensor_shapes(config: Mapping, *, legacy_output_w: bool = False) -> dict:
  """Name -> shape of every tensor Marian saves for `config` (besides special:model.yml)."""
  d = config['dim-emb']
  v_src, v_tgt = config['dim-vocabs']
  d_ff = config['transformer-dim-ffn']
  d_ff_dec = config.get('transformer-decoder-dim-ffn', 0) or d_ff
  depth = config.get('transformer-ffn-depth', 2)
  depth_dec = config.get('transformer-decoder-ffn-depth', 0) or depth
  pre = 'n' in config['transformer-preprocess']
  shapes = {}

  if config['tied-embeddings-all'] or config['tied-embeddings-src']:
    shapes['Wemb'] = (v_src, d)
  else:
    shapes['encoder_Wemb'] = (v_src, d)
    shapes['decoder_Wemb'] = (v_tgt, d)

  def layer_norm(name, suffix=''):
    shapes[f'{name}_ln_scale{suffix}'] = (1, d)
    shapes[f'{name}_ln_bias{suffix}'] = (1, d)

  def attention(prefix):
    for p in 'qkvo':
      shapes[f'{prefix}_W{p}'] = (d, d)
      shapes[f'{prefix}_b{p}'] = (1, d)
    layer_norm(f'{prefix}_Wo', '_pre' if pre else '')

  def ffn(prefix, inner, n):
    dims = [d] + [inner] * (n - 1) + [d]
    for i in range(n):
      shapes[f'{prefix}_W{i + 1}'] = (dims[i], dims[i + 1])
      shapes[f'{prefix}_b{i + 1}'] = (1, dims[i + 1])
    layer_norm(f'{prefix}_ffn', '_pre' if pre else '')

  for side in ('encoder', 'decoder'):
    if 'n' in config['transformer-postprocess-emb']:
      layer_norm(f'{side}_emb', '_pre')
    n_layers = config['enc-depth' if side == 'encoder' else 'dec-depth']
    for i in range(1, n_layers + 1):
      attention(f'{side}_l{i}_self')
      if side == 'decoder':
        attention(f'{side}_l{i}_context')
      if side == 'encoder':
        ffn(f'{side}_l{i}_ffn', d_ff, depth)
      else:
        ffn(f'{side}_l{i}_ffn', d_ff_dec, depth_dec)
    if 'n' in config.get('transformer-postprocess-top', ''):
      layer_norm(f'{side}_top')

  if not (config['tied-embeddings'] or config['tied-embeddings-all']):
    if legacy_output_w:
      shapes['decoder_ff_logit_out_W'] = (d, v_tgt)
    else:
      shapes['decoder_ff_logit_out_Wt'] = (v_tgt, d)
  if not config.get('output-omit-bias', False):
    shapes['decoder_ff_logit_out_b'] = (1, v_tgt)
  return shapes


def random_marian_weights(
  config: Mapping,
  *,
  seed: int,
  scale: float = 0.1,
  embedding_scale: float = 0.3,
  legacy_output_w: bool = False,
) -> dict[str, np.ndarray]:
  """float32 weights for `config`: N(0, scale²) matrices, N(0, embedding_scale²) embeddings,
  small biases, layer-norm scales 1 ± 0.05 (logits stay spread, no token dominates)."""
  rng = np.random.default_rng(seed)
  weights = {}
  for name, shape in marian_tensor_shapes(config, legacy_output_w=legacy_output_w).items():
    if name.endswith('Wemb') or name == 'decoder_ff_logit_out_Wt':
      w = rng.normal(0.0, embedding_scale, shape)
    elif '_ln_scale' in name:
      w = 1.0 + rng.normal(0.0, 0.05, shape)
    elif '_ln_bias' in name:
      w = rng.normal(0.0, 0.05, shape)
    elif name == 'decoder_ff_logit_out_b':
      w = rng.normal(0.0, 0.5, shape)
    elif re.search(r'_b([qkvo]|\d+)$', name):
      w = rng.normal(0.0, 0.02, shape)
    else:
      w = rng.normal(0.0, scale, shape)
    weights[name] = w.astype(np.float32)
  return weights


def write_random_marian_npz(
  path,
  *,
  vocab_size: int,
  d_model: int,
  d_ff: int,
  heads: int,
  encoder_layers: int,
  decoder_layers: int,
  seed: int,
  tied_embeddings: str = 'all',
  activation: str = 'swish',
  target_vocab_size: int | None = None,
  logits_bias: bool = True,
  pre_norm: bool = False,
  layernorm_embedding: bool = False,
  ffn_depth: int = 2,
  legacy_output_w: bool = False,
  pad_meta: bool = False,
  scale: float = 0.1,
  embedding_scale: float = 0.3,
  extra_config: Mapping | None = None,
) -> dict[str, np.ndarray]:
  """Writes a random Marian transformer `.npz` at `path`; returns its arrays (weights + meta).

  tied_embeddings: 'all' (one vocabulary; `Wemb` for encoder, decoder and output;
    `tied-embeddings-all: true`, the OPUS-MT default), 'target' (separate vocabularies;
    `encoder_Wemb`, `decoder_Wemb`, output = decoder_Wemb; `tied-embeddings: true`), 'src'
    (shared `Wemb` in, untied `decoder_ff_logit_out_Wt` out; `tied-embeddings-src: true`),
    'none' (`encoder_Wemb`, `decoder_Wemb`, `decoder_ff_logit_out_Wt`).
  target_vocab_size: defaults to vocab_size; may differ only for 'target' and 'none'.
  logits_bias: write `decoder_ff_logit_out_b` [1, V] (Marian's default); False sets
    `output-omit-bias: true` and writes none.
  pre_norm: `--transformer-preprocess n --transformer-postprocess da
    --transformer-postprocess-top n` (`*_ln_*_pre` names and `encoder_top`/`decoder_top`),
    the only pre-norm variant CTranslate2 accepts; default post-norm (`'' / dan / ''`).
  layernorm_embedding: `--transformer-postprocess-emb n` (`{encoder,decoder}_emb_ln_*_pre`).
  legacy_output_w: untied output as `decoder_ff_logit_out_W` [d, V] (pre-2019 Marian).
  pad_meta: NUL-pad special:model.yml to 256 bytes like Marian >= May 2025 (CTranslate2
    4.8's converter cannot read that).
  """
  config = marian_model_config(
    vocab_size=vocab_size,
    target_vocab_size=target_vocab_size,
    d_model=d_model,
    d_ff=d_ff,
    heads=heads,
    encoder_layers=encoder_layers,
    decoder_layers=decoder_layers,
    tied_embeddings=tied_embeddings,
    activation=activation,
    pre_norm=pre_norm,
    layernorm_embedding=layernorm_embedding,
    logits_bias=logits_bias,
    ffn_depth=ffn_depth,
    extra_config=extra_config,
  )
  if d_model % heads:
    raise ValueError('d_model must be divisible by heads')
  arrays = random_marian_weights(
    config,
    seed=seed,
    scale=scale,
    embedding_scale=embedding_scale,
    legacy_output_w=legacy_output_w,
  )
  arrays['special:model.yml'] = marian_meta_array(marian_yaml(config), pad_meta=pad_meta)
  np.savez(path, **arrays)  # uncompressed, like cnpy::npz_save
  return arrays


@dataclasses.dataclass(frozen=True)
class MarianFiles:
  """A model directory laid out like an OPUS-MT release."""

  directory: str
  npz: str
  vocabs: list[str]  # [source, target]; the same path twice for a shared vocabulary
  decoder_yml: str
  source_tokens: list[str]
  target_tokens: list[str]
  arrays: dict


def write_random_marian_model(
  directory, *, vocab_size: int, target_vocab_size: int | None = None, **npz_kwargs
) -> MarianFiles:
  """model.npz + vocabularies + decoder.yml (what marian-decoder and OpusMTConverter read).

  A shared vocabulary ('all', 'src') is one `vocab.yml` listed twice; separate ones ('target',
  'none') are `source.vocab.yml` (lower-case pieces) and `target.vocab.yml` (upper-case).
  """
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  tied = npz_kwargs.get('tied_embeddings', 'all')
  target_vocab_size = vocab_size if target_vocab_size is None else target_vocab_size
  npz = os.path.join(directory, 'model.npz')
  arrays = write_random_marian_npz(
    npz, vocab_size=vocab_size, target_vocab_size=target_vocab_size, **npz_kwargs
  )
  if tied in ('all', 'src'):
    source_tokens = target_tokens = make_tokens(vocab_size)
    vocabs = [write_vocab_yml(os.path.join(directory, 'vocab.yml'), source_tokens)] * 2
  else:
    source_tokens = make_tokens(vocab_size, style='lower')
    target_tokens = make_tokens(target_vocab_size, style='upper')
    vocabs = [
      write_vocab_yml(os.path.join(directory, 'source.vocab.yml'), source_tokens),
      write_vocab_yml(os.path.join(directory, 'target.vocab.yml'), target_tokens),
    ]
  decoder_yml = os.path.join(directory, 'decoder.yml')
  with open(decoder_yml, 'w', encoding='utf-8') as f:
    f.write('models:\n  - model.npz\nvocabs:\n')
    f.write(''.join(f'  - {os.path.basename(v)}\n' for v in vocabs))
    f.write('beam-size: 6\nnormalize: 1\nword-penalty: 0\nmini-batch: 16\nmaxi-batch: 100\n')
    f.write('maxi-batch-sort: src\nrelative-paths: true\n')
  return MarianFiles(
    directory, npz, list(vocabs), decoder_yml, list(source_tokens), list(target_tokens), arrays
  )
