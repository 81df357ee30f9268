"""SDGP on dense layers: forward unchanged, input gradient from the N:M-pruned output gradient.

SDGP (McDanel et al., 2022, §III-A) prunes the output data gradient dL/dO of a conv to N:M
along its channels before the input gradient dL/dX = dL/dO · Wᵀ is computed; the paper and its
code stop at convolutions. A transformer's cost is in its dense projections (q, k, v, o and the
MLP), where the same backward has the same shape: dL/dX contracts dL/dO over the output
features, so N:M groups of ``m`` consecutive output features at each (sample, token) are what a
sparse dX product would skip. The weight gradient keeps the dense dL/dO, as for the convs.
``"rescaled_magnitude"`` rescales each (sample, feature) over the axes between the first and the
last: the tokens of a ``(batch, tokens, features)`` activation, as H and W for a conv.

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprune.models.pluggable_conv import next_call_key
from jaxprune.sdgp._backward import SDGPKey, apply, check_out_channels
from jaxprune.sdgp.prune import SDGPSettings
from pallas_kernels import nm_math

__all__ = ["SDGPLinear", "sdgp_linear"]

Array = jax.Array


def _dense(x: Array, kernel: Array, precision=None) -> Array:
  """``x @ kernel`` over the last axis of ``x`` (``nnx.Linear``'s product)."""
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def sdgp_linear(
  x: Array,
  kernel: Array,
  *,
  n: int,
  m: int,
  method: str,
  key: Array | None = None,
  backend: str = "auto",
  rescale_eps: float | str | None = nm_math.RELEASED,
  precision=None,
) -> Array:
  """``x @ kernel`` with SDGP's backward pass (the dense counterpart of ``sdgp_conv``).

  Args:
    x: ``(..., in)`` input, at least 2-D (a batch axis first).
    kernel: ``(in, out)``; ``out`` must be divisible by ``m``.
    n, m, method, key, backend, rescale_eps: as in :func:`jaxprune.sdgp.nm_prune`.
    precision: as in ``jax.lax.dot_general``.

  Returns:
    ``(..., out)``.

  Raises:
    ValueError: ``x`` of fewer than 2 axes, a ``kernel`` that is not 2-D, ``out`` not divisible
      by ``m``, or bad N:M settings (named).

  Example:
    >>> y = sdgp_linear(x, w, n=2, m=4, method="magnitude")
  """
  if jnp.ndim(x) < 2:
    raise ValueError(f"x must have a batch axis and a feature axis, got shape {jnp.shape(x)}")
  if jnp.ndim(kernel) != 2:
    raise ValueError(f"kernel must be (in, out), got shape {jnp.shape(kernel)}")
  eps = nm_math.resolve_rescale_eps(method, rescale_eps)
  settings = SDGPSettings(n, m, method, backend, eps)
  check_out_channels("kernel", kernel.shape[-1], m)
  return apply(settings, lambda a, w: _dense(a, w, precision), x, kernel, key)


class SDGPLinear(nnx.Linear):
  """``nnx.Linear`` whose input gradient uses the N:M-pruned output gradient (SDGP).

  Same parameters and forward as ``nnx.Linear``; for ``"random"`` / ``"mvue"`` it holds an
  ``SDGPKey`` advanced on every call, as ``SDGPConv`` does.

  Example:
    >>> layer = SDGPLinear(64, 128, n=2, m=4, method="magnitude", rngs=nnx.Rngs(0))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    settings: SDGPSettings,
    key: Array | None = None,
    rngs: nnx.Rngs,
    **linear_kwargs,
  ):
    check_out_channels("out_features", out_features, settings.m)
    super().__init__(in_features, out_features, rngs=rngs, **linear_kwargs)
    self.settings = settings
    if settings.uses_key:
      if key is None:
        key = rngs.sdgp() if "sdgp" in rngs else rngs.default()
      self.sdgp_key = SDGPKey(key)
    else:
      self.sdgp_key = nnx.data(None)

  def __call__(self, x: Array) -> Array:
    kernel = self.kernel[...]
    bias = self.bias[...] if self.bias is not None else None
    x, kernel, bias = self.promote_dtype((x, kernel, bias), dtype=self.dtype)
    key = next_call_key(self.sdgp_key)
    nm_math.validate_key(self.settings.method, key)
    y = apply(self.settings, lambda a, w: _dense(a, w, self.precision), x, kernel, key)
    return y if bias is None else y + bias

  @classmethod
  def from_linear(
    cls, linear: nnx.Linear, settings: SDGPSettings, *, key: Array | None = None
  ) -> SDGPLinear:
    """An ``SDGPLinear`` holding ``linear``'s very ``kernel`` / ``bias`` Variables."""
    if isinstance(linear, SDGPLinear):
      raise ValueError("linear is already an SDGPLinear")
    if settings.uses_key and key is None:
      raise ValueError(f"key is required for method {settings.method!r}")
    new = cls(
      linear.in_features,
      linear.out_features,
      settings=settings,
      key=key,
      rngs=nnx.Rngs(0),
      use_bias=linear.use_bias,
      dtype=linear.dtype,
      param_dtype=linear.param_dtype,
      precision=linear.precision,
    )
    new.kernel = linear.kernel
    new.bias = linear.bias
    return new
