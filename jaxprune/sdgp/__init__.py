"""SDGP: structured (N:M) data-gradient pruning (McDanel et al., 2022).

``nm_prune`` prunes a gradient tensor, ``sdgp_conv`` is a convolution whose input gradient is
computed from the N:M-pruned output gradient, ``SDGPConv`` is its Flax NNX module and
``convert_model`` swaps the convolutions of an existing model.

Example:
  >>> from jaxprune import sdgp
  >>> model = sdgp.convert_model(model, n=2, m=4, method="rescaled_magnitude")
"""

from pallas_kernels.nm_math import MAX_GROUP, METHODS, RESCALE_EPS
from jaxprune.sdgp.conv import SDGPConv, SDGPConversion, SDGPKey, convert_model, sdgp_conv
from jaxprune.sdgp.prune import BACKENDS, nm_prune, nm_prune_reference

__all__ = [
  "BACKENDS",
  "MAX_GROUP",
  "METHODS",
  "RESCALE_EPS",
  "SDGPConv",
  "SDGPConversion",
  "SDGPKey",
  "convert_model",
  "nm_prune",
  "nm_prune_reference",
  "sdgp_conv",
]
