"""A drop-in ``lax.conv_general_dilated`` whose 1x1 weight gradients are a matmul on CPU.

Why: XLA:CPU computes a convolution's weight gradient as a convolution whose operands have
the batch as their minor dimension, so it transposes the layer's input and output gradient
first. It fuses each transpose with the elementwise ops that produce its operand, and it
duplicates those producers into every such fusion. In a bottleneck ResNet the first 1x1
conv of every block reads the residual stream, which is a chain of elementwise ops
(BatchNorm, add, ReLU of every earlier block of the stage): each of these weight gradients
recomputes the stage up to its block, through a strided transpose. The cost grows with the
square of the stage's depth: on a CPU a training step of PruneTrain's ResNet-50 (8 bottleneck
blocks per stage) took far more than ResNet-32's for its FLOPs, and much less with the matmul
(measured in ``experiments/results/benchmarks/conv_weight_grad.md``).

A 1x1 convolution is a matmul over channels, and so is its weight gradient:
``dW = xᵀ · dY`` contracted over batch and space, which ``dot_general`` reads in place. The
forward pass and the input gradient are ``lax.conv_general_dilated``'s own, as are larger
kernels' weight gradients (their transposed operands come from a single conv's output and
cost little) and every weight gradient on other platforms (``lax.platform_dependent``; a
GPU keeps cuDNN's kernels).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["conv_general_dilated", "pointwise_weight_gradient"]

Array = jax.Array

_NHWC = ("NHWC", "HWIO", "NHWC")


def pointwise_weight_gradient(
  x: Array, grad_out: Array, *, strides: tuple[int, int] = (1, 1), precision=None
) -> Array:
  """``dL/dW`` of an unpadded 1x1 NHWC × HWIO convolution, as one matmul.

  ``dW[0, 0, c, o] = Σ_{n,h,w} x[n, h·s_h, w·s_w, c] · dY[n, h, w, o]``.

  Args:
    x: the convolution's NHWC input.
    grad_out: the gradient of its NHWC output.
    strides: the convolution's window strides.
    precision: passed to ``lax.dot_general``.

  Returns:
    The ``(1, 1, in_channels, out_channels)`` weight gradient, accumulated in float32 for
    16-bit inputs (and returned in float32 then).

  Raises:
    ValueError: ``x`` and ``grad_out`` are not the input and output gradient of one such
      convolution.
  """
  if x.ndim != 4 or grad_out.ndim != 4:
    raise ValueError(f"x and grad_out must be NHWC (4-D), got {x.shape} and {grad_out.shape}")
  n, height, width, channels = x.shape
  s_h, s_w = strides
  out_shape = (n, -(-height // s_h), -(-width // s_w))
  if grad_out.shape[:3] != out_shape:
    raise ValueError(
      f"grad_out {grad_out.shape} is not the output of a 1x1 convolution of x {x.shape} "
      f"with strides {strides} (expected {out_shape} before the channels)"
    )
  if (s_h, s_w) != (1, 1):
    x = x[:, ::s_h, ::s_w, :]
  accumulate = jnp.float32 if jnp.dtype(x.dtype).itemsize < 4 else None
  grad = lax.dot_general(
    x.reshape(-1, channels),
    grad_out.reshape(-1, grad_out.shape[-1]),
    (((0,), (0,)), ((), ())),
    precision=precision,
    preferred_element_type=accumulate,
  )
  return grad[None, None]


@dataclasses.dataclass(frozen=True)
class _PointwiseConv:
  """Static (hashable) settings of one unpadded 1x1 NHWC × HWIO convolution."""

  strides: tuple[int, int]
  precision: object

  def __call__(self, x: Array, kernel: Array) -> Array:
    return lax.conv_general_dilated(
      x, kernel, self.strides, "VALID", dimension_numbers=_NHWC, precision=self.precision
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _pointwise_conv(config: _PointwiseConv, x: Array, kernel: Array) -> Array:
  return config(x, kernel)


def _pointwise_conv_fwd(config: _PointwiseConv, x: Array, kernel: Array):
  return config(x, kernel), (x, kernel)


def _pointwise_conv_bwd(config: _PointwiseConv, residuals, grad_out):
  x, kernel = residuals
  (grad_x,) = jax.vjp(lambda x: config(x, kernel), x)[1](grad_out)

  def on_cpu(x, grad_out):
    grad = pointwise_weight_gradient(
      x, grad_out, strides=config.strides, precision=config.precision
    )
    return grad.astype(kernel.dtype)

  def elsewhere(x, grad_out):
    return jax.vjp(lambda k: config(x, k), kernel)[1](grad_out)[0]

  grad_kernel = lax.platform_dependent(x, grad_out, cpu=on_cpu, default=elsewhere)
  return grad_x, grad_kernel


_pointwise_conv.defvjp(_pointwise_conv_fwd, _pointwise_conv_bwd)


def _is_unpadded(padding) -> bool:
  if isinstance(padding, str):
    # A 1x1 window needs no padding under either rule.
    return padding.upper() in ("SAME", "VALID", "SAME_LOWER")
  return all(int(lo) == 0 and int(hi) == 0 for lo, hi in padding)


def conv_general_dilated(
  lhs: Array,
  rhs: Array,
  window_strides,
  padding,
  lhs_dilation=None,
  rhs_dilation=None,
  dimension_numbers=None,
  feature_group_count: int = 1,
  batch_group_count: int = 1,
  precision=None,
  preferred_element_type=None,
  **kwargs,
) -> Array:
  """``lax.conv_general_dilated``, with a 1x1 weight gradient of its own on CPU.

  :func:`pointwise_weight_gradient` is the weight gradient of 1x1 convolutions on CPU.

  The same signature and forward result as ``lax.conv_general_dilated`` (it is the
  ``conv_general_dilated`` hook of ``nnx.Conv``, which ``jaxprune.models.ConvBN`` sets).
  Unpadded 1x1 NHWC × HWIO convolutions without dilation, groups or
  ``preferred_element_type`` get the matmul weight gradient on CPU; every other call is
  ``lax.conv_general_dilated`` unchanged.

  Args:
    lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
      feature_group_count, batch_group_count, precision, preferred_element_type, kwargs:
      as in ``lax.conv_general_dilated``.

  Returns:
    The convolution output.

  Example:
    >>> conv = nnx.Conv(64, 16, (1, 1), conv_general_dilated=conv_general_dilated,
    ...                 rngs=nnx.Rngs(0))
  """
  pointwise = (
    lhs.ndim == 4
    and rhs.ndim == 4
    and rhs.shape[:2] == (1, 1)
    and dimension_numbers is not None
    and lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    == lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC)
    and feature_group_count == 1
    and batch_group_count == 1
    and preferred_element_type is None
    and all(v is None for v in kwargs.values())
    and all(int(d) == 1 for d in lhs_dilation or ())
    and all(int(d) == 1 for d in rhs_dilation or ())
    and _is_unpadded(padding)
  )
  if pointwise:
    strides = tuple(int(s) for s in window_strides)
    return _pointwise_conv(_PointwiseConv(strides, precision), lhs, rhs)
  return lax.conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=lhs_dilation,
    rhs_dilation=rhs_dilation,
    dimension_numbers=dimension_numbers,
    feature_group_count=feature_group_count,
    batch_group_count=batch_group_count,
    precision=precision,
    preferred_element_type=preferred_element_type,
    **kwargs,
  )
