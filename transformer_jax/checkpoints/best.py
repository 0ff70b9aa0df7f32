"""The best checkpoint by a validation metric, and early stopping on it.

With `config.best_checkpoint_metric` set, training compares each evaluation's value of that
metric with the best so far (`BestCheckpoint.update`); an improvement is saved as a step
checkpoint at once, and the checkpointer keeps that step beyond its last `keep_checkpoints`
(`Checkpointer.keep_also`), as fairseq's checkpoint_best.pt and Marian's `--keep-best`.
`config.early_stopping_patience` = P stops the run after P evaluations in a row without an
improvement (fairseq's `--patience`, Marian's `--early-stopping`).

The record travels in every checkpoint's JSON data state under `DATA_KEY`, so a resumed run
knows the best so far exactly as the uninterrupted one did at that step, and `best_step`
reads it back for `--checkpoint=best`.
"""

from __future__ import annotations

import dataclasses
import math

# The evaluation metrics a run can be judged by (`training.loop._Run.evaluate`'s keys), and
# whether lower or higher is better.
METRIC_MODES = {
  'loss': 'min',
  'token_accuracy': 'max',
  'exact_match': 'max',
  'bleu': 'max',
  'chrf': 'max',
}
# Those computed from greedy decoding (they need config.eval_decode_examples > 0).
DECODED_METRICS = ('exact_match', 'bleu', 'chrf')
# The key of the record in a step checkpoint's data state.
DATA_KEY = 'best_checkpoint'


@dataclasses.dataclass
class BestCheckpoint:
  """The best evaluation so far of `metric` (its step and value), and how many evaluations
  since have not improved on it (strictly: a tie is no improvement)."""

  metric: str
  patience: int = 0  # 0: never stop early.
  step: int | None = None
  value: float | None = None
  evaluations_since: int = 0

  def update(self, step: int, value: float) -> bool:
    """Counts the evaluation at `step`, where `metric` was `value`; whether it is the new best
    (a NaN never is)."""
    value = float(value)
    better = math.isfinite(value) and (
      self.value is None
      or (value < self.value if METRIC_MODES[self.metric] == 'min' else value > self.value)
    )
    if better:
      self.step, self.value, self.evaluations_since = step, value, 0
    else:
      self.evaluations_since += 1
    return better

  @property
  def exhausted(self) -> bool:
    """Whether the patience ran out: the run should stop."""
    return bool(self.patience) and self.evaluations_since >= self.patience

  def describe(self) -> str:
    if self.value is None:
      # Every evaluation judged so far was NaN (a NaN never becomes the best), yet the patience
      # may run out on them: the stop and every resume after it describe the record with this.
      count = self.evaluations_since
      return f'no finite validation {self.metric} in {count} evaluation{"s" * (count != 1)}'
    return f'best validation {self.metric} {self.value:.4f} at step {self.step}'

  def to_json(self) -> dict:
    return {
      'metric': self.metric,
      'step': self.step,
      'value': self.value,
      'evaluations_since': self.evaluations_since,
    }

  @classmethod
  def from_json(cls, record: dict | None, metric: str, patience: int) -> BestCheckpoint:
    """The record of a checkpoint's data state, continued with this run's `patience`; a
    fresh one where there is none or it judged another metric (the metric was changed on
    resume: the best so far by the new one is unknown)."""
    if not record or record.get('metric') != metric:
      return cls(metric, patience)
    return cls(
      metric,
      patience,
      step=record['step'],
      value=record['value'],
      evaluations_since=int(record['evaluations_since']),
    )


def best_step(data_state: dict) -> int | None:
  """The best step a checkpoint's data state records, or None (none recorded)."""
  record = data_state.get(DATA_KEY) or {}
  return record.get('step')
