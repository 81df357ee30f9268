"""PruneTrain: channel group lasso with periodic network reconfiguration (Lym et al., SC'19).

The pieces:

* :mod:`~jaxprune.prunetrain.group_lasso` — the channel group lasso (Eq. 2) as Optax transforms,
  λ from the penalty ratio (Eq. 3), the proximal group shrink.
* :mod:`~jaxprune.prunetrain.optimizer` — :func:`with_group_lasso`, the optimizer wrapper.
* :mod:`~jaxprune.prunetrain.penalised` — :func:`penalised_axes`: the kernels, the input conv
  and the classifier of the penalty read off the traced graph (transformers included).
* :mod:`~jaxprune.prunetrain.graph` — the channel graph of any NNX model, traced from its jaxpr
  (which variable axes carry each channel group).
* :mod:`~jaxprune.prunetrain.plan` — :class:`SurgeryPlan`: what a reconfiguration removes, as a
  value a checkpoint carries and a resume re-applies.
* :mod:`~jaxprune.prunetrain.surgery` — :func:`reconfigure`: remove dead channels and layers
  of any NNX model (§4.2).
* :class:`ChannelSlices`, :func:`register_state_slicer` — re-exported from the shared
  :mod:`jaxprune.state_slicing`: slice the model and every per-parameter optimizer state with
  the same kept indices (other methods register their states' slicers there).
* :mod:`~jaxprune.prunetrain.dynamic_batch` — the dynamic mini-batch (§4.3): grow the batch
  into the memory a reconfiguration freed, LR scaled by the same ratio.
* :mod:`~jaxprune.prunetrain.callback` — :class:`PruneTrainCallback`: reconfiguration every k
  epochs inside the trainer, dynamic mini-batch, cost accounting.

Example:
  >>> import optax
  >>> from jaxprune import prunetrain
  >>> tx = prunetrain.with_group_lasso(optax.sgd(0.1, momentum=0.9), penalty_ratio=0.2)

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from jaxprune.prunetrain.callback import PruneTrainCallback, model_costs
from jaxprune.prunetrain.dynamic_batch import DynamicBatch, grow_batch_size, largest_batch_size
from jaxprune.prunetrain.graph import (
  DEFAULT_THRESHOLD,
  ChannelGraph,
  ChannelGroup,
  ChannelUse,
  channel_graph,
  live_channels,
)
from jaxprune.prunetrain.group_lasso import (
  EPSILON,
  GroupLassoRatioState,
  GroupLassoState,
  LeafGroups,
  PathPredicate,
  add_group_lasso,
  check_default_rule,
  coefficient_from_ratio,
  default_is_classifier,
  default_is_input_conv,
  group_lasso_from_ratio,
  group_shrink,
  leaf_groups,
  penalty,
  penalty_gradient,
  set_coefficient_once,
)
from jaxprune.prunetrain.optimizer import PruneTrainState, with_group_lasso
from jaxprune.prunetrain.penalised import AxisGroups, KernelAxes, PenalisedAxes, penalised_axes
from jaxprune.state_slicing import (
  ChannelSlices,
  StateSlicer,
  SurgeryPlan,
  applied_plans,
  apply_plan,
  register_state_slicer,
  registered_state_slicers,
)
from jaxprune.prunetrain.plan import plan_reconfiguration
from jaxprune.prunetrain.surgery import (
  ReconfigureReport,
  apply_reconfiguration,
  reconfigure,
  rounded_width,
)
from jaxprune.prunetrain.preset import method

__all__ = [
  "method",
  "PruneTrainCallback",
  "model_costs",
  "DynamicBatch",
  "grow_batch_size",
  "largest_batch_size",
  "DEFAULT_THRESHOLD",
  "ChannelGraph",
  "ChannelGroup",
  "ChannelUse",
  "channel_graph",
  "live_channels",
  "EPSILON",
  "GroupLassoRatioState",
  "GroupLassoState",
  "LeafGroups",
  "PathPredicate",
  "add_group_lasso",
  "check_default_rule",
  "coefficient_from_ratio",
  "default_is_classifier",
  "default_is_input_conv",
  "group_lasso_from_ratio",
  "group_shrink",
  "leaf_groups",
  "penalty",
  "penalty_gradient",
  "set_coefficient_once",
  "PruneTrainState",
  "with_group_lasso",
  "AxisGroups",
  "KernelAxes",
  "PenalisedAxes",
  "penalised_axes",
  "ChannelSlices",
  "StateSlicer",
  "register_state_slicer",
  "registered_state_slicers",
  "ReconfigureReport",
  "SurgeryPlan",
  "applied_plans",
  "apply_plan",
  "apply_reconfiguration",
  "plan_reconfiguration",
  "reconfigure",
  "rounded_width",
]
