"""PruneTrain reconfiguration: shrink a group-lasso-sparsified network into a smaller dense one.

PruneTrain (Lym et al., SC'19, §4.2) periodically removes the channels that group lasso
(:mod:`jaxprune.prunetrain.group_lasso`) drove to zero and continues training the smaller, still
dense model; parameter momentums of the remaining channels "are kept as is". Here that happens
on the host, outside ``jit``, for any Flax NNX model:

1. :func:`~jaxprune.prunetrain.channel_graph` traces the model's forward pass and joins every
   channel axis of every variable into the groups that must be pruned together.
2. A channel is dead when every kernel over it has ``max|w| < threshold`` — the *channel
   union* of §4.2 (Fig. 5c): only channels dead in all neighbours go, so no gather or scatter
   is needed where tensors merge. A group keeps at least its strongest channel, unless it lies
   inside a module's removable branch: then the branch goes (§4.1 layer removal; the library's
   residual blocks declare theirs).
3. :func:`~jaxprune.prunetrain.plan_reconfiguration` writes that as a
   :class:`~jaxprune.prunetrain.SurgeryPlan` and :func:`~jaxprune.prunetrain.apply_plan`
   slices every variable (kernels, biases, norm scales and running statistics) and sets the
   layer attributes (``in_features``, ``out_features``, ``num_features``,
   ``feature_group_count``) of a clone of the model (or the model itself, ``inplace=True``).
   A :mod:`jaxprune.models` network also gets its smaller width spec.
4. Every parameter-shaped optimizer-state leaf (momentum, Adam moments, ...) and every
   optimizer state with a registered slicer (ClickTrain's masks and scores;
   :func:`jaxprune.state_slicing.register_state_slicer`) is sliced with the same indices.

The new model computes the same function as the old one with the removed channels' weights set
to zero, with one exception: a removed branch also drops the constant its last BatchNorm emits
for a zero input (``β − γ·μ/√(σ²+ε)`` per channel); the report records the largest as
``removed_branch_offset``.

:class:`PruneTrainCallback` runs all this inside :class:`jaxprune.train.Trainer` every k
epochs, grows the mini-batch into the memory freed (§4.3) and accounts the training cost.

Example::

  tx = optax.chain(group_lasso_from_ratio(0.2), optax.sgd(0.1, momentum=0.9))
  opt_state = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))
  ...  # train 10 epochs
  model, opt_state, report = reconfigure(model, opt_state, input_shape=(1, 32, 32, 3))
  print(report.summary())

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

import jax
import numpy as np
from flax import nnx

from jaxprune import flops, models
from jaxprune.linen_bridge import refuse_bridged
from jaxprune.models.conversions import submodule
from jaxprune.prunetrain.graph import (
  DEFAULT_THRESHOLD,
  ChannelGraph,
  _as_input_dtype,
  channel_graph,
  default_input_shape,
)
from jaxprune.prunetrain.plan import plan_reconfiguration, rounded_width
from jaxprune.state_slicing import ChannelSlices, SurgeryPlan, _path, apply_plan

__all__ = ["ReconfigureReport", "apply_reconfiguration", "reconfigure", "rounded_width"]


@dataclasses.dataclass
class ReconfigureReport:
  """What a reconfiguration removed.

  Attributes:
    channels_before: output channels per layer (path string) before.
    channels_after: output channels per layer after (removed layers absent).
    removed_layers: paths of the convs removed with their residual branch.
    removed_branches: ``"stages/s/b"`` of every removed branch.
    params_before, params_after: number of trainable parameters.
    flops_before, flops_after: inference FLOPs for ``input_shape`` (``jaxprune.flops``).
    train_flops_before, train_flops_after: training FLOPs of one step for ``input_shape``.
    input_shape: the shape the FLOPs were counted for.
    removed_branch_offset: largest |constant| a removed branch's last BatchNorm emitted for a
      zero input (the only difference from the zeroed model; 0 if no branch was removed).
    plan: the :class:`~jaxprune.prunetrain.SurgeryPlan` that was applied.
  """

  channels_before: dict[str, int]
  channels_after: dict[str, int]
  removed_layers: list[str]
  removed_branches: list[str]
  params_before: int
  params_after: int
  flops_before: Optional[int]
  flops_after: Optional[int]
  train_flops_before: Optional[int]
  train_flops_after: Optional[int]
  input_shape: Optional[tuple[int, ...]]
  removed_branch_offset: float
  plan: Optional[SurgeryPlan] = None

  @property
  def channels_removed(self) -> dict[str, int]:
    """Output channels removed per layer (a removed layer counts all its channels)."""
    return {
      name: before - self.channels_after.get(name, 0)
      for name, before in self.channels_before.items()
    }

  @property
  def changed(self) -> bool:
    return self.channels_before != self.channels_after

  @property
  def flops_ratio(self) -> Optional[float]:
    if not self.flops_before:
      return None
    return self.flops_after / self.flops_before

  def summary(self) -> str:
    removed = sum(self.channels_removed.values())
    total = sum(self.channels_before.values())
    text = (
      f"removed {removed}/{total} channels, {len(self.removed_layers)} layers "
      f"({len(self.removed_branches)} branches); params {self.params_before} -> "
      f"{self.params_after}"
    )
    if self.flops_ratio is not None:
      text += (
        f"; inference FLOPs {self.flops_before / 1e6:.2f}M -> "
        f"{self.flops_after / 1e6:.2f}M ({self.flops_ratio:.1%})"
      )
    return text


# ----------------------------------------------------------------------------- reconfigure


def _is_eval_mode(model: nnx.Module) -> bool:
  for _, node in nnx.iter_graph(model):
    if isinstance(node, nnx.BatchNorm):
      return bool(node.use_running_average)
  return False


def _param_count(model: nnx.Module) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _flops(model: nnx.Module, input_shape: tuple[int, ...], dtype: Any) -> tuple[int, int]:
  layers = flops.layer_flops(model, input_shape, input_dtype=dtype)
  return flops.inference_flops(layers), flops.training_flops_per_step(layers)


def _layer_name(model: nnx.Module, path: tuple) -> str:
  """A conv / dense layer's name: its module path, or its wrapper's when the wrapper holds
  only it and states its width (``ConvBN``: ``"stages/0/1/conv1"`` for the conv inside)."""
  if path:
    parent = submodule(model, path[:-1])
    inner = [n for _, n in nnx.iter_graph(parent) if isinstance(n, (nnx.Conv, nnx.Linear))]
    if hasattr(parent, "out_features") and len(inner) == 1:
      path = path[:-1]
  return "/".join(map(str, path))


def _layer_widths(model: nnx.Module) -> dict[str, int]:
  """Output width of every conv and dense layer, by layer name."""
  widths = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, (nnx.Conv, nnx.Linear)):
      widths[_layer_name(model, tuple(path))] = int(node.kernel.shape[-1])
    elif isinstance(node, nnx.LinearGeneral):  # (in..., heads, head_dim): every output
      outputs = node.kernel.shape[len(node.in_features) :]
      widths[_layer_name(model, tuple(path))] = int(np.prod(outputs))
  return widths


def _branch_offset(module: nnx.Module) -> float:
  """|BN(0)| per channel in eval mode of the last BatchNorm of a module's removable branch:
  β − γ·μ/√(σ²+ε) (what a dead branch still adds)."""
  last = getattr(module, module.branch_names[-1])
  norms = [node for _, node in nnx.iter_graph(last) if isinstance(node, nnx.BatchNorm)]
  if not norms:
    return 0.0
  bn = norms[-1]
  mean, var = np.asarray(bn.mean[...]), np.asarray(bn.var[...])
  scale = np.asarray(bn.scale[...]) if bn.scale is not None else 1.0
  bias = np.asarray(bn.bias[...]) if bn.bias is not None else 0.0
  offset = bias - scale * mean / np.sqrt(var + bn.epsilon)
  return float(np.max(np.abs(offset))) if np.size(offset) else 0.0


def refuse_linen(model: nnx.Module) -> None:
  """Refuses a model with a Linen module bridged in (``nnx.bridge.ToNNX``), by name."""
  refuse_bridged(
    model,
    what="PruneTrain's reconfiguration rebuilds NNX layers at their new widths, and a Linen "
    "module's widths are its dataclass fields, which the surgery cannot rebuild",
    instead="The group lasso alone works on it (prunetrain.with_group_lasso without "
    "PruneTrainCallback); to remove channels, write the model with flax.nnx layers",
  )


def reconfigure(
  model: nnx.Module,
  opt_state: Any = None,
  *,
  threshold: float = DEFAULT_THRESHOLD,
  input_shape: Optional[Sequence[int]] = None,
  input_dtype: Any = None,
  count_flops: bool = True,
  channel_multiple: int = 1,
  inplace: bool = False,
):
  """Removes dead channels and dead residual branches of any NNX model (PruneTrain §4.2).

  Args:
    model: any NNX module called as ``model(x)`` (train or eval mode; kept).
    opt_state: the optimizer state over ``nnx.as_pure(nnx.state(model, nnx.Param))`` (what
      :mod:`jaxprune.train` and ``nnx.Optimizer.update`` pass to Optax), or an
      ``nnx.Optimizer`` (a new one is returned, same ``tx``), or None. Every sub-tree shaped
      like the params and every state with a registered slicer is sliced; other leaves
      (counts, PruneTrain's λ) are kept.
    threshold: a group is dead when ``max|w| < threshold`` (absolute; paper: 1e-4).
    input_shape: the shape of one input batch, for tracing the channel graph and for the
      FLOPs in the report; default one 32x32 image (224x224 for ImageNet specs) for a
      :mod:`jaxprune.models` network, required for other models.
    input_dtype: the dtype of that input: float32 (images) by default, ``jnp.int32`` for a
      language model's token ids (see :func:`~jaxprune.prunetrain.channel_graph`).
    count_flops: set False to skip the FLOPs tracing.
    channel_multiple: round every kept channel count up to a multiple of this (capped at the
      current width) by keeping the strongest dead channels as well. Not in the paper:
      convolutions run faster at channel counts that fill the vector width (measured on the
      PruneTrain results page). Dead residual branches are still removed. A converted
      model's own multiple (``jaxprune.models.channel_multiple``, e.g. SDGP's ``m``) is always
      honoured.
    inplace: reconfigure ``model`` itself instead of a clone.

  Returns:
    ``(new_model, new_opt_state, report)``; ``report`` is a :class:`ReconfigureReport`.

  Raises:
    ValueError: negative / non-finite ``threshold``, no ``input_shape`` for a model without a
      width spec, a model with non-finite kernel weights (the first such layer is named), an
      optimizer state that does not match the model's params, or a model whose layers do not
      follow their new widths (named).
  """
  _check_reconfigure_args(threshold, channel_multiple)
  refuse_linen(model)
  graph = channel_graph(model, input_shape, input_dtype=input_dtype)
  _check_finite(graph)
  multiple = math.lcm(channel_multiple, models.channel_multiple(model))
  plan = plan_reconfiguration(model, graph, threshold=threshold, multiple=multiple)
  return apply_reconfiguration(
    model, opt_state, plan, graph=graph, count_flops=count_flops, inplace=inplace
  )


def apply_reconfiguration(
  model: nnx.Module,
  opt_state: Any,
  plan: SurgeryPlan,
  *,
  graph: Optional[ChannelGraph] = None,
  input_shape: Optional[Sequence[int]] = None,
  input_dtype: Any = None,
  count_flops: bool = False,
  inplace: bool = False,
):
  """Applies a :class:`~jaxprune.prunetrain.SurgeryPlan` to a model and its optimizer state.

  What :func:`reconfigure` does once it has decided; also what a resume does with the plans a
  checkpoint carries.

  Args:
    model: the model the plan was made for.
    opt_state: as in :func:`reconfigure`.
    plan: the plan.
    graph: the model's channel graph (only for its input shape and dtype).
    input_shape: the input shape for the check and the FLOPs (default: the graph's, else the
      model's spec's).
    input_dtype: the input's dtype (default: the graph's, else float32).
    count_flops: count the FLOPs before and after for the report.
    inplace: change ``model`` itself instead of a clone.

  Returns:
    ``(new_model, new_opt_state, report)``.

  Raises:
    ValueError: the plan does not fit the model, or the model does not compute with its new
      widths (a module whose attributes the surgery does not know; named).
  """
  shape = tuple(input_shape or (graph.input_shape if graph else default_input_shape(model)))
  dtype = _as_input_dtype(
    input_dtype if input_dtype is not None or graph is None else graph.input_dtype
  )
  old_params = nnx.as_pure(nnx.state(model, nnx.Param))
  before = _layer_widths(model)
  offset = max((_branch_offset(submodule(model, _path(key))) for key in plan.removed), default=0.0)
  flops_before = _flops(model, shape, dtype) if count_flops else (None, None)
  params_before = _param_count(model)
  # Taken before the cut: with inplace=True the old model is gone afterwards.
  want = _output_shapes(model, shape, dtype)
  name = type(model).__name__
  new_model = model if inplace else nnx.clone(model)
  apply_plan(new_model, plan)
  _check_computes(new_model, shape, dtype, want, plan, name)
  slices = ChannelSlices(
    {},
    old_params,
    nnx.as_pure(nnx.state(new_model, nnx.Param)),
    leaf_index={_path(k): v for k, v in plan.slices.items()},
  )
  new_opt_state = _reconfigure_opt_state(opt_state, new_model, slices)
  after = _layer_widths(new_model)
  flops_after = _flops(new_model, shape, dtype) if count_flops else (None, None)
  report = ReconfigureReport(
    channels_before=before,
    channels_after=after,
    removed_layers=sorted(k for k in before if k not in after),
    removed_branches=sorted(plan.removed),
    params_before=params_before,
    params_after=_param_count(new_model),
    flops_before=flops_before[0],
    flops_after=flops_after[0],
    train_flops_before=flops_before[1],
    train_flops_after=flops_after[1],
    input_shape=shape if count_flops else None,
    removed_branch_offset=offset,
    plan=plan,
  )
  return new_model, new_opt_state, report


def _output_shapes(model: nnx.Module, shape: tuple, dtype: Any) -> Any:
  """The shapes ``model`` returns for an input of ``shape`` and ``dtype`` (traced abstractly)."""
  graphdef, state = nnx.split(model)
  x = jax.ShapeDtypeStruct(shape, dtype)
  out = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
  return jax.tree.map(lambda a: a.shape, out)


def _check_computes(
  new: nnx.Module, shape: tuple, dtype: Any, want: Any, plan: SurgeryPlan, name: str
) -> None:
  """The reconfigured model traces with its new widths and gives the old output shapes."""
  try:
    out = _output_shapes(new, shape, dtype)
  except Exception as err:  # noqa: BLE001 - any tracing failure is the same finding
    touched = sorted({type(submodule(new, _path(k)[:-1])).__name__ for k in plan.slices})
    raise ValueError(
      f"model: the reconfigured {name} does not compute with its new widths "
      f"({type(err).__name__}: {err}); the sliced variables belong to {', '.join(touched)}: a "
      "layer that keeps a width of its own beyond in_features / out_features / num_features / "
      "feature_group_count cannot be reconfigured"
    ) from err
  if out != want:
    raise ValueError(f"model: the reconfigured model's output shape changed ({want} -> {out})")


def _check_finite(graph: ChannelGraph) -> None:
  """A NaN weight fails every ``max|w| >= threshold`` test (§4.2), so a diverged model would
  look almost entirely dead: refuse it, naming the first such layer."""
  kernels = {use.path: use.name for group in graph.groups for use in group.kernels}
  for path, name in kernels.items():
    finite = np.isfinite(np.asarray(graph.values[path]))
    if not finite.all():
      raise ValueError(
        f"model: non-finite weights in {name} ({int((~finite).sum())} of {finite.size} "
        "kernel entries NaN/Inf); a diverged model cannot be reconfigured"
      )


def _check_reconfigure_args(threshold: Any, channel_multiple: Any) -> None:
  if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
    raise ValueError(f"threshold must be a finite number >= 0, got {threshold!r}")
  if (
    not isinstance(channel_multiple, int)
    or isinstance(channel_multiple, bool)
    or channel_multiple < 1
  ):
    raise ValueError(f"channel_multiple must be an int >= 1, got {channel_multiple!r}")


def _reconfigure_opt_state(opt_state: Any, new_model: nnx.Module, slices: ChannelSlices) -> Any:
  if opt_state is None:
    return None
  if isinstance(opt_state, nnx.Optimizer):
    optimizer = opt_state
    pure = slices.slice_state(nnx.as_pure(optimizer.opt_state))
    new_optimizer = nnx.Optimizer(new_model, optimizer.tx, wrt=optimizer.wrt)
    nnx.update(new_optimizer.opt_state, nnx.state(pure))
    new_optimizer.step[...] = optimizer.step[...]
    return new_optimizer
  return slices.slice_state(opt_state)
