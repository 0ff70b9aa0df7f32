"""Translation quality: BLEU, chrF and exact match (`metrics`), and scoring a test set with a
workdir's model (`test_set`, the evaluate command's work)."""

from transformer_jax.evaluation.metrics import score
from transformer_jax.evaluation.test_set import evaluate, evaluate_files

__all__ = ['evaluate', 'evaluate_files', 'score']
