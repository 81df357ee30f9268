"""SDGP's custom VJP, shared by its conv and dense layers (SDGP §III-A).

The forward pass is the layer's own; the VJP returns dW from the layer's VJP of the dense output
gradient (the paper copies dL/dO for it) and dX from its VJP of the N:M-pruned one, the groups on
the output features (the reduction axis of the dX product).

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774
"""

from __future__ import annotations

import functools

import jax

from jaxprune.models.pluggable_conv import ConvKey
from jaxprune.sdgp.prune import SDGPSettings
from pallas_kernels import nm_math

Array = jax.Array


def check_out_channels(name: str, channels: int, m: int) -> None:
  # Groups run over output channels (the dX conv's reduction axis), so they must tile it.
  if channels % m != 0:
    raise ValueError(f"{name}: {channels} output channels are not divisible by m={m}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sdgp_apply(
  settings: SDGPSettings, conv_fn, x: Array, kernel: Array, key: Array | None
) -> Array:
  return conv_fn(x, kernel)


def _sdgp_apply_fwd(settings, conv_fn, x, kernel, key):
  return conv_fn(x, kernel), (x, kernel, key)


def _sdgp_apply_bwd(settings, conv_fn, residuals, cotangent):
  x, kernel, key = residuals
  # dW from the dense output gradient (SDGP §III-A: dL/dO is copied before pruning).
  _, weight_vjp = jax.vjp(lambda w: conv_fn(x, w), kernel)
  (d_kernel,) = weight_vjp(cotangent)
  # dX from the N:M-pruned output gradient (SDGP Alg. 1, groups on the channel axis).
  # The barrier keeps XLA from fusing (and so recomputing) the cotangent's producers into
  # the pruning pass: the cotangent is materialised once for the dW conv anyway.
  cotangent = jax.lax.optimization_barrier(cotangent)
  pruned = settings.prune(cotangent, key)
  _, input_vjp = jax.vjp(lambda x_: conv_fn(x_, kernel), x)
  (d_x,) = input_vjp(pruned)
  return d_x, d_kernel, None


_sdgp_apply.defvjp(_sdgp_apply_fwd, _sdgp_apply_bwd)


def apply(settings: SDGPSettings, conv_fn, x: Array, kernel: Array, key: Array | None) -> Array:
  """The checks of one call (the settings were checked when created), then the custom VJP."""
  check_out_channels("kernel", kernel.shape[-1], settings.m)
  nm_math.validate_key(settings.method, key)
  return _sdgp_apply(settings, conv_fn, x, kernel, key)


class SDGPKey(ConvKey):
  """PRNG key of an ``SDGPConv`` with a random method; advanced on every call.

  Not an ``nnx.Param``: a train step must carry it like BatchNorm statistics (``nnx.jit``
  and ``nnx.value_and_grad`` do; a functional loop must return ``nnx.state(model)``).
  """
