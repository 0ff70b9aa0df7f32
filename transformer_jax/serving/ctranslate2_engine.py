"""The translation server's CTranslate2 engine (`python -m transformer_jax.serve
--engine=ctranslate2`): the workdir's model exported at start-up, kept, and reused.

The export (`ctranslate2_spec.model_spec`, quantised to --quantization) goes to
--ctranslate2_dir, by default `Workdir.ctranslate2_export` inside the workdir, with a record of
what it was made from (`SOURCE_FILE`): a SHA-256 over the parameters the checkpoint restores to,
the model config, the vocabulary, the weight type, the ctranslate2 version and the exporter's
own code. The server restores the checkpoint it would serve (as --engine=jax, --checkpoint
chosen the same way), hashes it, and loads the folder as it is when the record matches; any
difference (a newer checkpoint, another --quantization, another ctranslate2) exports again,
into a hidden sibling folder renamed into place, so the folder is always whole. A folder that
holds files but no record (not written by the server) is refused rather than replaced.

Decoding is `ctranslate2_runtime.hypotheses` (GNMT ranking of CTranslate2's n-best, as ours):
with float32 weights the server's translations are the jax engine's. n-best lists, scores,
target prefixes and sampling (temperature, top-k, top-p) are CTranslate2's own; MBR is ours
(`inference.mbr` over CTranslate2's candidates). Sampling is unseeded: CTranslate2 (4.8.5)
seeds its worker threads' generators once, when the model is loaded, and
`ctranslate2.set_random_seed` later changes none of their draws (two calls after the same
seed draw differently), so a request that gives a "seed" is refused (`app.check_seed`) rather than
answered with draws the seed does not determine. CTranslate2 compiles nothing; one worker
thread (the batcher's) calls it, with `intra_threads` OpenMP threads (`DEFAULT_THREADS`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import time
from typing import Sequence

import jax
import numpy as np
from absl import logging

from transformer_jax.common import paths
from transformer_jax.common.errors import UserInputError
from transformer_jax.exporters import ctranslate2_runtime, ctranslate2_spec
from transformer_jax.inference import batches
from transformer_jax.inference.options import DecodingOptions, Hypothesis
from transformer_jax.inference.translator import Translator
from transformer_jax.serving.batcher import Engine
from transformer_jax.serving.decoding_modes import Served
from transformer_jax.workdir.layout import Workdir, check_folder_writable

# The weight type users deploy: ~2.3x float32's speed on this CPU (issue 17), and >= 98% exact
# match on the number-words task (tests/export_test.py). float32 translates exactly as ours.
DEFAULT_QUANTIZATION = 'int8'
# OpenMP threads of the one Translator. More decode faster only on cores nothing else uses: on
# the shared 2-core CPU (load average 3-5 from other jobs), 2 threads decoded beam 4 at 5-40
# sentences/s against 90-107 for 1 (GNU OpenMP, OMP_WAIT_POLICY active or passive; bench/README.md).
DEFAULT_THREADS = 1
# What the export was made from, written last into the export folder.
SOURCE_FILE = 'transformer_jax_source.json'


def require():
  """The ctranslate2 module, or a one-line UserInputError saying how to install it."""
  return ctranslate2_runtime.import_ctranslate2('--engine=ctranslate2')


def check_dtype(dtype: str | None, quantization: str | None) -> None:
  """--dtype with this engine: refused, in one line, unless it is what CTranslate2 computes in
  (float32 weights), before anything is exported. Not mapped to a compute_type: this engine
  runs on the CPU, where CTranslate2 4.8.5 computes in int8, int8_float32, float32 and, on an
  Intel CPU (MKL), int16 only (`get_supported_compute_types('cpu')`); asked for bfloat16 or
  float16 there it refuses to load the model (a ValueError: the backend does not support
  efficient bfloat16 computation). Its precision is --quantization's."""
  quantization = quantization or DEFAULT_QUANTIZATION
  if dtype is None or (dtype == 'float32' and quantization == 'float32'):
    return
  supported = ', '.join(sorted(require().get_supported_compute_types('cpu')))
  raise UserInputError(
    f'--dtype={dtype} is for --engine=jax: CTranslate2 computes in its --quantization type '
    f'({quantization}; on the CPU it has {supported})'
  )


def source_digest(translator: Translator, quantization: str, ctranslate2_version: str) -> str:
  """SHA-256 of everything the export is a function of (see the module docstring)."""
  digest = hashlib.sha256()
  exporter = importlib.util.find_spec(ctranslate2_spec.__name__).origin
  with open(exporter, 'rb') as f:
    digest.update(f.read())
  header = {
    'model': translator.model_config.to_dict(),
    'vocabulary': translator.tokenizer.fingerprint,
    'target_vocabulary': translator.target_tokenizer.fingerprint,
    'quantization': quantization,
    'ctranslate2': ctranslate2_version,
  }
  digest.update(json.dumps(header, sort_keys=True, default=str).encode())
  for path, leaf in jax.tree_util.tree_flatten_with_path(translator.params)[0]:
    array = np.ascontiguousarray(jax.device_get(leaf))
    digest.update(f'{jax.tree_util.keystr(path)} {array.dtype} {array.shape}'.encode())
    digest.update(array.data)
  return digest.hexdigest()


def read_source(directory: str) -> dict | None:
  """The record of a server-written export folder, None when there is none (or unreadable)."""
  try:
    with open(os.path.join(directory, SOURCE_FILE), encoding='utf-8') as f:
      record = json.load(f)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def prepare(
  workdir: str,
  checkpoint: int | str | None,
  quantization: str,
  directory: str | None = None,
) -> tuple[str, Translator, bool]:
  """Exports the checkpoint to `directory` unless it holds that export already.

  Returns (the folder, the restored `Translator`, whether the folder was reused).
  """
  ctranslate2 = require()
  ctranslate2_spec.check_quantization(quantization)
  flag = '--ctranslate2_dir'  # Named in errors about the default folder too: it overrides it.
  if directory is None:
    if Workdir(workdir).is_remote:
      raise UserInputError(
        f'--workdir={workdir}: CTranslate2 reads local folders only; give --ctranslate2_dir'
      )
    directory = os.fspath(Workdir(workdir).ctranslate2_export)
  elif paths.is_gcs(directory):
    raise UserInputError(f'--ctranslate2_dir={directory}: CTranslate2 reads local folders only')
  directory = os.path.abspath(directory)
  paths.check_outputs_apart(
    {flag: directory},
    runs={'--workdir': workdir},
    run_outputs=(Workdir(workdir).ctranslate2_export,),
  )
  record = read_source(directory)
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise UserInputError(f'{flag}={directory} is a file, not a folder')
  if record is None and os.path.isdir(directory) and os.listdir(directory):
    raise UserInputError(
      f'{flag}={directory} holds files the server did not write; give an empty or new folder'
    )
  restored = Translator.from_checkpoint(workdir, checkpoint, batch_size=1)
  digest = source_digest(restored, quantization, ctranslate2.__version__)
  if record is not None and record.get('digest') == digest:
    return directory, restored, True
  check_folder_writable(directory, flag)
  parent = os.path.dirname(directory)  # The export is written beside it, then renamed.
  if os.path.isdir(parent) and not os.access(parent, os.W_OK | os.X_OK):
    raise UserInputError(f'{flag}={directory}: cannot replace it (cannot write in {parent})')
  began = time.perf_counter()
  spec = ctranslate2_spec.model_spec(restored.model_config, restored.params, restored.tokenizer)
  spec.optimize(quantization=quantization)
  record = {
    'digest': digest,
    'workdir': str(Workdir(workdir).path),  # gs:// kept as it is
    'checkpoint': checkpoint or 'default (averaged if current, else latest)',
    'quantization': quantization,
    'ctranslate2': ctranslate2.__version__,
    'written': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
  }
  _write(spec, workdir, restored, record, directory)
  logging.info('exported to %s in %.1f s', directory, time.perf_counter() - began)
  return directory, restored, False


def _write(spec, workdir: str, restored: Translator, record: dict, directory: str) -> None:
  """The spec, the vocabularies (`ctranslate2_spec.write_vocabularies`) and the record (last)
  into a hidden sibling folder, which then replaces `directory` (`paths.staged_folder`: never
  fewer than one complete export, and a second server exporting at once never removes this
  one's folder)."""
  with paths.staged_folder(directory) as staging:
    spec.save(staging)
    ctranslate2_spec.write_vocabularies(workdir, restored.tokenizer, staging)
    with open(os.path.join(staging, SOURCE_FILE), 'w', encoding='utf-8') as f:
      json.dump(record, f, indent=2, sort_keys=True)


class CTranslate2Engine(Engine):
  """A `ctranslate2.Translator` over an exported folder; nothing to compile, no attention maps."""

  name = 'ctranslate2'
  seeded_sampling = False  # See the module docstring.

  def __init__(
    self, directory: str, max_len: int, max_batch_size: int, intra_threads: int | None = None
  ):
    ctranslate2 = require()
    self.directory = directory
    self.max_len = max_len
    self.max_batch_size = max_batch_size
    self.intra_threads = intra_threads or DEFAULT_THREADS
    self.translator = ctranslate2.Translator(
      directory, device='cpu', inter_threads=1, intra_threads=self.intra_threads
    )
    # The workdir's Tokenizers, MarianTokenizer's rules included where its vocabulary has them.
    self.tokenizer, self.target_tokenizer = ctranslate2_runtime.load_tokenizers(directory)

  def length(self, sentence: str) -> int:
    return len(self.tokenizer.encode(sentence))

  def check(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
  ) -> None:
    """A prefix that cannot fit its sentence, as the jax engine refuses it."""
    if target_prefix is not None:
      jobs = batches.encode_sources(sentences, self.tokenizer, self.max_len)
      name = lambda index: f'"target_prefix"[{index}]'  # noqa: E731
      batches.add_prefixes(jobs, target_prefix, self.target_tokenizer, len(sentences), name)

  def decode(
    self,
    sentences: Sequence[str],
    options: DecodingOptions,
    target_prefix: Sequence[str | None] | None,
    draw_positions: Sequence[int],
  ) -> list[list[Hypothesis]]:
    del draw_positions  # Draws are unseeded (module docstring): nothing keys them.
    if len(sentences) > self.max_batch_size:
      raise ValueError(f'{len(sentences)} sentences in one batch; at most {self.max_batch_size}')
    # MBR's candidates: its N draws, or the N best of the beam; ranked by utility below.
    search = dataclasses.replace(
      options, num_hypotheses=options.candidates if options.mbr else options.num_hypotheses
    )
    found = self._hypotheses(sentences, search, target_prefix)
    if options.mbr:
      found = [_mbr_ranked(candidates, options.num_hypotheses) for candidates in found]
    return found

  def _hypotheses(self, sentences, options: DecodingOptions, target_prefix):
    return ctranslate2_runtime.hypotheses(
      self.translator,
      self.tokenizer,
      sentences,
      max_len=self.max_len,
      beam_size=options.beam_size,
      alpha=options.alpha,
      num_hypotheses=options.num_hypotheses,
      target_prefix=target_prefix,
      sampling=options.sampling,
      sampling_temperature=options.sampling_temperature,
      sampling_topk=options.sampling_topk,
      sampling_topp=options.sampling_topp,
      seed=None,  # Unseeded: see the module docstring.
      max_batch_size=self.max_batch_size,
      target_sentencepiece=self.target_tokenizer,
    )

  def warm_up(self, served: Served) -> None:
    """One full batch per served mode: CTranslate2 allocates its buffers on first use."""
    sentence = self.tokenizer.decode(list(range(4, min(20, self.tokenizer.vocab_size))))
    sentences = [sentence] * self.max_batch_size
    for options, prefixed in served.warm_up_options():
      if not prefixed:
        self.decode(sentences, options, None, list(range(len(sentences))))


def _mbr_ranked(candidates: list[Hypothesis], count: int) -> list[Hypothesis]:
  """The `count` candidates of highest expected chrF against the others (`inference.mbr`),
  best first, each with its utility; ties keep the candidates' order (as Translator ranks)."""
  if not candidates:
    return []
  from transformer_jax.inference import mbr  # sacrebleu's chrF: only for MBR.

  _, utilities = mbr.select([candidate.text for candidate in candidates])
  ranked = sorted(range(len(candidates)), key=lambda c: -utilities[c])
  return [dataclasses.replace(candidates[c], utility=float(utilities[c])) for c in ranked[:count]]


def load(
  workdir: str,
  checkpoint: int | str | None,
  *,
  max_batch_size: int,
  quantization: str | None = None,
  directory: str | None = None,
  intra_threads: int | None = None,
) -> tuple[CTranslate2Engine, str]:
  """The engine, and a few words for the start-up line: which export, reused or written."""
  quantization = quantization or DEFAULT_QUANTIZATION
  directory, restored, reused = prepare(workdir, checkpoint, quantization, directory)
  max_len = restored.model_config.max_len
  del restored  # The JAX parameters are not needed any more.
  engine = CTranslate2Engine(directory, max_len, max_batch_size, intra_threads)
  what = 'reused from' if reused else 'exported to'
  threads = f'{engine.intra_threads} thread{"s" if engine.intra_threads > 1 else ""}'
  return engine, f'{quantization} CTranslate2 model {what} {directory}, loaded ({threads})'
