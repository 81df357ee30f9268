"""The small transformers: causal masking, grouped-query attention against repeated kv heads,
and named errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune.models.transformer import DecoderLM, SelfAttention, ViT


def test_decoder_lm_is_causal():
  lm = DecoderLM(dim=16, depth=2, num_heads=2, head_dim=8, mlp_hidden=32, rngs=nnx.Rngs(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)
  changed = tokens.at[:, 8:].set((tokens[:, 8:] + 1) % 256)
  a, b = lm(tokens), lm(changed)
  np.testing.assert_array_equal(np.asarray(a[:, :8]), np.asarray(b[:, :8]))  # the past only
  assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


def test_grouped_query_attention_is_multi_head_with_repeated_kv_heads():
  # Reference: the same weights as plain multi-head attention, each kv head's k and v columns
  # repeated for the query heads it serves.
  gqa = SelfAttention(16, 4, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
  mha = SelfAttention(16, 4, 4, rngs=nnx.Rngs(1))
  mha.q.kernel[...] = gqa.q.kernel[...]
  mha.o.kernel[...] = gqa.o.kernel[...]
  for name in ("k", "v"):
    w = getattr(gqa, name).kernel[...].reshape(16, 2, 1, 4)
    getattr(mha, name).kernel[...] = jnp.broadcast_to(w, (16, 2, 2, 4)).reshape(16, 16)
  x = jax.random.normal(jax.random.key(0), (2, 5, 16))
  np.testing.assert_allclose(np.asarray(gqa(x)), np.asarray(mha(x)), rtol=1e-5, atol=1e-6)


def test_bad_shapes_are_named():
  with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
    SelfAttention(16, 4, 4, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"patch \(5\) must divide image_size \(32\)"):
    ViT(patch=5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm must be 'layer' or 'rms'"):
    ViT(norm="batch", rngs=nnx.Rngs(0))
