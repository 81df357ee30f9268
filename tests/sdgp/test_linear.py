"""SDGP on dense layers: the weight gradient is the dense op's, the input gradient the dense op's
VJP of the N:M-pruned output gradient (references: ``jax.vjp`` of ``x @ w`` and ``nm_prune``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import sdgp
from jaxprune.models.transformer import ViT


@pytest.mark.parametrize("method", ["magnitude", "rescaled_magnitude", "random", "mvue"])
def test_sdgp_linear_vjp_against_the_dense_op(method):
  x = jax.random.normal(jax.random.key(0), (3, 5, 8))
  w = jax.random.normal(jax.random.key(1), (8, 12))
  key = jax.random.key(7) if method in ("random", "mvue") else None
  y, vjp = jax.vjp(lambda a, b: sdgp.sdgp_linear(a, b, n=2, m=4, method=method, key=key), x, w)
  dense_y, dense_vjp = jax.vjp(lambda a, b: a @ b, x, w)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(dense_y))  # forward unchanged
  g = jax.random.normal(jax.random.key(2), y.shape)
  dx, dw = vjp(g)
  pruned = sdgp.nm_prune(g, 2, 4, method, key=key)
  assert np.mean(np.asarray(pruned) == 0) == pytest.approx(0.5)  # 2 of every 4 kept
  want_dx, _ = dense_vjp(pruned)
  _, want_dw = dense_vjp(g)  # the weight gradient from the dense output gradient
  np.testing.assert_allclose(np.asarray(dx), np.asarray(want_dx), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(want_dw), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_named():
  w = jnp.ones((8, 12))
  with pytest.raises(ValueError, match="x must have a batch axis"):
    sdgp.sdgp_linear(jnp.ones(8), w, n=2, m=4, method="magnitude")
  with pytest.raises(ValueError, match=r"kernel must be \(in, out\)"):
    sdgp.sdgp_linear(jnp.ones((2, 8)), jnp.ones((8, 3, 4)), n=2, m=4, method="magnitude")
  with pytest.raises(ValueError, match="10 output channels are not divisible by m=4"):
    sdgp.sdgp_linear(jnp.ones((2, 8)), jnp.ones((8, 10)), n=2, m=4, method="magnitude")
  with pytest.raises(ValueError, match="layers must be"):
    sdgp.convert_model(_vit(), n=2, m=4, method="magnitude", layers=("attention",))


def _vit():
  return ViT(dim=16, depth=1, num_heads=2, head_dim=4, mlp_hidden=16, rngs=nnx.Rngs(0))


def test_convert_model_takes_a_transformers_projections():
  with pytest.raises(ValueError, match=r"layers=\('conv', 'linear'\)"):
    # the default converts convs only: a ViT's one conv reads the image (3 channels)
    sdgp.convert_model(_vit(), n=2, m=4, method="magnitude")
  dense, model = _vit(), _vit()
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
  sdgp.convert_model(model, n=2, m=4, method="mvue", layers=("conv", "linear"))
  converted = {
    "/".join(map(str, p)) for p, m in nnx.iter_modules(model) if isinstance(m, sdgp.SDGPLinear)
  }
  attn, mlp = "blocks/0/attention/branch/", "blocks/0/feed_forward/branch/"
  assert converted == {attn + n for n in "qkvo"} | {mlp + "up", mlp + "down"}  # not the head
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(nnx.state(model, nnx.Param))):
    np.testing.assert_array_equal(a, np.asarray(b))  # the very parameters
  x = jax.random.normal(jax.random.key(3), (2, 32, 32, 3))
  np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(dense(x)))

  def head_grad(m):
    return nnx.grad(lambda m: m(x).sum())(m)["head"]["kernel"]

  # the head is not converted and reads the forward only: its gradient is the dense one
  np.testing.assert_allclose(
    np.asarray(head_grad(model)), np.asarray(head_grad(dense)), rtol=1e-6, atol=1e-6
  )
  # a random method draws afresh per call: the key advances
  layer = model.blocks[0].attn.q
  first = np.asarray(jax.random.key_data(layer.sdgp_key[...]))
  layer(jnp.ones((2, 16)))
  assert not np.array_equal(first, np.asarray(jax.random.key_data(layer.sdgp_key[...])))
