"""SDGP as a :class:`jaxprune.methods.Method`: the registry's ``sdgp``.

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxprune.methods import Method
from jaxprune.sdgp.conv import convert_model
from pallas_kernels import nm_math

__all__ = ["method"]


def method(
  *,
  n: int = 2,
  m: int = 4,
  method: str = "rescaled_magnitude",
  min_in_channels: int = 4,
  seed: int = 0,
  backend: str = "auto",
) -> Method:
  """SDGP (N:M pruning of each conv's output data gradient) as a method.

  ``convert(model)`` is :func:`jaxprune.sdgp.convert_model`; the optimizer is the user's,
  unchanged (the weight gradient stays dense). The default is the paper's best, rescaled
  magnitude 2:4 (Table I).

  Args:
    n, m: keep ``n`` of every ``m`` consecutive channels of the output gradient.
    method: ``"random"``, ``"magnitude"``, ``"rescaled_magnitude"`` or ``"mvue"``.
    min_in_channels, seed, backend: as :func:`jaxprune.sdgp.convert_model`.

  Returns:
    A :class:`jaxprune.methods.Method` named ``"sdgp"``.

  Raises:
    ValueError: bad ``n``, ``m`` or ``method`` (checked here, before any model is seen).

  Example:
    >>> from jaxprune import sdgp
    >>> m = sdgp.method(n=2, m=4, method="mvue")
  """
  nm_math.validate((1, m), jnp.float32, n, m, method, key=0)
  config = {
    "n": n,
    "m": m,
    "method": method,
    "min_in_channels": min_in_channels,
    "seed": seed,
    "backend": backend,
  }

  def convert(model):
    return convert_model(model, **config)

  return Method(name="sdgp", convert=convert, config=config)
