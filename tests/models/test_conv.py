"""The 1x1 matmul weight gradient (models/conv.py) against ``jax.vjp`` of
``lax.conv_general_dilated`` and a NumPy sum, and the layers that use it."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxprune.models import Bottleneck
from jaxprune.models.conv import conv_general_dilated, pointwise_weight_gradient

_NHWC = ("NHWC", "HWIO", "NHWC")


def _loss(conv, x, w, strides, padding):
  y = conv(x, w, strides, padding, dimension_numbers=_NHWC)
  return jnp.sum(jnp.sin(y))  # a non-constant output gradient


def _grads(conv, x, w, strides=(1, 1), padding="SAME"):
  return jax.jit(jax.grad(_loss, argnums=(1, 2)), static_argnums=(0, 3, 4))(
    conv, x, w, strides, padding
  )


def _data(shape, kernel, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.normal(size=shape), dtype),
    jnp.asarray(rng.normal(size=kernel), dtype),
  )


@pytest.mark.parametrize(
  "shape, strides, padding",
  [
    ((4, 8, 8, 6), (1, 1), "SAME"),
    ((3, 9, 7, 5), (2, 2), "SAME"),
    ((3, 9, 7, 5), (2, 3), "VALID"),
    ((2, 10, 11, 4), (3, 1), ((0, 0), (0, 0))),
  ],
)
def test_pointwise_gradients_match_lax_vjp(shape, strides, padding):
  x, w = _data(shape, (1, 1, shape[-1], 7))
  ours = _grads(conv_general_dilated, x, w, strides, padding)
  reference = _grads(lax.conv_general_dilated, x, w, strides, padding)
  for got, want in zip(ours, reference, strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pointwise_weight_gradient_matches_a_numpy_sum():
  x, _ = _data((2, 5, 6, 3), (1, 1, 3, 4))
  grad_out = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 2, 4)), jnp.float32)
  strides = (2, 3)
  want = np.zeros((3, 4))
  for n in range(2):
    for h in range(3):
      for w in range(2):
        want += np.outer(np.asarray(x[n, h * 2, w * 3]), np.asarray(grad_out[n, h, w]))
  got = pointwise_weight_gradient(x, grad_out, strides=strides)
  assert got.shape == (1, 1, 3, 4)
  np.testing.assert_allclose(got[0, 0], want, rtol=1e-5, atol=1e-5)


def test_bfloat16_accumulates_in_float32_and_returns_the_kernel_dtype():
  x, w = _data((8, 16, 16, 32), (1, 1, 32, 16), jnp.bfloat16)
  grad_out = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16, 16, 16)), jnp.bfloat16)
  got = pointwise_weight_gradient(x, grad_out)
  assert got.dtype == jnp.float32
  want = pointwise_weight_gradient(x.astype(jnp.float32), grad_out.astype(jnp.float32))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  # Through the VJP: the kernel's dtype, within bfloat16 rounding of lax's.
  ours = _grads(conv_general_dilated, x, w)[1]
  reference = _grads(lax.conv_general_dilated, x, w)[1]
  assert ours.dtype == reference.dtype == jnp.bfloat16
  scale = float(jnp.abs(reference.astype(jnp.float32)).max())
  np.testing.assert_allclose(
    np.asarray(ours, np.float32), np.asarray(reference, np.float32), atol=2e-2 * scale
  )


@pytest.mark.parametrize(
  "kernel, kwargs",
  [
    ((3, 3, 4, 6), {}),  # larger kernel
    ((1, 1, 2, 6), {"feature_group_count": 2}),
    ((1, 1, 4, 6), {"rhs_dilation": (2, 2)}),
    ((1, 1, 4, 6), {"lhs_dilation": (2, 1)}),
  ],
)
def test_other_convolutions_are_lax_unchanged(kernel, kwargs):
  x, w = _data((2, 7, 7, 4), kernel)

  def loss(conv, x, w):
    y = conv(x, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=_NHWC, **kwargs)
    return jnp.sum(jnp.sin(y))

  jaxpr = str(jax.make_jaxpr(lambda x, w: loss(conv_general_dilated, x, w))(x, w))
  assert "custom_vjp" not in jaxpr
  ours = jax.grad(lambda x, w: loss(conv_general_dilated, x, w), argnums=(0, 1))(x, w)
  reference = jax.grad(lambda x, w: loss(lax.conv_general_dilated, x, w), argnums=(0, 1))(x, w)
  for got, want in zip(ours, reference, strict=True):
    np.testing.assert_array_equal(got, want)


def test_padded_pointwise_convolution_is_lax_unchanged():
  x, w = _data((2, 5, 5, 3), (1, 1, 3, 4))
  padding = ((1, 0), (0, 2))
  jaxpr = str(jax.make_jaxpr(lambda x, w: _loss(conv_general_dilated, x, w, (1, 1), padding))(x, w))
  assert "custom_vjp" not in jaxpr
  for got, want in zip(
    _grads(conv_general_dilated, x, w, padding=padding),
    _grads(lax.conv_general_dilated, x, w, padding=padding),
    strict=True,
  ):
    np.testing.assert_array_equal(got, want)


def _count(text, op):
  return text.count(f"stablehlo.{op}")


def test_cpu_weight_gradient_is_a_dot_and_other_platforms_keep_the_conv():
  """On CPU the weight gradient lowers to a dot (two convolutions remain: the forward and
  the input gradient); cross-lowered for CUDA it is lax's convolution."""
  x, w = _data((2, 6, 6, 4), (1, 1, 4, 8))
  grad = jax.jit(jax.grad(lambda x, w: _loss(conv_general_dilated, x, w, (1, 1), "SAME"), (0, 1)))
  cpu = grad.lower(x, w).as_text()
  assert (_count(cpu, "convolution"), _count(cpu, "dot_general")) == (2, 1)
  cuda = jax.export.export(grad, platforms=["cuda"])(x, w).mlir_module()
  assert (_count(cuda, "convolution"), _count(cuda, "dot_general")) == (3, 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_inputs_propagate_as_in_lax(bad):
  """A NaN or Inf pixel spoils exactly the weight-gradient row of its channel, as in lax's
  (the output gradient is held finite: a fixed linear loss)."""
  x, w = _data((2, 4, 4, 3), (1, 1, 3, 5))
  x = x.at[1, 2, 3, 1].set(bad)
  grad_out = jnp.asarray(np.random.default_rng(3).normal(size=(2, 4, 4, 5)), jnp.float32)

  def grad_kernel(conv):
    loss = lambda w: jnp.sum(conv(x, w, (1, 1), "SAME", dimension_numbers=_NHWC) * grad_out)
    return jax.jit(jax.grad(loss))(w)

  ours, reference = grad_kernel(conv_general_dilated), grad_kernel(lax.conv_general_dilated)
  np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(reference))
  assert not np.isfinite(ours[0, 0, 1]).any() and np.isfinite(ours[0, 0, [0, 2]]).all()
  np.testing.assert_array_equal(np.isnan(ours), np.isnan(reference))
  np.testing.assert_allclose(ours[0, 0, [0, 2]], reference[0, 0, [0, 2]], rtol=1e-5, atol=1e-5)


def test_pointwise_weight_gradient_rejects_mismatched_shapes():
  x = jnp.zeros((2, 6, 6, 3))
  with pytest.raises(ValueError, match="NHWC"):
    pointwise_weight_gradient(x[0], jnp.zeros((6, 6, 4)))
  with pytest.raises(ValueError, match="grad_out"):
    pointwise_weight_gradient(x, jnp.zeros((2, 6, 6, 4)), strides=(2, 2))


def test_bottleneck_gradients_equal_a_plain_lax_copy():
  """A strided, projected bottleneck (two 1x1 convs and the 1x1 shortcut take the new
  weight gradient) has the gradients of the same block built on lax's convolution."""
  block = Bottleneck(16, 32, strides=2, projection=True, rngs=nnx.Rngs(0))
  plain = copy.deepcopy(block)
  convs = [m for _, m in nnx.iter_graph(plain) if isinstance(m, nnx.Conv)]
  assert len(convs) == 4 and all(c.conv_general_dilated is conv_general_dilated for c in convs)
  for conv in convs:
    conv.conv_general_dilated = lax.conv_general_dilated
  x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8, 8, 16)), jnp.float32)

  def grads(module):
    return nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(module)

  ours, reference = grads(block), grads(plain)
  leaves = jax.tree.leaves(ours)
  assert len(leaves) == len(jax.tree.leaves(reference)) > 0
  for got, want in zip(leaves, jax.tree.leaves(reference), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
