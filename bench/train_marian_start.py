"""train.py, training a model that Marian can represent exactly (bench/marian_pretrained.py).

    python bench/train_marian_start.py --config=configs/multi30k_wide.py \
        --workdir=runs/marian-shaped \
        --config.model.attention_bias=True --config.model.ffn_activation=swish \
        --config.model.sinusoid_layout=concatenated --config.model.logits_bias=True \
        --config.model.layer_norm_epsilon=1e-6 [other train.py flags]

Marian has no PAD and no BOS: its decoder starts from a zero vector where ours embeds BOS. Here
the PAD and BOS rows of the token embedding are zero at initialisation and masked in every
lookup and in the output projection, so they get no gradient and stay exactly zero (Adam
without weight decay): our BOS at position 0 embeds as sqrt(d) * 0 + P[0], Marian's zero start,
and the PAD and BOS logits are their logits_bias alone. Everything else is train.py unchanged;
the checkpoints are ordinary ones (those rows zero), read by the unpatched library as the same
model. A benchmark aid (it patches `models._token_embedding`), not a library feature.
"""

import os
import runpy
import sys

import jax.numpy as jnp
from flax import linen as nn

from transformer_jax.data.tokenizer import BOS_ID, PAD_ID
from transformer_jax.model import layers, transformer

ZEROED = (PAD_ID, BOS_ID)


class MarianStartEmbed(nn.Embed):
  def _masked(self):
    keep = jnp.ones((self.num_embeddings, 1), self.embedding.dtype)
    return self.embedding * keep.at[jnp.array(ZEROED)].set(0)

  def __call__(self, inputs):
    (embedding,) = self.promote_dtype(self._masked(), dtype=self.dtype, inexact=False)
    return jnp.take(embedding, inputs, axis=0)

  def attend(self, query):
    query, embedding = self.promote_dtype(query, self._masked(), dtype=self.dtype)
    return jnp.dot(query, embedding.T)


def _token_embedding(cfg, name):
  normal = nn.initializers.normal(stddev=cfg.d_model**-0.5)

  def init(key, shape, dtype=jnp.float32):
    return normal(key, shape, dtype).at[jnp.array(ZEROED)].set(0)

  return MarianStartEmbed(
    cfg.vocab_size,
    cfg.d_model,
    dtype=cfg.compute_dtype,
    embedding_init=layers.logical_param(init, ('vocab', 'embed')),
    name=name,
  )


transformer.token_embedding = _token_embedding
TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'train.py')
sys.argv[0] = TRAIN
runpy.run_path(TRAIN, run_name='__main__')
