"""PruneTrain reconfiguration: shrink a group-lasso-sparsified network into a smaller dense one.

PruneTrain (Lym et al., SC'19, §4.2) periodically removes the channels that group lasso
(:mod:`jaxprune.prunetrain.group_lasso`) drove to zero and continues training the smaller, still dense
model; parameter momentums of the remaining channels "are kept as is".  Here that happens
on the host, outside ``jit``:

1. The model's *channel tensors* are found by walking its module tree (never from
   per-model tables): every tensor has *writers* (layers whose output channels produce it)
   and *readers* (layers whose input channels consume it).  A residual stage's stream is one
   tensor with every block's last branch conv and projection shortcut as writers and every
   block's first branch conv, the next projection and the head as readers.
2. A channel is dead when every writer's output group and every reader's input group has
   ``max|w| < threshold`` — the *channel union* of §4.2 (Fig. 5c): only channels dead in
   all neighbours are removed, so no gather/scatter is needed at merge points.
3. A residual branch with a zero-width inner tensor is removed (§4.1 "layer removal": the
   block then computes ``relu(shortcut(x))``).
4. Kernels, BatchNorm scale / bias / running stats, the readers' input channels (the
   classifier included), every parameter-shaped optimizer-state leaf (momentum, Adam
   moments, ...) and every optimizer state with a registered slicer (ClickTrain's masks and
   scores; :func:`jaxprune.state_slicing.register_state_slicer`) are sliced with the same index
   arrays (:mod:`jaxprune.state_slicing`). The model's spec gives its smaller self
   (``spec.with_widths``) and :func:`jaxprune.models.rebuild` builds it, re-applying the
   conversions the model carries (an SDGP-converted model stays converted, keys included).

Supported: :class:`jaxprune.models.ResNet` (basic and bottleneck blocks, projection or
identity shortcuts: He et al. CIFAR, ClickTrain and ImageNet variants) and
:class:`jaxprune.models.VGG` (both classifier variants; hidden ``Linear`` units are pruned
too).

The new model computes the same function as the old one with the removed channels' weights
set to zero, with one exception: a removed branch also drops the constant its last
BatchNorm emits for a zero input (``β − γ·μ/√(σ²+ε)`` per channel).  The report records the
largest such constant as ``removed_branch_offset`` (it is zero when the branch's BatchNorm
shift has decayed too).

:class:`PruneTrainCallback` runs all this inside :class:`jaxprune.train.Trainer` every k
epochs, grows the mini-batch into the memory freed (§4.3) and accounts the training cost.

Example::

  tx = optax.chain(group_lasso_from_ratio(0.2), optax.sgd(0.1, momentum=0.9))
  opt_state = tx.init(nnx.as_pure(nnx.state(model, nnx.Param)))
  ...  # train 10 epochs
  model, opt_state, report = reconfigure(model, opt_state)
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
from jaxprune.prunetrain.graph import (
  DEFAULT_THRESHOLD,
  ChannelTensor,
  SliceableLayer,
  _Graph,
  _build_graph,
  live_channels,
)
from jaxprune.state_slicing import ChannelSlices

__all__ = ["ReconfigureReport", "reconfigure", "rounded_width"]


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


def _default_input_shape(spec: Any) -> tuple[int, ...]:
  size = 224 if getattr(spec, "stem_pool", False) else 32
  return (1, size, size, getattr(spec, "in_channels", 3))


def _param_count(model: nnx.Module) -> int:
  return int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _flops(model: nnx.Module, input_shape: tuple[int, ...]) -> tuple[int, int]:
  layers = flops.layer_flops(model, input_shape)
  return flops.inference_flops(layers), flops.training_flops_per_step(layers)


def _bn_zero_input_offset(layer: SliceableLayer) -> float:
  """|BN(0)| per channel in eval mode: β − γ·μ/√(σ²+ε) (what a dead branch still adds)."""
  bn = layer.module.bn
  mean = np.asarray(bn.mean[...])
  var = np.asarray(bn.var[...])
  scale = np.asarray(bn.scale[...]) if bn.scale is not None else 1.0
  bias = np.asarray(bn.bias[...]) if bn.bias is not None else 0.0
  offset = bias - scale * mean / np.sqrt(var + bn.epsilon)
  return float(np.max(np.abs(offset))) if np.size(offset) else 0.0


def _new_widths(graph: _Graph, keep: dict[int, np.ndarray]) -> dict[str, int]:
  """The kept width of every layer writing a surviving tensor, by layer path."""
  return {
    layer.name: len(keep[id(tensor)])
    for tensor in graph.tensors
    if id(tensor) in keep
    for layer in tensor.writers
  }


def reconfigure(
  model: nnx.Module,
  opt_state: Any = None,
  *,
  threshold: float = DEFAULT_THRESHOLD,
  input_shape: Optional[Sequence[int]] = None,
  count_flops: bool = True,
  channel_multiple: int = 1,
):
  """Removes dead channels and dead residual branches (PruneTrain §4.2).

  Args:
    model: a ResNet or VGG from :mod:`jaxprune.models` (train or eval mode; kept).
    opt_state: the optimizer state over ``nnx.as_pure(nnx.state(model, nnx.Param))`` (what
      :mod:`jaxprune.train` and ``nnx.Optimizer.update`` pass to Optax), or an
      ``nnx.Optimizer`` (a new one is returned, same ``tx``), or None.  Every sub-tree shaped
      like the params and every state with a registered slicer is sliced; other leaves
      (counts, PruneTrain's λ) are kept.
    threshold: a group is dead when ``max|w| < threshold`` (absolute; paper: 1e-4).
    input_shape: input shape for the FLOPs in the report; default one 32x32 image (224x224
      for ImageNet specs).
    count_flops: set False to skip the FLOPs tracing.
    channel_multiple: round every kept channel count up to a multiple of this (capped at
      the current width) by keeping the strongest dead channels as well. Not in the paper:
      convolutions run faster at channel counts that fill the vector width; on a 2-core CPU
      a reduced-budget ResNet-32 run's final model (widths 3–35) took 0.62x the dense step
      for 0.33x the FLOPs, and 0.60x with its widths rounded up to multiples of 8 (0.43x
      the FLOPs; ``python -m experiments.run prunetrain_speed --run
      experiments/results/prunetrain/probes/table1_subset_resnet32.json --channel-multiple 8``,
      2026-11-22).
      Dead residual branches are still removed. A converted model's own multiple
      (``jaxprune.models.channel_multiple``, e.g. SDGP's ``m``) is always honoured.

  Returns:
    ``(new_model, new_opt_state, report)``; ``new_model`` is a fresh module built from the
    smaller ``spec``; ``report`` is a :class:`ReconfigureReport`.

  Raises:
    ValueError: negative / non-finite ``threshold``, an unsupported model, a model with
      non-finite kernel weights (the first such layer is named), or an optimizer state that does
      not match the model's params.
  """
  _check_reconfigure_args(threshold, channel_multiple)
  if not hasattr(model, "spec"):
    raise ValueError(f"model must carry a width spec (model.spec), got {type(model).__name__}")
  graph = _build_graph(model)
  _check_finite(graph)
  # A conversion may need every width to stay a multiple of something (SDGP: m).
  multiple = math.lcm(channel_multiple, models.channel_multiple(model))

  # 1. Residual branches with a zero-width inner tensor go (§4.1 layer removal).  Decided
  #    first: a removed branch neither reads nor writes its stage's stream any more.
  alive = {}
  removed: set[tuple[int, int]] = set()
  for tensor in graph.tensors:
    if tensor.branch is not None:
      alive[id(tensor)] = live_channels(tensor, threshold)
      if not alive[id(tensor)].any():
        removed.add(tensor.branch)
  removed_layers = {layer.path for key in removed for layer in graph.branches[key]}
  for tensor in graph.tensors:
    tensor.writers = [l for l in tensor.writers if l.path not in removed_layers]
    tensor.readers = [l for l in tensor.readers if l.path not in removed_layers]

  # 2. Channel union over the remaining writers and readers of every tensor.
  keep: dict[int, np.ndarray] = {}
  for tensor in graph.tensors:
    if tensor.branch in removed:
      continue
    if tensor.branch is None or id(tensor) not in alive:
      live = live_channels(tensor, threshold)
    else:
      live = alive[id(tensor)]
    if not live.any():
      # A stream / chain tensor cannot vanish: keep its strongest channel.
      strength = np.max([l.output_magnitude() for l in tensor.writers], axis=0)
      live = np.zeros_like(live)
      live[int(np.argmax(strength))] = True
    if multiple > 1:
      live = _round_up_live(tensor, live, multiple)
    keep[id(tensor)] = np.flatnonzero(live)

  # 3. Kept input / output indices per layer.
  index: dict[tuple, list] = {}
  for tensor in graph.tensors:
    if id(tensor) not in keep:
      continue
    for layer in tensor.writers:
      index.setdefault(layer.path, [None, None])[1] = keep[id(tensor)]
    for layer in tensor.readers:
      index.setdefault(layer.path, [None, None])[0] = keep[id(tensor)]

  # 4. Rebuild from the smaller spec (the model's own spec says how its widths change;
  #    models.rebuild re-applies conversions such as SDGP's) and move every variable over.
  new_spec = model.spec.with_widths(
    _new_widths(graph, keep), removed_blocks=[f"stages/{s}/{b}" for s, b in removed]
  )
  # Built abstractly (no initialisation is run, nothing compiles): every variable is then
  # filled from the old model, conversion state (e.g. SDGP's keys) included.
  new_model = nnx.eval_shape(lambda: models.rebuild(model, new_spec))
  new_model.train()
  slices = ChannelSlices(
    {path: tuple(value) for path, value in index.items()},
    nnx.as_pure(nnx.state(model, nnx.Param)),
    nnx.as_pure(nnx.state(new_model, nnx.Param)),
  )
  nnx.update(
    new_model,
    slices.rebuild_like(nnx.as_pure(nnx.state(new_model)), nnx.as_pure(nnx.state(model))),
  )
  if _is_eval_mode(model):
    new_model.eval()

  new_opt_state = _reconfigure_opt_state(opt_state, new_model, slices)

  # 5. Report.
  before = {l.name: int(l.kernel().shape[-1]) for l in _all_layers(_build_graph(model))}
  after = {l.name: int(l.kernel().shape[-1]) for l in _all_layers(_build_graph(new_model))}
  offset = max((_bn_zero_input_offset(graph.branches[key][-1]) for key in removed), default=0.0)
  shape = tuple(input_shape) if input_shape is not None else _default_input_shape(model.spec)
  flops_before = flops_after = train_before = train_after = None
  if count_flops:
    flops_before, train_before = _flops(model, shape)
    flops_after, train_after = _flops(new_model, shape)
  report = ReconfigureReport(
    channels_before=before,
    channels_after=after,
    removed_layers=sorted("/".join(map(str, p)) for p in removed_layers),
    removed_branches=sorted(f"stages/{s}/{b}" for s, b in removed),
    params_before=_param_count(model),
    params_after=_param_count(new_model),
    flops_before=flops_before,
    flops_after=flops_after,
    train_flops_before=train_before,
    train_flops_after=train_after,
    input_shape=shape if count_flops else None,
    removed_branch_offset=offset,
  )
  return new_model, new_opt_state, report


def _check_finite(graph: _Graph) -> None:
  """A NaN weight fails every ``max|w| >= threshold`` test (§4.2), so a diverged model would
  look almost entirely dead: refuse it, naming the first such layer (in graph order)."""
  for layer in _all_layers(graph):
    finite = np.isfinite(layer.kernel())
    if not finite.all():
      raise ValueError(
        f"model: non-finite weights in {layer.name} ({int((~finite).sum())} of {finite.size} "
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


def rounded_width(width: int, multiple: int, cap: int) -> int:
  """``width`` rounded up to a multiple of ``multiple``, at most ``cap`` (the width it was
  pruned from): the width :func:`reconfigure` keeps with ``channel_multiple=multiple``."""
  return min(cap, -(-width // multiple) * multiple)


def _round_up_live(tensor: ChannelTensor, live: np.ndarray, multiple: int) -> np.ndarray:
  """``live`` plus the strongest dead channels, up to a multiple of ``multiple`` channels."""
  count = int(live.sum())
  target = rounded_width(count, multiple, tensor.width)
  if target == count:
    return live
  strength = np.max(
    [l.output_magnitude() for l in tensor.writers] + [l.input_magnitude() for l in tensor.readers],
    axis=0,
  )
  dead = np.flatnonzero(~live)
  # strongest first; ties to the lower index (stable sort of the negated strength)
  revived = dead[np.argsort(-strength[dead], kind="stable")[: target - count]]
  live = live.copy()
  live[revived] = True
  return live


def _all_layers(graph: _Graph) -> list[SliceableLayer]:
  seen: dict[tuple, SliceableLayer] = {}
  for tensor in graph.tensors:
    for layer in tensor.writers + tensor.readers:
      seen.setdefault(layer.path, layer)
  return list(seen.values())


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
