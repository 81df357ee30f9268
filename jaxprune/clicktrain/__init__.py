"""ClickTrain: pattern and connectivity pruning during training (Zhang et al., ICS'21).

Every 3x3 kernel keeps 4 of its 9 weights in one of a small pool of patterns, and a per-layer
fraction of whole kernels is removed. The package has two halves.

**Training-time pruning** (this folder; what the transform does while training):

* :mod:`~jaxprune.clicktrain.importance` — (g⊙w)² importance, pattern scores (Eq. 1) and kernel
  scores (Eq. 2).
* :mod:`~jaxprune.clicktrain.patterns` — the pattern library, dynamic pattern pool generation
  (DPPG, §4.2), votes and adaptive finalization (§4.3).
* :mod:`~jaxprune.clicktrain.schedule` — :class:`Schedule`, the pruning schedule as one frozen
  value: the epoch settings, their checks, their placement in a run, and when each stage is due.
* :mod:`~jaxprune.clicktrain.config` — :class:`Config`, the validated settings of one
  transform (every keyword of :func:`clicktrain`: the epoch settings as its ``schedule``, each
  mode's in a sub-config, :class:`PaperMode`, :class:`OneShot`, :class:`Aligned`), and
  :func:`default_layer_filter`.
* :mod:`~jaxprune.clicktrain.state` — the optimizer state (:class:`ClickTrainState`,
  :class:`ClickTrainLayerState`) and the stages (:class:`Stage`: warm-up, pool, finalize,
  regularize, pruned).
* :mod:`~jaxprune.clicktrain.transform` — :func:`clicktrain`, the Optax wrapper around an inner
  optimizer; ``_plan`` (which layers are pruned and how), ``_stage_machine`` (the transitions
  between stages, at epoch ends, inside ``jit``), ``_stage_work`` (the work each stage does
  per step: scores, votes, masks, the group-lasso gradient, the hard mask) and ``_groups``
  (the aligned mode's per-group sums) are its private parts.
* :mod:`~jaxprune.clicktrain.readouts` — masks, stage, pattern usage, compression, FLOPs saved,
  the aligned mode's filter groups (:func:`filter_partition`), found inside any optimizer state
  (chains, wrappers, ``nnx.Optimizer``). The masks also feed :func:`jaxprune.masking.mask`,
  which keeps them whatever is chained after the wrapper.
* :mod:`~jaxprune.clicktrain.prune_batchnorm` — :class:`HardPruneBatchNorm` (re-estimating the
  BatchNorm statistics at the hard prune) and :class:`HardPruneCheck`, trainer hooks.
* :mod:`~jaxprune.clicktrain.pruned_step` — :func:`specialize_pruned` and the trainer hook
  :class:`PrunedStageStep`: once the masks are final, the update runs the pruned stage's work
  only (no stage machine, the per-layer state passed through).
* :mod:`~jaxprune.clicktrain.prune_readout` — :class:`HardPruneReadout`, the trainer hook
  recording, just before the hard prune, the weight norm it removes and the test accuracy
  with and without the masks.
* :mod:`~jaxprune.clicktrain.reconfigure` — the state's slicer for PruneTrain's surgery.
* :mod:`~jaxprune.clicktrain.preset` — :func:`method` and :func:`released_method`, ClickTrain
  as a :class:`jaxprune.methods.Method`.

**Post-prune sparse execution** (:mod:`jaxprune.clicktrain.execution`; runs the pruned convs on
their final masks): layouts, sparse convolutions, the sparse layers, and
:class:`SparseExecution` / :func:`to_sparse_layers`, which switch a pruned model to them.

Import rule: no training-half module imports :mod:`jaxprune.clicktrain.execution`, except this
``__init__`` (it re-exports the execution entry points from the subpackage) and
:mod:`~jaxprune.clicktrain.preset`, the one bridge (it attaches :class:`SparseExecution` in the
aligned mode). ``tests/test_import.py`` checks it. Execution reads the training half's
read-outs, never the other way round.

Words, one meaning each: a *stage* is one of :class:`Stage`; the *stage machine* moves between
them; *stage work* is what a stage computes each step; the *pruning schedule* is the epochs at
which the stages happen (the epoch settings: ``pool_start_epoch``, ``pool_epochs``,
``finalize_epochs``, ``hard_prune_epoch``, ``one_shot_epoch``, the loss-derivative trigger);
*schedules* elsewhere (:mod:`jaxprune.train.schedules`) are learning-rate schedules. To change
the pruning schedule, touch ``schedule.py``: the epoch settings, their defaults and checks, how
the presets place them in a run (:meth:`Schedule.for_run`), and when each stage is due (the
stage machine asks it). The transform keeps the :class:`Schedule` in its state
(``find_state(opt_state).schedule``), where the hooks and experiments read it.

The public names below (``__all__``) are the user surface: the transform, its state types, the
paper's importance and pattern definitions, read-outs, presets, hooks and the execution entry
points. Everything else stays reachable through its module.

Example:
  >>> import optax
  >>> from jaxprune import clicktrain
  >>> tx = clicktrain.clicktrain(
  ...     optax.sgd(0.1, momentum=0.9), steps_per_epoch=390, hard_prune_epoch=95,
  ...     kernel_prune_ratio=0.65)
  >>> tx = clicktrain.clicktrain(optax.sgd(0.1, momentum=0.9), config=clicktrain.Config(
  ...     clicktrain.Schedule(steps_per_epoch=390, hard_prune_epoch=95),
  ...     kernel_prune_ratio=0.65, aligned=clicktrain.Aligned(filter_groups=4)))

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from jaxprune.clicktrain import reconfigure as _reconfigure  # noqa: F401 (registers the slicer)
from jaxprune.clicktrain._plan import ratios_by_name
from jaxprune.clicktrain.config import (
  Aligned,
  Config,
  OneShot,
  PaperMode,
  RatiosByName,
  default_layer_filter,
)
from jaxprune.clicktrain.schedule import Schedule
from jaxprune.clicktrain.execution import (
  AlignedConv,
  PatternConv,
  SparseExecution,
  SparseExecutionConfig,
  apply_sparse_layers,
  convert_model,  # noqa: F401 (deprecated name of to_sparse_layers, kept out of __all__)
  format_report,
  pattern_convs,
  plan_sparse_layers,
  to_sparse_layers,
)
from jaxprune.clicktrain.importance import kernel_scores, pattern_scores, weight_importance
from jaxprune.clicktrain.layer_choice import (
  LayerChoiceCheck,
  layer_choice_differences,
  layer_filter_for,
)
from jaxprune.clicktrain.patterns import all_patterns, dppg_candidates, library_patterns
from jaxprune.clicktrain.preset import RELEASED_CIFAR10, method, released_method
from jaxprune.clicktrain.prune_batchnorm import HardPruneBatchNorm, HardPruneCheck
from jaxprune.clicktrain.prune_readout import HardPruneReadout
from jaxprune.clicktrain.pruned_step import PrunedStageStep, is_specialized, specialize_pruned
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
  planned_compression,
  removed_norm_fraction,
  stage_name,
)
from jaxprune.clicktrain.state import (
  STAGE_NAMES,
  ClickTrainLayerState,
  ClickTrainState,
  PrunedStep,
  Stage,
)
from jaxprune.clicktrain.transform import clicktrain

__all__ = [
  # the transform and its state
  "clicktrain",
  "Config",
  "PaperMode",
  "OneShot",
  "Aligned",
  "RatiosByName",
  "ratios_by_name",
  "default_layer_filter",
  "layer_filter_for",
  "layer_choice_differences",
  "LayerChoiceCheck",
  "Schedule",
  "ClickTrainState",
  "ClickTrainLayerState",
  "PrunedStep",
  "specialize_pruned",
  "is_specialized",
  "Stage",
  "STAGE_NAMES",
  # the paper's importance (Eq. 1, 2) and patterns (§4.2)
  "weight_importance",
  "pattern_scores",
  "kernel_scores",
  "all_patterns",
  "library_patterns",
  "dppg_candidates",
  # read-outs
  "compression",
  "filter_partition",
  "find_state",
  "flops_saved",
  "group_lasso_penalty",
  "kernel_masks",
  "masks",
  "pattern_ids",
  "pattern_usage",
  "planned_compression",
  "removed_norm_fraction",
  "stage_name",
  # presets
  "method",
  "released_method",
  "RELEASED_CIFAR10",
  # trainer hooks
  "HardPruneBatchNorm",
  "HardPruneCheck",
  "HardPruneReadout",
  "PrunedStageStep",
  "SparseExecution",
  # sparse execution entry points
  "SparseExecutionConfig",
  "to_sparse_layers",
  "plan_sparse_layers",
  "apply_sparse_layers",
  "PatternConv",
  "AlignedConv",
  "pattern_convs",
  "format_report",
]
