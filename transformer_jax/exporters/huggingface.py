"""Export to the Hugging Face Hub's format: `python -m transformer_jax.export --format=huggingface
--out=DIR` writes a transformers MarianMT folder (config.json, model.safetensors, source.spm,
target.spm, vocab.json, tokenizer_config.json, generation_config.json, README.md) that
`MarianMTModel.from_pretrained(DIR)` and `MarianTokenizer.from_pretrained(DIR)` load. Neither
torch nor transformers is needed to export: the weights are written by `safetensors.numpy`.

It is the inverse of `importers.hf_marian` (import -> export -> import gives back the same
parameters; export -> import translates as the workdir). What differs silently between the
two codebases, and how each difference is bridged (huggingface_weights.py maps the tensors):

  positions     ours interleave sin/cos (PE[2i] = sin, PE[2i+1] = cos); MarianMTModel's fixed
                table is [sin | cos] halves at the same timescales 10000^(2i/d)
                (MarianSinusoidalPositionalEmbedding). Permuting the hidden units (every
                embedding column, every kernel's d_model rows or columns, the d_model biases, the
                layer norms' scales and biases) by [0, 2, 4, ... | 1, 3, 5, ...] makes ours
                theirs exactly: layer norms and the residual sums commute with a permutation, and
                nothing else reads the hidden units' order. 'concatenated' (Marian's and
                tensor2tensor's timescales 10000^(i/(d/2-1))) is no permutation of theirs:
                refused, as an odd d_model (their last feature is a sine, ours zero). An import
                from transformers is permuted the other way (importers.hf_marian), so export
                gives back its order. Learned tables (an import of an odd width, or of a
                workdir imported before that) are exported where they are MarianMTModel's
                sinusoids within 1e-6, in its order or ours; fine-tuned ones are refused, since
                MarianMTModel has no learned positions.
  layer norm    MarianMTModel's nn.LayerNorm takes torch's epsilon 1e-5 and no config field
                sets it; ours is 1e-6 by default. The export accepts the difference (below).
  embeddings    x sqrt(d_model) as ours (`scale_embedding`); one table for both sides and the
                output (share_encoder_decoder_embeddings and tie_word_embeddings) where ours
                share one over one vocabulary, else the encoder's, decoder's and output tables
                apart, nothing tied.
  attention     d_model / heads wide heads, biases on q, k, v, out: ours without
                (attention_bias=False, the paper's) get zero biases. qk_dim or v_dim other than
                d_model / heads: refused.
  FFN           biases as ours; ffn_activation relu, swish (silu), gelu (erf), gelu_sigmoid
                (x sigmoid(1.702 x): transformers' quick_gelu). Our logits_bias is
                final_logits_bias (zeros without it).
  norm order    post-LN only (MarianMTModel has no other): pre_norm refused.
  special ids   ours PAD 0, EOS 1, BOS 2, UNK 3, then the pieces; MarianMT's </s> 0, <unk> 1,
                the pieces, <pad> last, which is also the decoder's start. Every table's rows
                are taken at MarianMT's ids: our EOS, UNK, pieces 4.., and our BOS at <pad>
                (so the start embedding is BOS's). Our searches and scores never predict PAD or
                BOS nor count them in the softmax (search.candidates.mask_never_predicted);
                transformers' beam search takes its log-softmax before bad_words_ids, so it
                counts <pad>'s probability, which a trained model holds near 0. <pad>'s logit
                is BOS's for a model trained here, and PAD's for an HF import, whose PAD holds
                the checkpoint's <pad> logit and whose BOS the importer masked 30 under it (15
                under or more: huggingface_weights.pad_is_predicted), so export(import(X)) is
                X; fine-tuning moves PAD's row and bias. Where one shared
                table's PAD and BOS rows then differ, one <pad> row cannot be both: the tables
                are written apart (share_encoder_decoder_embeddings and tie_word_embeddings
                false), exact. Our other PAD row is not exported: our searches never predict
                PAD, and padding is masked in both. BOS is no prediction in MarianMT
                (bad_words_ids [[<pad>]], as Helsinki-NLP ships) nor in ours.
  vocabulary    vocab.json: our pieces at those ids; source.spm / target.spm: our SentencePiece
                models (without our MarianTokenizer-rules field). Ids a side's vocabulary
                lacks (an import's, read as <unk> on that side) are left out of its vocab.json,
                so MarianTokenizer reads them as <unk> too, and their logits (masked by the
                importer, e^-30 of the softmax) leave the softmax; where the two sides lack
                different ids, the vocabularies are separate (target_vocab.json,
                separate_vocabs).
                MarianTokenizer cuts '</s>', '<unk>', '<pad>' and a leading '>>xx<<' out of any
                text before SentencePiece, and strips decoded text: a workdir trained here
                reads such text with SentencePiece alone (an imported one as MarianTokenizer).
  decoding      generation_config.json: beam 4, early_stopping 'never' (the canonical stop,
                as ours: no beam left that could beat the k finished), bad_words_ids [[<pad>]],
                max_length max_len + 1 (the start token counts: at most max_len tokens with
                EOS, as ours) and forced_eos_token_id (EOS at that cap, as ours). Ours ranks
                beams by log P / ((5 + |y|) / 6)^alpha (GNMT, alpha 0.6), transformers by
                log P / |y|^length_penalty (|y| counting EOS in both): no length_penalty is
                ours, so the config takes LENGTH_PENALTY, the exponent whose penalty grows as
                GNMT's does (same d log / d log |y|) at REFERENCE_LENGTH tokens. With
                length_penalty=0 the two rank alike. What still differs: transformers ends a
                hypothesis only where EOS is among a step's k best candidates (ours: its 2k
                best; our beam_rule='ctranslate2' ends them as transformers), caps every
                sentence at max_length (ours also at source + 50 tokens), and scores the
                forced EOS at the cap 0 (ours: its log-prob). Measured on the default task's
                test split (tests/export_huggingface_test.py; docs/pretrained.md): greedy equal
                everywhere; beam 4 at alpha 0 against length_penalty=0 equal with
                beam_rule='ctranslate2' but where an output reaches the cap (198 of 200 on the
                suite's 150-step model, 2,000 of 2,000 on the README's), with our default
                rule 169 of 200 and 2,000 of 2,000; generation_config.json's own settings
                against our alpha 0.6, 177 of 200 and 2,000 of 2,000.

The layer-norm epsilon: the one inexactness kept. LN(x) divides by sqrt(var + eps); with
var ~ 1 the two epsilons move each normalised value by ~4.5e-6 relative. Measured (logits of
MarianMTModel against ours, teacher-forced on the test split's translations): within 2.4e-5 on
the suite's 150-step default-task model, 4.1e-5 on the README's default model (1,600 steps),
of which ours at epsilon 1e-5 leaves 7e-6 and 5e-6 (float32 rounding); greedy and beam outputs
are unchanged by it on both (200 and 2,000 test sentences). Accepted, with LOGIT_TOLERANCE
asserted by tests/export_huggingface_test.py and stated in the README, rather than refusing
every model trained here. (Scaling the residual stream by sqrt(10) would make all but each
stack's first layer norm exact; not done: the first two stay inexact whatever, since
MarianMTModel's positions cannot be scaled.) An imported model has 1e-5 already: exact.

Refused before anything is written, in one line naming the field, exit 2: the above, any
TransformerConfig field this module does not know unless at its default (`check_exportable`),
--quantization other than float32 and --dtype other than float32 (the weights are stored in
float32, as Helsinki-NLP's; transformers casts when it loads: `from_pretrained(DIR,
dtype=torch.bfloat16)`). --out as the other exports: refused if it exists, --force replaces
an earlier export (never someone's folder), written beside it and moved into place whole.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Any

import numpy as np

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.common.log import log
from transformer_jax.data.tokenizer import BOS_ID, EOS_ID, UNK_ID, Tokenizer, split_marian_rules
from transformer_jax.exporters import huggingface_weights
from transformer_jax.importers import hf_files
from transformer_jax.importers.hf_marian import LAYER_NORM_EPSILON
from transformer_jax.inference.translator import Translator
from transformer_jax.model.config import TransformerConfig, refuse_unknown_variant

# transformers' length_penalty for beam search: GNMT's ((5 + L) / 6)^alpha has the log-slope
# alpha L / (5 + L), L^p has p; equal at L = REFERENCE_LENGTH with our default alpha 0.6.
DEFAULT_ALPHA = 0.6
REFERENCE_LENGTH = 20
LENGTH_PENALTY = round(DEFAULT_ALPHA * REFERENCE_LENGTH / (5 + REFERENCE_LENGTH), 2)
NUM_BEAMS = 4
# MarianMTModel's logits against ours with our layer norm epsilon 1e-6 (its is 1e-5): measured
# 2.4e-5 and 4.1e-5 (the module docstring); tests/export_huggingface_test.py asserts it.
LOGIT_TOLERANCE = 1e-4
WEIGHTS_FILE = 'model.safetensors'
GENERATION_CONFIG = 'generation_config.json'
TOKENIZER_CONFIG = 'tokenizer_config.json'
VOCAB_FILE, TARGET_VOCAB_FILE = 'vocab.json', 'target_vocab.json'
SOURCE_SPM, TARGET_SPM = 'source.spm', 'target.spm'
README_FILE = 'README.md'
_MARIAN_SPECIALS = ('</s>', '<unk>')  # MarianMT ids 0 and 1; '<pad>' is the last.

# Our activation -> transformers' ACT2FN name (hf_marian.ACTIVATIONS the other way).
_ACTIVATIONS = {
  'relu': 'relu',
  'swish': 'swish',
  'silu': 'swish',
  'gelu': 'gelu',
  'gelu_sigmoid': 'quick_gelu',
}


def check_exportable(config: TransformerConfig) -> None:
  """A one-line UserInputError for a model MarianMTModel cannot compute as we do (the
  positions are checked with the parameters: `huggingface_weights.feature_order`)."""
  refuse_unknown_variant(config, 'the Hugging Face export')
  if config.pre_norm:
    raise UserInputError(
      'TransformerConfig.pre_norm=True: MarianMTModel has post-norm layers only '
      '(LayerNorm(x + sublayer(x)))'
    )
  width = config.d_model // config.num_heads
  for name in ('qk_dim', 'v_dim'):
    value = getattr(config, name)
    if value is not None and (value != width or config.d_model % config.num_heads):
      raise UserInputError(
        f"TransformerConfig.{name}={value}: MarianMTModel's heads are d_model / num_heads "
        f'= {config.d_model}/{config.num_heads} wide, for queries, keys and values alike'
      )
  if config.ffn_activation not in _ACTIVATIONS:
    raise UserInputError(
      f'TransformerConfig.ffn_activation={config.ffn_activation!r}: MarianMTModel has '
      f'{", ".join(_ACTIVATIONS)}'
    )


def check_options(quantization: str, dtype: str | None) -> None:
  if quantization != 'float32':
    raise UserInputError(
      f'--quantization={quantization} with --format=huggingface: the weights are stored in '
      'float32 (transformers quantises or casts when it loads the model)'
    )
  if dtype not in (None, 'float32'):
    raise UserInputError(
      f'--dtype={dtype} with --format=huggingface: the weights are stored in float32, exactly; '
      f'load them in {dtype} with MarianMTModel.from_pretrained(DIR, dtype=torch.{dtype})'
    )


# --- Vocabularies ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Vocabularies:
  """MarianMT's ids of one workdir: each side's our-id at each of its ids (<pad>, the last, is
  our BOS), its pieces (vocab.json), and the SentencePiece models."""

  source_ids: np.ndarray
  target_ids: np.ndarray
  source_pieces: list[str]
  target_pieces: list[str]
  source_spm: bytes
  target_spm: bytes

  @property
  def separate(self) -> bool:
    return not np.array_equal(self.source_ids, self.target_ids)


def _side(tokenizer: Tokenizer, vocab_size: int) -> tuple[np.ndarray, list[str], bytes]:
  spm, unknown = split_marian_rules(tokenizer.model_bytes)
  unknown = unknown or frozenset()
  pieces_ids = [i for i in range(UNK_ID + 1, vocab_size) if i not in unknown]
  pieces = [*_MARIAN_SPECIALS, *tokenizer.pieces(pieces_ids), '<pad>']
  repeated = sorted({p for p in pieces if pieces.count(p) > 1})
  if repeated:
    raise UserInputError(
      f"{tokenizer.path}: the piece {repeated[0]!r:.40} is also one of MarianTokenizer's "
      'special tokens (</s>, <unk>, <pad>)'
    )
  return np.array([EOS_ID, UNK_ID, *pieces_ids, BOS_ID], np.int64), pieces, spm


def vocabularies(translator: Translator) -> Vocabularies:
  size = translator.model_config.vocab_size
  for tokenizer in {id(t): t for t in (translator.tokenizer, translator.target_tokenizer)}.values():
    if tokenizer.vocab_size != size:
      raise UserInputError(
        f'{tokenizer.path}: vocabulary has {tokenizer.vocab_size} pieces but the model '
        f'expects {size}'
      )
  source_ids, source_pieces, source_spm = _side(translator.tokenizer, size)
  target_ids, target_pieces, target_spm = _side(translator.target_tokenizer, size)
  if not np.array_equal(source_ids, target_ids):
    _place_target_specials(translator, source_ids, target_ids, target_pieces)
  return Vocabularies(source_ids, target_ids, source_pieces, target_pieces, source_spm, target_spm)


def _place_target_specials(translator, source_ids, target_ids, target_pieces) -> None:
  """Separate vocabularies: MarianTokenizer reads an added token of a target text (a tag) at
  its vocab.json id, in target_vocab.json (hf_vocabulary._side_specials); so the target piece
  each such token is ours is moved, in place, to that id of the target side, swapping it with
  the piece there, so that MarianTokenizer reads it as our target tokenizer does. Not done for
  <pad>, which it reads the same way (vocab.json's last id, some target piece): a literal <pad>
  in a target text means nothing, and the target side's order stays the import's, so import ->
  export -> import gives the same parameters."""
  target_record = translator.target_tokenizer.marian_record()
  if target_record is None:
    return
  for hf_id, token in (
    (int(j), e['content']) for j, e in added_tokens(translator.tokenizer, source_ids).items()
  ):
    ours = target_record['specials'].get(token)
    at = np.flatnonzero(target_ids[:-1] == ours)
    if ours is None or not 1 < hf_id < len(target_ids) - 1 or len(at) != 1 or at[0] <= 1:
      continue  # An id the target side lacks, or EOS/UNK: nothing to place.
    j = int(at[0])
    target_ids[[hf_id, j]] = target_ids[[j, hf_id]]
    target_pieces[hf_id], target_pieces[j] = target_pieces[j], target_pieces[hf_id]


# --- The folder's JSON files -------------------------------------------------------------------


def hf_config(config: TransformerConfig, vocabs: Vocabularies, one_table: bool) -> dict[str, Any]:
  """config.json: MarianConfig's fields (dropouts ours, for fine-tuning in transformers)."""
  source_size, target_size = len(vocabs.source_ids), len(vocabs.target_ids)
  return {
    'architectures': ['MarianMTModel'],
    'model_type': 'marian',
    'vocab_size': source_size,
    'decoder_vocab_size': target_size,
    'd_model': config.d_model,
    'encoder_layers': config.num_encoder_layers,
    'decoder_layers': config.num_decoder_layers,
    'encoder_attention_heads': config.num_heads,
    'decoder_attention_heads': config.num_heads,
    'encoder_ffn_dim': config.d_ff,
    'decoder_ffn_dim': config.d_ff,
    'activation_function': _ACTIVATIONS[config.ffn_activation],
    'max_position_embeddings': config.max_len,
    'scale_embedding': True,
    'share_encoder_decoder_embeddings': one_table,
    'tie_word_embeddings': one_table,
    'static_position_embeddings': True,
    'normalize_before': False,
    'normalize_embedding': False,
    'add_final_layer_norm': False,
    'dropout': config.dropout_rate,
    'attention_dropout': config.attention_dropout_rate,
    'activation_dropout': 0.0,
    'encoder_layerdrop': 0.0,
    'decoder_layerdrop': 0.0,
    'init_std': 0.02,
    'is_encoder_decoder': True,
    'use_cache': True,
    'eos_token_id': 0,
    'forced_eos_token_id': 0,
    'pad_token_id': source_size - 1,
    'decoder_start_token_id': target_size - 1,
    'bos_token_id': None,
    'dtype': 'float32',
  }


def generation_config(config: TransformerConfig, vocabs: Vocabularies) -> dict[str, Any]:
  """generation_config.json (the module docstring's decoding)."""
  pad = len(vocabs.target_ids) - 1
  return {
    'num_beams': NUM_BEAMS,
    'length_penalty': LENGTH_PENALTY,
    'early_stopping': 'never',
    'max_length': config.max_len + 1,
    'bad_words_ids': [[pad]],
    'bos_token_id': None,
    'decoder_start_token_id': pad,
    'eos_token_id': 0,
    'forced_eos_token_id': 0,
    'pad_token_id': pad,
  }


def added_tokens(tokenizer: Tokenizer, source_ids: np.ndarray) -> dict[str, dict[str, Any]]:
  """tokenizer_config.json's added_tokens_decoder: the special tokens an import's tokenizer cuts
  out of texts beyond MarianTokenizer's three (hf_vocabulary.special_tokens: from its
  tokenizer files), each at the MarianMT id of the our-id it reads as, so MarianTokenizer cuts
  it out as the same token. One that reads as no source piece (<unk>) is left to SentencePiece.
  A workdir trained here has none."""
  record = tokenizer.marian_record()
  if record is None:
    return {}
  hf_id = {int(ours): j for j, ours in enumerate(source_ids[:-1])}
  out = {}
  for token, ours in sorted(record['specials'].items(), key=lambda item: item[1]):
    if token in _MARIAN_SPECIALS or token == '<pad>' or hf_id.get(ours, UNK_ID) == UNK_ID:
      continue
    out[str(hf_id[ours])] = {
      'content': token,
      'lstrip': False,
      'normalized': False,
      'rstrip': False,
      'single_word': False,
      'special': True,
    }
  return out


def tokenizer_config(
  config: TransformerConfig, vocabs: Vocabularies, tokenizer: Tokenizer
) -> dict[str, Any]:
  settings = {
    'tokenizer_class': 'MarianTokenizer',
    'model_max_length': config.max_len,
    'separate_vocabs': vocabs.separate,
    'eos_token': '</s>',
    'unk_token': '<unk>',
    'pad_token': '<pad>',
    'clean_up_tokenization_spaces': False,
  }
  added = added_tokens(tokenizer, vocabs.source_ids)
  if added:
    settings['added_tokens_decoder'] = added
  return settings


_README = """\
# {name}: a transformer_jax model as a transformers MarianMT model

Exported by `python -m transformer_jax.export --format=huggingface` from `{workdir}`
(checkpoint: {checkpoint}). With `pip install transformers torch sentencepiece`:

```python
from transformers import MarianMTModel, MarianTokenizer
tokenizer = MarianTokenizer.from_pretrained('{out}')
model = MarianMTModel.from_pretrained('{out}')
batch = tokenizer(['{example}'], return_tensors='pt', padding=True, truncation=True)
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))
```

`AutoTokenizer` and `AutoModelForSeq2SeqLM` load it too (transformers 5 has no translation
pipeline any more; transformers 4's `pipeline('translation')` was not tried). `generate`
defaults to generation_config.json: beam 4, length_penalty {length_penalty} (transformers
divides log P by |y| ** length_penalty, transformer_jax by ((5 + |y|) / 6) ** 0.6: a few
translations differ), at most {max_len} tokens. `num_beams=1` is transformer_jax's greedy
search, and `length_penalty=0` its `--alpha=0 --beam_rule=ctranslate2` (transformers ends a
hypothesis only where EOS is among a step's 4 best candidates, as that rule does). Keep
`truncation=True`: the model has {max_len} positions. The layer norms compute with
transformers' epsilon 1e-5; the model's own is {epsilon:g}{epsilon_note}. `{marker}` marks
the folder as an export that `--force` may replace; it is not part of the model.
"""


def readme(config: TransformerConfig, out_dir: str, workdir: str, checkpoint, example: str) -> str:
  epsilon = config.layer_norm_epsilon
  exact = epsilon == LAYER_NORM_EPSILON
  return _README.format(
    name=os.path.basename(out_dir),
    workdir=workdir,
    checkpoint=checkpoint or 'the default, averaged if current, else latest',
    out=out_dir,
    example=example,
    length_penalty=LENGTH_PENALTY,
    max_len=config.max_len,
    epsilon=epsilon,
    epsilon_note=' (exact)' if exact else f' (its logits move by less than {LOGIT_TOLERANCE:g})',
    marker=paths.EXPORT_MARKER,
  )


# --- The command -------------------------------------------------------------------------------


def _safetensors_writer():
  """safetensors.numpy.save_file, or a one-line UserInputError saying how to install it."""
  try:
    from safetensors.numpy import save_file
  except ImportError:
    raise UserInputError(
      "--format=huggingface needs the safetensors package: pip install -e '.[export]'"
    ) from None
  return save_file


def _write_json(folder: str, name: str, value: Any) -> None:
  with open(os.path.join(folder, name), 'w', encoding='utf-8') as f:
    json.dump(value, f, indent=2, ensure_ascii=False)
    f.write('\n')


def folder_contents(translator: Translator) -> dict[str, Any]:
  """name -> JSON value, bytes or arrays (WEIGHTS_FILE) of the MarianMT folder."""
  config = translator.model_config
  check_exportable(config)
  order = huggingface_weights.feature_order(config, translator.params)
  vocabs = vocabularies(translator)
  one_table = huggingface_weights.one_table(config, translator.params, vocabs.separate)
  files: dict[str, Any] = {
    WEIGHTS_FILE: huggingface_weights.tensors(
      config, translator.params, vocabs.source_ids, vocabs.target_ids, order, one_table
    ),
    hf_files.HF_CONFIG: hf_config(config, vocabs, one_table),
    GENERATION_CONFIG: generation_config(config, vocabs),
    TOKENIZER_CONFIG: tokenizer_config(config, vocabs, translator.tokenizer),
    VOCAB_FILE: {piece: i for i, piece in enumerate(vocabs.source_pieces)},
    SOURCE_SPM: vocabs.source_spm,
    TARGET_SPM: vocabs.target_spm,
  }
  if vocabs.separate:
    files[TARGET_VOCAB_FILE] = {piece: i for i, piece in enumerate(vocabs.target_pieces)}
  return files


def export(
  workdir: str,
  out_dir: str,
  *,
  quantization: str = 'float32',
  dtype: str | None = None,
  checkpoint: int | str | None = None,
  force: bool = False,
  example: str = 'three hundred forty-two',
) -> str:
  """Writes the workdir's model to `out_dir` as a transformers MarianMT folder; returns it.

  checkpoint as `translate`'s --checkpoint (None: averaged if current, else latest). Every
  check runs before anything is written; the folder is written beside `out_dir` and moved
  into place complete; an existing `out_dir` is refused unless `force` (then replaced).
  """
  check_options(quantization, dtype)
  save_file = _safetensors_writer()
  if paths.is_gcs(out_dir):
    raise UserInputError(
      f'--out={out_dir}: transformers loads local folders; export here, then upload it '
      '(huggingface_hub.upload_folder)'
    )
  out_dir = os.path.abspath(out_dir)
  # Never a workdir, a folder holding one or someone's files, even with --force.
  paths.check_replaceable_folder(out_dir, '--out', force)
  paths.check_outputs_apart({'--out': out_dir}, runs={'--workdir': workdir})
  translator = Translator.from_checkpoint(workdir, checkpoint, batch_size=1)
  files = folder_contents(translator)
  files[README_FILE] = readme(translator.model_config, out_dir, workdir, checkpoint, example)

  with paths.staged_folder(out_dir) as staging:
    paths.mark_export_folder(staging)
    for name, value in files.items():
      path = os.path.join(staging, name)
      if name == WEIGHTS_FILE:
        save_file(value, path, metadata={'format': 'pt'})  # transformers reads 'pt' ones.
        # safetensors creates it 0600: readable as the folder's other files are.
        os.chmod(path, stat.S_IMODE(os.stat(os.path.join(staging, paths.EXPORT_MARKER)).st_mode))
      elif isinstance(value, bytes):
        with open(path, 'wb') as f:
          f.write(value)
      elif isinstance(value, str):
        with open(path, 'w', encoding='utf-8') as f:
          f.write(value)
      else:
        _write_json(staging, name, value)
  log(f'transformers MarianMT model written to {out_dir}')
  return out_dir
