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
import math
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


# ---------------------------------------------------------------------------------------------
# Marian's forward pass, in NumPy


def marian_sinusoids(num_positions: int, dim: int, start: int = 0) -> np.ndarray:
  """Marian's position table [num_positions, dim]: [sin | cos] halves, position p = start + row,
  frequency of column i (mod dim/2) = 10000^(-i / (dim/2 - 1))  (tensors/cpu/
  tensor_operators.cpp SinusoidalPositionEmbeddings)."""
  half = dim // 2
  increment = math.log(10000.0) / (half - 1)
  freqs = np.exp(-increment * np.arange(half, dtype=np.float64))
  angles = (start + np.arange(num_positions, dtype=np.float64))[:, None] * freqs[None, :]
  return np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)


def ctranslate2_marian_sinusoids(num_positions: int, dim: int) -> np.ndarray:
  """The table CTranslate2's MarianConverter stores instead (frequency 10000^(-2i/dim), the
  Hugging Face MarianMT formula; converters/marian.py _make_sinusoidal_position_encodings)."""
  positions = np.arange(num_positions)
  timescales = np.power(10000, 2 * (np.arange(dim) // 2) / dim)
  enc = positions[:, None] / timescales[None, :]
  table = np.zeros_like(enc)
  table[:, : dim // 2] = np.sin(enc[:, 0::2])
  table[:, dim // 2 :] = np.cos(enc[:, 1::2])
  return table.astype(np.float32)


def _activation(name):
  sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
  if name == 'swish':
    return lambda x: x * sigmoid(x)
  if name == 'relu':
    return lambda x: np.maximum(x, 0.0)
  if name == 'gelu':  # Marian before 2023-03 (and CTranslate2's GELUSigmoid); later: erf GELU
    return lambda x: x * sigmoid(1.702 * x)
  raise ValueError(f'unsupported activation {name!r}')


def marian_reference_logits(
  arrays: Mapping[str, np.ndarray],
  source_ids: Sequence[int],
  target_ids: Sequence[int],
  *,
  config: Mapping | None = None,
  eps: float = LAYER_NORM_EPS,
  position_table=marian_sinusoids,
) -> np.ndarray:
  """Teacher-forced logits [len(target_ids) + 1, V] of one sentence, as Marian computes them.

  source_ids must already end with </s> (0): Marian appends it to every source sentence.
  Decoder inputs are [zero vector, emb(t_0), ..., emb(t_{n-1})]; row j predicts t_j (row n:
  </s>). Pass position_table=lambda n, d: ctranslate2_marian_sinusoids(n, d) and eps=1e-5 to
  reproduce what a stock CTranslate2 conversion computes.
  """
  if config is None:
    config = read_marian_config(arrays)
  w = {k: np.asarray(v, np.float64) for k, v in arrays.items() if k != 'special:model.yml'}
  d = config['dim-emb']
  heads = config['transformer-heads']
  pre = 'n' in config['transformer-preprocess']
  emb_norm = 'n' in config['transformer-postprocess-emb']
  act = _activation(config['transformer-ffn-activation'])
  if config.get('transformer-decoder-autoreg', 'self-attention') != 'self-attention':
    raise NotImplementedError('only transformer-decoder-autoreg: self-attention')

  def ln(x, name, suffix=''):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w[f'{name}_ln_scale{suffix}'] + w[
      f'{name}_ln_bias{suffix}'
    ]

  def mha(prefix, q_in, kv_in, causal):
    q = q_in @ w[f'{prefix}_Wq'] + w[f'{prefix}_bq']
    k = kv_in @ w[f'{prefix}_Wk'] + w[f'{prefix}_bk']
    v = kv_in @ w[f'{prefix}_Wv'] + w[f'{prefix}_bv']
    dk = d // heads
    split = lambda x: x.reshape(x.shape[0], heads, dk).transpose(1, 0, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    z = q @ k.transpose(0, 2, 1) / math.sqrt(dk)
    if causal:
      z = z + np.triu(np.full(z.shape[-2:], -1e9), 1)
    z = np.exp(z - z.max(-1, keepdims=True))
    z /= z.sum(-1, keepdims=True)
    out = (z @ v).transpose(1, 0, 2).reshape(q_in.shape[0], d)
    return out @ w[f'{prefix}_Wo'] + w[f'{prefix}_bo']

  def block(ln_name, x, fn):
    if pre:  # preprocess n, postprocess da
      return x + fn(ln(x, ln_name, '_pre'))
    return ln(x + fn(x), ln_name)  # preprocess '', postprocess dan

  def ffn(prefix, x):
    i = 1
    while f'{prefix}_W{i + 1}' in w:
      x = act(x @ w[f'{prefix}_W{i}'] + w[f'{prefix}_b{i}'])
      i += 1
    return x @ w[f'{prefix}_W{i}'] + w[f'{prefix}_b{i}']

  src_emb = w.get('encoder_Wemb', w.get('Wemb'))
  tgt_emb = w.get('decoder_Wemb', w.get('Wemb'))

  # Encoder: sqrt(d) * emb + sinusoid(positions 0..S-1).
  x = math.sqrt(d) * src_emb[np.asarray(source_ids)]
  x = x + position_table(len(source_ids), d)
  if emb_norm:
    x = ln(x, 'encoder_emb', '_pre')
  for i in range(1, config['enc-depth'] + 1):
    p = f'encoder_l{i}'
    x = block(f'{p}_self_Wo', x, lambda h, p=p: mha(f'{p}_self', h, h, causal=False))
    x = block(f'{p}_ffn_ffn', x, lambda h, p=p: ffn(f'{p}_ffn', h))
  if 'n' in config.get('transformer-postprocess-top', ''):
    x = ln(x, 'encoder_top')
  memory = x

  # Decoder: position 0 is an all-zero embedding (no BOS token), then sqrt(d) * emb(t_j).
  y = np.concatenate([np.zeros((1, d)), math.sqrt(d) * tgt_emb[np.asarray(target_ids, int)]])
  y = y + position_table(len(y), d)
  if emb_norm:
    y = ln(y, 'decoder_emb', '_pre')
  for i in range(1, config['dec-depth'] + 1):
    p = f'decoder_l{i}'
    y = block(f'{p}_self_Wo', y, lambda h, p=p: mha(f'{p}_self', h, h, causal=True))
    # Pre-norm: only the query is normalised; the encoder output goes in as it is.
    y = block(f'{p}_context_Wo', y, lambda h, p=p: mha(f'{p}_context', h, memory, False))
    y = block(f'{p}_ffn_ffn', y, lambda h, p=p: ffn(f'{p}_ffn', h))
  if 'n' in config.get('transformer-postprocess-top', ''):
    y = ln(y, 'decoder_top')

  if 'decoder_ff_logit_out_Wt' in w:
    logits = y @ w['decoder_ff_logit_out_Wt'].T
  elif 'decoder_ff_logit_out_W' in w:
    logits = y @ w['decoder_ff_logit_out_W']
  else:
    logits = y @ tgt_emb.T
  if 'decoder_ff_logit_out_b' in w:
    logits = logits + w['decoder_ff_logit_out_b']
  return logits.astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# Our model -> Marian: the inverse of transformer_jax.marian.import_marian

# The version strings written for our ffn_activation (Marian's 'gelu' changed meaning in v1.12.3).
_MARIAN_ACTIVATIONS = {
  'swish': ('swish', MARIAN_VERSION),
  'silu': ('swish', MARIAN_VERSION),
  'relu': ('relu', MARIAN_VERSION),
  'gelu_sigmoid': ('gelu', MARIAN_VERSION),  # v1.11: x * sigmoid(1.702 x)
  'gelu': ('gelu', 'v1.12.14 2d067afb 2024-02-16 11:44:13 -0500'),  # erf
}
# TransformerConfig fields a Marian transformer has these values of (marian._MARIAN).
_MARIAN_FIELDS = dict(
  attention_bias=True,
  logits_bias=True,
  sinusoid_layout='concatenated',
  learned_positions=False,
  layer_norm_epsilon=LAYER_NORM_EPS,
  qk_dim=None,
  v_dim=None,
)


def marian_arrays_from_params(
  params: Mapping, model_config, *, allow_nonzero_bos: bool = False
) -> dict[str, np.ndarray]:
  """Our parameters as the tensors Marian saves, with `special:model.yml`: exactly what
  `transformer_jax.marian.import_marian` maps back (its `map_params`, inverted row by row).

  params: our tree (numpy or JAX arrays, float32), that of `Transformer(model_config)`; layer
    stacks have a leading layer axis. model_config: a `TransformerConfig` with Marian's
    switches (attention_bias, logits_bias, sinusoid_layout='concatenated', no learned
    positions, layer_norm_epsilon 1e-6, no qk_dim / v_dim); post- or pre-norm; any
    FFN_ACTIVATIONS; shared embeddings (`Wemb`, `tied-embeddings-all`) or not (`encoder_Wemb`,
    `decoder_Wemb`, `decoder_ff_logit_out_Wt`, no tying).

  Shapes (d = d_model, f = d_ff, h = heads, dk = d / h, V = vocab_size, Vm = V - 2):
    ours  {encoder,decoder}_layers/*_attention/{query,key,value}/kernel [L, d, h, dk] -> Marian
          {side}_l{i}_{self,context}_W{q,k,v} [d, d] (head j = columns j*dk:(j+1)*dk);
          .../bias [L, h, dk] -> _b{q,k,v} [1, d]; out/kernel [L, h, dk, d] -> _Wo [d, d];
          out/bias [L, d] -> _bo [1, d]; ffn/wi [L, d, f] + [L, f] -> ffn_W1 [d, f], ffn_b1
          [1, f]; ffn/wo [L, f, d] + [L, d] -> ffn_W2, ffn_b2; each block's norm [L, d] ->
          `{prefix}_ln_{scale,bias}` [1, d] (`_pre` suffix if pre-norm); pre-norm's
          {encoder,decoder}_norm [d] -> {side}_top_ln_* [1, d].
    vocab shared_embedding [V, d] -> Wemb [Vm, d] (or source/target_embedding [V, d] ->
          encoder_Wemb / decoder_Wemb, output_projection/kernel [d, V] ->
          decoder_ff_logit_out_Wt [Vm, d]); logits_bias [V] -> decoder_ff_logit_out_b [1, Vm].
          Marian row k is our row `marian.our_ids(Vm)[k]`: 0 (</s>) = our EOS 1, 1 (<unk>) = our
          UNK 3, k >= 2 = our k + 2.

  Marian has no PAD and no BOS, so their rows and logit biases are dropped; importing gives
  them zero rows and bias `marian.MASKED_LOGIT_BIAS`. The PAD row is never a real input (padded
  keys are masked, padded queries unused), so only the PAD logit changes. The BOS row is our
  decoder's first input, where Marian feeds a zero vector: a non-zero BOS row would change every
  translation, so it is refused unless `allow_nonzero_bos` (then the model written is another).
  """
  from transformer_jax import marian
  from transformer_jax.data.tokenizer import BOS_ID

  for name, value in _MARIAN_FIELDS.items():
    if name == 'logits_bias':
      continue  # False is written as output-omit-bias: true.
    if getattr(model_config, name) != value:
      raise ValueError(
        f'Marian has {name}={value!r}; this model has {getattr(model_config, name)!r}'
      )
  if model_config.ffn_activation not in _MARIAN_ACTIVATIONS:
    raise ValueError(f'no Marian FFN activation for {model_config.ffn_activation!r}')
  activation, version = _MARIAN_ACTIVATIONS[model_config.ffn_activation]
  params = _numpy_tree(params)
  shared = model_config.share_embeddings
  layout = {
    'd_model': model_config.d_model,
    'd_ff': model_config.d_ff,
    'num_heads': model_config.num_heads,
    'num_encoder_layers': model_config.num_encoder_layers,
    'num_decoder_layers': model_config.num_decoder_layers,
    'pre_norm': model_config.pre_norm,
  }
  arrays: dict[str, np.ndarray] = {}
  for side, rows in marian._layer_tensors(layout).items():  # (name, our path, Marian shape, ours)
    stack = params[f'{side}_layers']
    for name, path, marian_shape, _ in rows:
      node = stack
      for key in path:
        node = node[key]
      for i in range(1, layout[f'num_{side}_layers'] + 1):
        arrays[f'{side}_l{i}_{name}'] = node[i - 1].reshape(marian_shape)
    if model_config.pre_norm:
      for key in ('scale', 'bias'):
        arrays[f'{side}_top_ln_{key}'] = params[f'{side}_norm'][key][None]

  vocab_size = model_config.vocab_size
  rows = marian.our_ids(vocab_size - 2)  # Our row of each Marian id.
  bos_rows = []
  if shared:
    table = params['shared_embedding']['embedding']
    arrays['Wemb'] = table[rows]
    bos_rows.append(table[BOS_ID])
  else:
    source = params['source_embedding']['embedding']
    target = params['target_embedding']['embedding']
    arrays['encoder_Wemb'], arrays['decoder_Wemb'] = source[rows], target[rows]
    arrays['decoder_ff_logit_out_Wt'] = params['output_projection']['kernel'].T[rows]
    bos_rows.append(target[BOS_ID])
  if not allow_nonzero_bos and any(np.any(row) for row in bos_rows):
    raise ValueError(
      'the BOS embedding row is not zero: Marian starts decoding from a zero vector, so this '
      'model is not representable (allow_nonzero_bos=True writes it with a zero start)'
    )
  if model_config.logits_bias:
    arrays['decoder_ff_logit_out_b'] = params['logits_bias'][rows][None]
  config = marian_model_config(
    vocab_size=vocab_size - 2,
    d_model=model_config.d_model,
    d_ff=model_config.d_ff,
    heads=model_config.num_heads,
    encoder_layers=model_config.num_encoder_layers,
    decoder_layers=model_config.num_decoder_layers,
    tied_embeddings='all' if shared else 'none',
    activation=activation,
    pre_norm=model_config.pre_norm,
    logits_bias=model_config.logits_bias,
    extra_config={'version': version},
  )
  arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}
  expected = marian_tensor_shapes(config)
  got = {k: v.shape for k, v in arrays.items()}
  if got != expected:  # A guard on this function: Marian's names and shapes, independently.
    raise AssertionError(f'written {sorted(got.items())}, Marian has {sorted(expected.items())}')
  arrays['special:model.yml'] = marian_meta_array(marian_yaml(config))
  return arrays


def _numpy_tree(tree):
  if isinstance(tree, Mapping):
    return {k: _numpy_tree(v) for k, v in tree.items()}
  return np.asarray(tree, dtype=np.float32)


def marian_vocabulary_from_ours(vocabulary: bytes) -> tuple[list[str], bytes]:
  """(Marian's pieces by id, a `.spm` with those ids) of our SentencePiece model (pad 0, eos 1,
  bos 2, unk 3): `</s>`=0, `<unk>`=1, then our pieces 4.. as Marian ids 2.. (`marian.our_ids`),
  bos and pad off, as Marian trains one (`train_sentencepiece`). Normaliser, model type, scores
  and piece types are ours, so it segments text into the same pieces."""
  from sentencepiece import sentencepiece_model_pb2

  ours = sentencepiece_model_pb2.ModelProto.FromString(vocabulary)
  reserved = [p.piece for p in ours.pieces[:4]]
  if reserved != ['<pad>', EOS, '<s>', UNK]:
    raise ValueError(f'expected our reserved pieces <pad>, </s>, <s>, <unk>, got {reserved}')
  Piece = sentencepiece_model_pb2.ModelProto.SentencePiece
  proto = sentencepiece_model_pb2.ModelProto()
  for field in ('trainer_spec', 'normalizer_spec', 'denormalizer_spec'):
    if ours.HasField(field):
      getattr(proto, field).CopyFrom(getattr(ours, field))
  proto.pieces.add(piece=EOS, score=0.0, type=Piece.CONTROL)
  proto.pieces.add(piece=UNK, score=0.0, type=Piece.UNKNOWN)
  for piece in ours.pieces[4:]:
    proto.pieces.add().CopyFrom(piece)
  spec = proto.trainer_spec
  spec.vocab_size = len(proto.pieces)
  spec.eos_id, spec.unk_id, spec.bos_id, spec.pad_id = EOS_ID, UNK_ID, -1, -1
  spec.eos_piece, spec.unk_piece = EOS, UNK
  return [p.piece for p in proto.pieces], proto.SerializeToString()


@dataclasses.dataclass(frozen=True)
class MarianExport:
  """A folder written by `write_marian_model_from_params`, laid out as OPUS-MT releases are."""

  directory: str
  npz: str
  vocab: str  # The vocab .yml, listed twice in decoder.yml (one shared vocabulary).
  source_spm: str
  target_spm: str
  decoder_yml: str
  pieces: list[str]  # Marian's, by id
  arrays: dict

  @property
  def vocabs(self) -> list[str]:  # As MarianFiles.vocabs (marian_npz_check.convert).
    return [self.vocab, self.vocab]


def write_marian_model_from_params(
  directory,
  params: Mapping,
  model_config,
  vocabulary: bytes,
  *,
  name: str = 'opus',
  allow_nonzero_bos: bool = False,
) -> MarianExport:
  """Writes our model as an OPUS-MT folder: `{name}.model1.npz` (`marian_arrays_from_params`),
  `{name}.vocab.yml` and `source.spm` (`marian_vocabulary_from_ours`; `target.spm` a copy, one
  shared vocabulary), `decoder.yml` (OPUS-MT's settings). vocabulary: our SentencePiece model's
  bytes (a workdir's vocab.model). `python -m transformer_jax.import_marian --model=DIRECTORY`
  reads it back."""
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  arrays = marian_arrays_from_params(params, model_config, allow_nonzero_bos=allow_nonzero_bos)
  pieces, spm = marian_vocabulary_from_ours(vocabulary)
  if len(pieces) != model_config.vocab_size - 2:
    raise ValueError(
      f'{len(pieces) + 2} vocabulary pieces, the model has {model_config.vocab_size}'
    )
  npz = os.path.join(directory, f'{name}.model1.npz')
  np.savez(npz, **arrays)  # Uncompressed, like cnpy::npz_save.
  vocab = write_vocab_yml(os.path.join(directory, f'{name}.vocab.yml'), pieces)
  spms = [os.path.join(directory, f'{side}.spm') for side in ('source', 'target')]
  for path in spms:
    with open(path, 'wb') as f:
      f.write(spm)
  decoder_yml = os.path.join(directory, 'decoder.yml')
  with open(decoder_yml, 'w', encoding='utf-8') as f:
    f.write(f'models:\n  - {os.path.basename(npz)}\nvocabs:\n')
    f.write(f'  - {os.path.basename(vocab)}\n' * 2)
    f.write('beam-size: 6\nnormalize: 0.6\nword-penalty: 0\nmini-batch: 16\nmaxi-batch: 100\n')
    f.write('maxi-batch-sort: src\nrelative-paths: true\n')
  return MarianExport(directory, npz, vocab, spms[0], spms[1], decoder_yml, pieces, arrays)


def write_marian_model_from_workdir(directory, workdir: str, checkpoint=None, **kwargs):
  """`write_marian_model_from_params` of a trained workdir's parameters (`checkpoint` as
  `inference.Translator.from_checkpoint`: default the averaged if current, else the latest)."""
  from transformer_jax import inference

  translator = inference.Translator.from_checkpoint(workdir, checkpoint)
  return write_marian_model_from_params(
    directory,
    translator.params,
    translator.model_config,
    translator.tokenizer.model_bytes,
    **kwargs,
  )
