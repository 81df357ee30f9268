"""Timing of one conv or a whole model's training pass, for the dispatch of
:mod:`jaxprune.clicktrain.execution.conversion` and the benchmarks under ``experiments/``.

Each time is the median of ``repeats`` calls of a jitted function after a warm-up call
(:func:`jaxprune.timing.median_call_ms`), so compilation is not counted; every candidate is
timed at the real input shape, in the kernel's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxprune.clicktrain.execution.pattern_conv import pattern_conv_values
from jaxprune.clicktrain.execution.pattern_layout import PatternLayout, to_dense, to_values
from jaxprune.timing import median_call_ms

__all__ = ["time_layer", "time_model_pass", "time_train_pass"]


def time_layer(
  layout: PatternLayout,
  input_shape: Sequence[int],
  *,
  strides=(1, 1),
  padding="SAME",
  backend: str = "reference",
  repeats: int = 3,
  seed: int = 0,
) -> dict[str, float]:
  """Wall-clock milliseconds of one conv, sparse path against the dense masked conv.

  Times, on the default device, the forward pass, the data gradient and the weight gradient
  of :func:`~jaxprune.clicktrain.execution.pattern_conv.pattern_conv_values` with ``backend`` and of
  ``lax.conv_general_dilated`` with the masked kernel, each the median of ``repeats`` calls of
  the jitted function after a warm-up call (so compilation is not counted).

  Returns:
    ``dense_fwd_ms``, ``sparse_fwd_ms``, ``dense_dx_ms``, ``sparse_dx_ms``, ``dense_dw_ms``,
    ``sparse_dw_ms``.
  """
  rng = np.random.default_rng(seed)
  mask = np.asarray(to_dense(jnp.ones((layout.kernel_shape[3], layout.width)), layout))
  kernel = jnp.asarray(rng.normal(size=layout.kernel_shape) * mask, jnp.float32)
  values = to_values(kernel, layout)
  x = jnp.asarray(rng.normal(size=tuple(input_shape)), jnp.float32)
  strides = (strides, strides) if isinstance(strides, int) else tuple(strides)
  pad = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)

  def dense(x, w):
    return lax.conv_general_dilated(x, w, strides, pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def sparse(x, v):
    return pattern_conv_values(x, v, layout, strides=strides, padding=pad, backend=backend)

  cot = jnp.asarray(rng.normal(size=jax.eval_shape(dense, x, kernel).shape), jnp.float32)

  def grad(f, argnum):
    return jax.jit(lambda x, w, c: jax.vjp(f, x, w)[1](c)[argnum])

  return {
    "dense_fwd_ms": median_call_ms(jax.jit(dense), x, kernel, repeats=repeats),
    "sparse_fwd_ms": median_call_ms(jax.jit(sparse), x, values, repeats=repeats),
    "dense_dx_ms": median_call_ms(grad(dense, 0), x, kernel, cot, repeats=repeats),
    "sparse_dx_ms": median_call_ms(grad(sparse, 0), x, values, cot, repeats=repeats),
    "dense_dw_ms": median_call_ms(grad(dense, 1), x, kernel, cot, repeats=repeats),
    "sparse_dw_ms": median_call_ms(grad(sparse, 1), x, values, cot, repeats=repeats),
  }


def time_train_pass(
  conv: Callable[[jax.Array, jax.Array], jax.Array],
  input_shape: Sequence[int],
  kernel: jax.Array,
  *,
  repeats: int = 3,
  seed: int = 0,
) -> float:
  """Median milliseconds of one training pass of ``conv(x, kernel)``.

  The forward and both gradients in one jitted ``jax.vjp`` (what a train step pays for the layer).
  """
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=tuple(input_shape)), kernel.dtype)
  cot = jnp.asarray(rng.normal(size=jax.eval_shape(conv, x, kernel).shape), kernel.dtype)

  def train_pass(x, w, c):
    y, vjp = jax.vjp(conv, x, w)
    return (y, *vjp(c))

  return median_call_ms(jax.jit(train_pass), x, kernel, cot, repeats=repeats)


def time_model_pass(
  model: nnx.Module, input_shape: Sequence[int], *, repeats: int = 3, seed: int = 0
) -> float:
  """Median milliseconds of one training pass of the whole ``model``.

  On a random batch of ``input_shape``: the forward and the gradients of its parameters and input in
  one jitted ``jax.vjp`` (a train step without the optimizer, which every conversion leaves alike).
  The model is not changed (its other state, e.g. BatchNorm statistics, is updated on a copy).
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=tuple(input_shape)), jnp.float32)

  def train_pass(params, rest, x):
    y, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p, rest)(x), params, x)
    return y, vjp(jnp.ones_like(y))

  params, rest = nnx.as_pure(params), nnx.as_pure(rest)
  return median_call_ms(jax.jit(train_pass), params, rest, x, repeats=repeats)
