"""ClickTrain's sparse execution (ClickTrain §5.1, §5.2): running a pruned model's convs on
their final masks, once training has pruned them.

Nothing here trains or prunes; it reads the masks the training half
(:mod:`jaxprune.clicktrain`) leaves in the optimizer state. The files, one job each:

* :mod:`~jaxprune.clicktrain.execution.pattern_layout` — the paper's fixed-position (ELL / CSR)
  layout of a pattern-pruned kernel (§5.1).
* :mod:`~jaxprune.clicktrain.execution.pattern_conv` — the custom-VJP convolution on that
  layout (reference SpMM or the Pallas kernels, §5.2).
* :mod:`~jaxprune.clicktrain.execution.aligned_layout` and
  :mod:`~jaxprune.clicktrain.execution.aligned_conv` — the aligned mode's group-shared layout
  and its slices-plus-GEMM convolution (beyond the paper).
* :mod:`~jaxprune.clicktrain.execution.sparse_layers` — :class:`PatternConv` and
  :class:`AlignedConv`, the NNX layers a pruned conv becomes.
* :mod:`~jaxprune.clicktrain.execution.layer_timing` — timing one conv or a whole training pass.
* :mod:`~jaxprune.clicktrain.execution.options` — :class:`SparseExecutionConfig`, the eight
  options, checked once, and the platform defaults.
* :mod:`~jaxprune.clicktrain.execution.conversion` — :func:`plan_sparse_layers` (the per-layer
  decisions and timings), :func:`apply_sparse_layers` (the layer swap) and
  :func:`to_sparse_layers` (both).
* :mod:`~jaxprune.clicktrain.execution.hook` — :class:`SparseExecution`, the trainer hook that
  converts at the hard prune.
"""

from jaxprune.clicktrain.execution.aligned_conv import aligned_conv
from jaxprune.clicktrain.execution.aligned_layout import (
  AlignedLayout,
  aligned_mask,
  build_aligned_layout,
)
from jaxprune.clicktrain.execution.conversion import (
  ConversionReport,
  LayerChoice,
  apply_sparse_layers,
  convert_model,  # noqa: F401 (deprecated name of to_sparse_layers, kept out of __all__)
  format_report,
  pattern_convs,
  plan_sparse_layers,
  to_sparse_layers,
)
from jaxprune.clicktrain.execution.hook import SparseExecution
from jaxprune.clicktrain.execution.options import SparseExecutionConfig
from jaxprune.clicktrain.execution.pattern_conv import pattern_conv, pattern_conv_values
from jaxprune.clicktrain.execution.pattern_layout import (
  PatternLayout,
  build_layout,
  to_dense,
  to_values,
)
from jaxprune.clicktrain.execution.sparse_layers import AlignedConv, PatternConv

__all__ = [
  "AlignedConv",
  "AlignedLayout",
  "ConversionReport",
  "LayerChoice",
  "PatternConv",
  "PatternLayout",
  "SparseExecution",
  "SparseExecutionConfig",
  "aligned_conv",
  "aligned_mask",
  "apply_sparse_layers",
  "build_aligned_layout",
  "build_layout",
  "format_report",
  "pattern_conv",
  "pattern_conv_values",
  "pattern_convs",
  "plan_sparse_layers",
  "to_dense",
  "to_sparse_layers",
  "to_values",
]
