"""SDGP: structured (N:M) data-gradient pruning (McDanel et al., 2022).

``nm_prune`` prunes a gradient tensor, ``sdgp_conv`` is a convolution whose input gradient is
computed from the N:M-pruned output gradient, ``SDGPConv`` is its Flax NNX module and
``convert_model`` swaps the convolutions of an existing model (with ``layers=("conv",
"linear")`` its dense layers too: ``sdgp_linear`` / ``SDGPLinear``, beyond the paper). ``SDGPSettings`` holds the N:M
settings (checked once, passed down as they are); ``PrunedDataGradient`` is SDGP's backward as
a wrapper of the shared conv-function protocol (``jaxprune.models.PluggableConv``).
``backend="auto"`` runs, per lowering platform, the N:M backend that measured faster there
(``MEASURED_FASTER``, ``auto_backend``: the pure-JAX reference on CUDA today);
``time_backends`` times both on the current device. ``timemodel`` holds the parts of the
paper's time model (§IV-C): each conv call of a model, its forward, dX and dW as jitted jobs.

Example:
  >>> from jaxprune import sdgp
  >>> model = sdgp.convert_model(model, n=2, m=4, method="rescaled_magnitude")

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774

  Chmiel, Hubara, Banner and Soudry, "Minimum Variance Unbiased N:M Sparsity for the Neural
  Gradients", ICLR 2023 (``method="mvue"``). https://arxiv.org/abs/2203.10991
"""

from jaxprune.sdgp import timemodel
from jaxprune.sdgp.conv import (
  PrunedDataGradient,
  SDGPConv,
  SDGPConversion,
  SDGPKey,
  convert_model,
  next_layer_key,
  sdgp_conv,
  with_pruned_data_gradient,
)
from jaxprune.sdgp.linear import SDGPLinear, sdgp_linear
from jaxprune.sdgp.preset import PAPER_MODELS, method, paper_method, paper_model
from jaxprune.sdgp.prune import (
  BACKENDS,
  MEASURED_FASTER,
  SDGPSettings,
  auto_backend,
  nm_prune,
  nm_prune_reference,
  time_backends,
)
from pallas_kernels.nm_math import MAX_GROUP, METHODS, RESCALE_EPS

__all__ = [
  "PAPER_MODELS",
  "method",
  "paper_method",
  "paper_model",
  "BACKENDS",
  "MEASURED_FASTER",
  "MAX_GROUP",
  "METHODS",
  "RESCALE_EPS",
  "PrunedDataGradient",
  "SDGPConv",
  "SDGPConversion",
  "SDGPKey",
  "SDGPLinear",
  "SDGPSettings",
  "auto_backend",
  "convert_model",
  "nm_prune",
  "nm_prune_reference",
  "next_layer_key",
  "sdgp_conv",
  "sdgp_linear",
  "time_backends",
  "timemodel",
  "with_pruned_data_gradient",
]
