"""ClickTrain: pattern and connectivity pruning during training (Zhang et al., ICS'21).

Every 3x3 kernel keeps 4 of its 9 weights in one of a small pool of patterns, and a per-layer
fraction of whole kernels is removed. The pieces:

* :mod:`~jaxprune.clicktrain.importance` — (g⊙w)² importance, pattern scores (Eq. 1) and kernel
  scores (Eq. 2).
* :mod:`~jaxprune.clicktrain.patterns` — the pattern library, dynamic pattern pool generation
  (DPPG, §4.2), votes and adaptive finalization (§4.3).
* :mod:`~jaxprune.clicktrain.transform` — :func:`clicktrain`, the Optax wrapper that runs the
  stage machine (:class:`Stage`: warm-up, pool, finalize, regularize, pruned) around an inner
  optimizer.
* :mod:`~jaxprune.clicktrain.readouts` — masks, stage, pattern usage, compression, FLOPs saved,
  the aligned mode's filter groups (:func:`filter_partition`), found inside any optimizer state (chains, wrappers, ``nnx.Optimizer``). The masks also feed
  :func:`jaxprune.masking.mask`, which keeps them whatever is chained after the wrapper.
* :mod:`~jaxprune.clicktrain.prune_batchnorm` — :class:`HardPruneBatchNorm`, the trainer hook
  re-estimating the BatchNorm statistics at the hard prune (on in the :func:`method` preset).
* :mod:`~jaxprune.clicktrain.prune_readout` — :class:`HardPruneReadout`, the trainer hook
  recording, just before the hard prune, the weight norm it removes and the test accuracy
  with and without the masks.

Example:
  >>> import optax
  >>> from jaxprune import clicktrain
  >>> tx = clicktrain.clicktrain(
  ...     optax.sgd(0.1, momentum=0.9), steps_per_epoch=390, hard_prune_epoch=95,
  ...     kernel_prune_ratio=0.65)

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from jaxprune.clicktrain import reconfigure as _reconfigure  # noqa: F401 (registers the slicer)
from jaxprune.clicktrain.importance import kernel_scores, pattern_scores, weight_importance
from jaxprune.clicktrain.patterns import (
  ONE_SHOT_POOL_SIZES,
  accumulate_competitive_scores,
  all_patterns,
  centre_block_patterns,
  dppg_candidates,
  finalize_patterns,
  kernel_keep_mask,
  library_pattern_ids,
  library_patterns,
  loss_margin_ok,
  num_patterns,
  one_shot_pool,
  pattern_index,
  pattern_mask,
  pattern_masks_from_ids,
  select_pool,
  vote,
)
from jaxprune.clicktrain.readouts import (
  compression,
  filter_partition,
  find_state,
  flops_saved,
  group_lasso_penalty,
  kernel_masks,
  masks,
  pattern_ids,
  pattern_usage,
  removed_norm_fraction,
  stage_name,
)
from jaxprune.clicktrain.transform import (
  FINALIZE,
  POOL,
  PRUNED,
  REGULARIZE,
  STAGE_NAMES,
  WARMUP,
  ClickTrainLayerState,
  ClickTrainState,
  Stage,
  clicktrain,
  default_layer_filter,
)
from jaxprune.clicktrain.preset import RELEASED_CIFAR10, method, released_method
from jaxprune.clicktrain.prune_batchnorm import HardPruneBatchNorm, HardPruneCheck
from jaxprune.clicktrain.prune_readout import HardPruneReadout
from jaxprune.clicktrain.layout import PatternLayout, build_layout, to_dense, to_values
from jaxprune.clicktrain.pattern_conv import pattern_conv, pattern_conv_values
from jaxprune.clicktrain.aligned_conv import aligned_conv
from jaxprune.clicktrain.aligned_layout import AlignedLayout, aligned_mask, build_aligned_layout
from jaxprune.clicktrain.sparse_execution import (
  AlignedConv,
  LayerChoice,
  PatternConv,
  SparseExecution,
  convert_model,
  pattern_convs,
)

__all__ = [
  "RELEASED_CIFAR10",
  "released_method",
  "FINALIZE",
  "POOL",
  "PRUNED",
  "REGULARIZE",
  "STAGE_NAMES",
  "WARMUP",
  "ClickTrainLayerState",
  "ClickTrainState",
  "HardPruneBatchNorm",
  "HardPruneCheck",
  "HardPruneReadout",
  "LayerChoice",
  "AlignedConv",
  "AlignedLayout",
  "PatternConv",
  "PatternLayout",
  "SparseExecution",
  "Stage",
  "accumulate_competitive_scores",
  "all_patterns",
  "build_layout",
  "centre_block_patterns",
  "clicktrain",
  "compression",
  "filter_partition",
  "aligned_conv",
  "aligned_mask",
  "build_aligned_layout",
  "convert_model",
  "default_layer_filter",
  "dppg_candidates",
  "finalize_patterns",
  "find_state",
  "flops_saved",
  "group_lasso_penalty",
  "kernel_keep_mask",
  "kernel_masks",
  "kernel_scores",
  "library_pattern_ids",
  "library_patterns",
  "loss_margin_ok",
  "masks",
  "method",
  "num_patterns",
  "one_shot_pool",
  "ONE_SHOT_POOL_SIZES",
  "pattern_conv",
  "pattern_conv_values",
  "pattern_convs",
  "pattern_ids",
  "pattern_index",
  "pattern_mask",
  "pattern_masks_from_ids",
  "pattern_scores",
  "pattern_usage",
  "removed_norm_fraction",
  "select_pool",
  "stage_name",
  "to_dense",
  "to_values",
  "vote",
  "weight_importance",
]
