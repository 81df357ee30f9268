"""PruneTrain reconfiguration: shrink a group-lasso-sparsified network into a smaller dense one.

PruneTrain (Lym et al., SC'19, §4.2) periodically removes the channels that group lasso
(:mod:`jaxprune.group_lasso`) drove to zero and continues training the smaller, still dense
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
   classifier included) and every parameter-shaped optimizer-state leaf (momentum, Adam
   moments, ...) are sliced with the same index arrays; the model is rebuilt from its smaller
   width spec with ``type(model)(spec, num_classes=..., rngs=...)``.

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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxprune import flops
from jaxprune.train import Reconfigure, grow_batch_size  # noqa: F401  (grow_batch_size re-exported)
from jaxprune.train.optim import find_lr_states
from jaxprune.group_lasso import (  # noqa: F401  (re-exported for ``prunetrain.*`` users)
  GroupLassoRatioState,
  PathPredicate,
  coefficient_from_ratio,
  group_lasso,
  group_lasso_from_ratio,
  group_shrink,
  path_names,
  penalty,
  set_coefficient_once,
)

__all__ = [
  "ChannelTensor",
  "Layer",
  "PruneTrainCallback",
  "PruneTrainState",
  "ReconfigureReport",
  "channel_graph",
  "coefficient_from_ratio",
  "group_lasso",
  "group_lasso_from_ratio",
  "grow_batch_size",
  "live_channels",
  "model_costs",
  "penalty",
  "reconfigure",
  "rounded_width",
  "with_group_lasso",
]

# PruneTrain §4.1: "we use a small threshold of 1e-4 to zero out these weights".
DEFAULT_THRESHOLD = 1e-4


# ----------------------------------------------------------------------------- optimizer


class PruneTrainState(NamedTuple):
  """State of :func:`with_group_lasso`.

  Attributes:
    group_lasso: λ (set at the first update, then fixed) and whether it is set.
    inner: the wrapped optimizer's state.
    count: updates so far (the proximal step's ``learning_rate`` schedule position).
  """

  group_lasso: GroupLassoRatioState
  inner: Any
  count: Any = None


def _applied_lr(inner_state: Any) -> Optional[jax.Array]:
  """The LR the inner optimizer's :func:`jaxprune.train.scale_by_lr` just applied, if any."""
  lr_states = find_lr_states(inner_state)
  return lr_states[0].lr if lr_states else None


def with_group_lasso(
  inner: optax.GradientTransformation,
  *,
  penalty_ratio: float = 0.2,
  proximal: bool = False,
  learning_rate: Optional[optax.ScalarOrSchedule] = None,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
) -> optax.GradientTransformationExtraArgs:
  """PruneTrain's optimizer: ``inner`` with the channel group lasso λ·GL (§4.1).

  λ is computed at the first update from the loss (``value=``) and the group lasso of the
  initial params so that λ·GL₀ / (CE₀ + λ·GL₀) = ``penalty_ratio`` (Eq. 3), then fixed.
  :func:`reconfigure` slices ``inner``'s parameter-shaped state and keeps λ.

  Two ways to apply the penalty:

  * ``proximal=False`` (the paper's): ``inner`` is applied to ``grad + λ·∇GL(params)``, so
    the penalty gradient goes through ``inner`` (momentum included), as a loss term would.
    Groups then oscillate around zero with an amplitude of about lr·λ and reach the
    paper's 1e-4 threshold only after many epochs.
  * ``proximal=True`` (an extension, not in the paper): ``inner`` sees the loss gradient
    only and the new parameters are group-soft-thresholded,
    ``p ← shrink(p + u, η·λ)`` (:func:`jaxprune.group_lasso.group_shrink`), η the step's
    learning rate.  Groups reach *exactly* zero, so a reconfiguration with the paper's
    1e-4 threshold removes only channels that carry nothing, and it happens within a
    short run.  η is ``learning_rate`` when given, else the LR that ``inner``'s
    :func:`jaxprune.train.scale_by_lr` just applied (schedule and the dynamic mini-batch's
    linear scaling included: build ``inner`` with :func:`jaxprune.train.sgd`).  Momentum
    does not amplify the proximal step, so a given shrink speed needs a λ about
    1/(1 − momentum) times larger than with ``proximal=False``.

  Args:
    inner: the optimizer, e.g. ``optax.sgd(lr, momentum=0.9)``.
    penalty_ratio: group-lasso share of the initial total loss, in (0, 1); paper 0.2.
    proximal: apply the penalty as a proximal step after ``inner`` (see above).
    learning_rate: η of the proximal step (a constant or a schedule of the update count);
      only with ``proximal=True``.
    is_input_conv: see :func:`jaxprune.group_lasso.leaf_groups`.
    is_classifier: see :func:`jaxprune.group_lasso.leaf_groups`.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs ``params`` and
    ``value=loss``; other extra args are forwarded to ``inner``.

  Raises:
    ValueError: ``penalty_ratio`` outside (0, 1); ``learning_rate`` without
      ``proximal=True``; with ``proximal=True``, no ``learning_rate`` and no
      ``scale_by_lr`` in ``inner`` (raised at ``init``).

  Example::

    tx = with_group_lasso(optax.sgd(0.1, momentum=0.9), penalty_ratio=0.2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, grads, value=loss)

    # exact zeros; the step size comes from train.sgd's scale_by_lr
    tx = with_group_lasso(train.sgd(schedule, momentum=0.9), penalty_ratio=0.9, proximal=True)
  """
  if learning_rate is not None and not proximal:
    raise ValueError("learning_rate is the proximal step size: pass it with proximal=True")
  regularizer = group_lasso_from_ratio(
    penalty_ratio, is_input_conv=is_input_conv, is_classifier=is_classifier
  )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    inner_state = inner.init(params)
    if proximal and learning_rate is None and _applied_lr(inner_state) is None:
      raise ValueError(
        "learning_rate: proximal=True needs the step size; pass learning_rate or build "
        "inner with jaxprune.train.sgd / scale_by_lr"
      )
    return PruneTrainState(
      regularizer.init(params), inner_state, jnp.zeros([], jnp.int32) if proximal else None
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not proximal:
      updates, lasso_state = regularizer.update(updates, state.group_lasso, params, **extra_args)
      updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
      return updates, PruneTrainState(lasso_state, inner_state, state.count)
    # λ only: the proximal form does not add the penalty gradient.
    lasso_state = set_coefficient_once(
      state.group_lasso,
      penalty_ratio,
      params,
      extra_args.get("value"),
      is_input_conv=is_input_conv,
      is_classifier=is_classifier,
    )
    updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
    if learning_rate is None:
      step_size = _applied_lr(inner_state)
    elif callable(learning_rate):
      step_size = learning_rate(state.count)
    else:
      step_size = learning_rate
    moved = optax.apply_updates(params, updates)
    shrunk = group_shrink(
      moved,
      jnp.asarray(step_size, jnp.float32) * lasso_state.coefficient,
      is_input_conv=is_input_conv,
      is_classifier=is_classifier,
    )
    # Leaves without groups come back from group_shrink as the very same array: keep their
    # update exactly as ``inner`` made it instead of the rounded (p + u) − p.
    updates = jax.tree.map(
      lambda new, before, old, u: u if new is before else (new - old).astype(u.dtype),
      shrunk,
      moved,
      params,
      updates,
    )
    return updates, PruneTrainState(lasso_state, inner_state, state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------- graph


@dataclasses.dataclass(eq=False)
class Layer:
  """A layer whose kernel channels can be sliced: a ``ConvBN`` or an ``nnx.Linear``.

  Attributes:
    path: attribute path from the model root, e.g. ``("stages", 0, 1, "conv1")``.
    module: the module itself.
    kind: ``"conv"`` (``ConvBN``: HWIO kernel + BatchNorm) or ``"linear"`` (``(in, out)``).
  """

  path: tuple
  module: Any
  kind: str

  def kernel(self) -> np.ndarray:
    param = self.module.conv.kernel if self.kind == "conv" else self.module.kernel
    return np.asarray(param[...])

  def output_magnitude(self) -> np.ndarray:
    """max|w| of every output-channel group (PruneTrain's dead-group test)."""
    kernel = np.abs(self.kernel())
    return kernel.max(axis=(0, 1, 2)) if self.kind == "conv" else kernel.max(axis=0)

  def input_magnitude(self) -> np.ndarray:
    """max|w| of every input-channel group."""
    kernel = np.abs(self.kernel())
    return kernel.max(axis=(0, 1, 3)) if self.kind == "conv" else kernel.max(axis=1)

  @property
  def name(self) -> str:
    return "/".join(str(p) for p in self.path)


@dataclasses.dataclass(eq=False)
class ChannelTensor:
  """A set of channels shared by its writers' outputs and its readers' inputs.

  Attributes:
    name: readable name (the first writer's path, or the block's inner tensor).
    writers: layers whose output channels are these channels.
    readers: layers whose input channels are these channels.
    branch: ``(stage, block)`` if the tensor lives inside a residual branch (it may then
      shrink to zero width: the branch is removed), else None.
  """

  name: str
  writers: list[Layer] = dataclasses.field(default_factory=list)
  readers: list[Layer] = dataclasses.field(default_factory=list)
  branch: Optional[tuple[int, int]] = None

  @property
  def width(self) -> int:
    layer = self.writers[0]
    return int(layer.kernel().shape[-1])


@dataclasses.dataclass
class _Graph:
  tensors: list[ChannelTensor]
  # (stage, block) -> the branch's layers, for residual models.
  branches: dict[tuple[int, int], list[Layer]]


def _branch_layers(block: Any) -> list[Any]:
  """``conv1, conv2, ...`` of a residual block, in order (empty if the branch was removed)."""
  layers = []
  index = 1
  while hasattr(block, f"conv{index}"):
    layer = getattr(block, f"conv{index}")
    if layer is None:
      return []
    layers.append(layer)
    index += 1
  return layers


def _is_residual_model(model: Any) -> bool:
  return all(hasattr(model, name) for name in ("stem", "stages", "head"))


def _is_chain_model(model: Any) -> bool:
  return all(hasattr(model, name) for name in ("features", "classifier"))


def channel_graph(model: nnx.Module) -> list[ChannelTensor]:
  """The channel tensors of a model, found by walking its module tree.

  Args:
    model: a :class:`jaxprune.models.ResNet` or :class:`jaxprune.models.VGG` (or any module
      with the same attributes: ``stem``/``stages``/``head`` of residual blocks with
      ``conv1..convN`` and ``shortcut``, or ``features``/``classifier``).

  Returns:
    Every channel tensor, in execution order.

  Raises:
    ValueError: the model has neither structure.
  """
  return _build_graph(model).tensors


def _build_graph(model: nnx.Module) -> _Graph:
  if _is_residual_model(model):
    return _residual_graph(model)
  if _is_chain_model(model):
    return _chain_graph(model)
  raise ValueError(
    f"model must be a residual (stem/stages/head) or chain (features/classifier) network, "
    f"got {type(model).__name__}"
  )


def _residual_graph(model: nnx.Module) -> _Graph:
  stream = ChannelTensor("stem", writers=[Layer(("stem",), model.stem, "conv")])
  tensors = [stream]
  branches: dict[tuple[int, int], list[Layer]] = {}
  for s, stage in enumerate(model.stages):
    for b, block in enumerate(stage):
      prefix = ("stages", s, b)
      if block.shortcut is not None:
        # A projection starts a new stream tensor: it reads the old one, writes the new one.
        projection = Layer(prefix + ("shortcut",), block.shortcut, "conv")
        stream.readers.append(projection)
        out = ChannelTensor("/".join(map(str, prefix)), writers=[projection])
        tensors.append(out)
      else:
        out = stream  # identity shortcut: the block adds into the same tensor (§4.2 Fig. 5c)
      modules = _branch_layers(block)
      if modules:
        layers = [Layer(prefix + (f"conv{i + 1}",), m, "conv") for i, m in enumerate(modules)]
        branches[(s, b)] = layers
        stream.readers.append(layers[0])
        for first, second in zip(layers[:-1], layers[1:]):
          tensors.append(
            ChannelTensor(first.name, writers=[first], readers=[second], branch=(s, b))
          )
        out.writers.append(layers[-1])
      stream = out
  stream.readers.append(Layer(("head",), model.head, "linear"))
  return _Graph(tensors, branches)


def _chain_graph(model: nnx.Module) -> _Graph:
  tensors = []
  previous: Optional[ChannelTensor] = None
  layers = [Layer(("features", i), m, "conv") for i, m in enumerate(model.features)]
  layers += [Layer(("classifier", i), m, "linear") for i, m in enumerate(model.classifier)]
  for layer in layers:
    if previous is not None:
      previous.readers.append(layer)
    if layer is layers[-1]:
      break  # the classifier's outputs are the logits: never pruned (§4.1)
    previous = ChannelTensor(layer.name, writers=[layer])
    tensors.append(previous)
  return _Graph(tensors, {})


def live_channels(tensor: ChannelTensor, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
  """Channel union (PruneTrain §4.2): a channel lives if any writer's output group or any
  reader's input group has ``max|w| >= threshold``.

  Args:
    tensor: a channel tensor from :func:`channel_graph`.
    threshold: the dead-group threshold (absolute).

  Returns:
    A boolean vector over the tensor's channels.
  """
  alive = np.zeros(tensor.width, dtype=bool)
  for layer in tensor.writers:
    alive |= layer.output_magnitude() >= threshold
  for layer in tensor.readers:
    alive |= layer.input_magnitude() >= threshold
  return alive


# ----------------------------------------------------------------------------- report


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


# ----------------------------------------------------------------------------- slicing


def _slice_leaf(
  leaf: Any, remainder: tuple, in_index: Optional[np.ndarray], out_index: Optional[np.ndarray]
) -> Any:
  """Slice one variable of a layer.  ``remainder`` is its path inside the layer.

  Done in NumPy on the host: an eager ``jnp.take`` would compile one gather per shape.
  """
  ndim = np.ndim(leaf)
  if remainder[-1:] == ("kernel",) and ndim in (2, 4):
    in_axis, out_axis = (2, 3) if ndim == 4 else (0, 1)
    leaf = np.asarray(leaf)
    if in_index is not None:
      leaf = np.take(leaf, in_index, axis=in_axis)
    if out_index is not None:
      leaf = np.take(leaf, out_index, axis=out_axis)
    return leaf
  if ndim == 1 and out_index is not None:  # conv BN scale/bias/mean/var, linear bias
    return np.take(np.asarray(leaf), out_index, axis=0)
  return leaf


class _Slicer:
  """Maps old variable paths to new values with the kept-index arrays of every layer."""

  def __init__(self, index: dict[tuple, tuple[Optional[np.ndarray], Optional[np.ndarray]]]):
    self.index = index

  def __call__(self, names: tuple, leaf: Any) -> Any:
    for length in range(len(names) - 1, 0, -1):
      indices = self.index.get(names[:length])
      if indices is not None:
        return _slice_leaf(leaf, names[length:], *indices)
    return leaf


def _flat_by_names(tree: Any) -> dict[tuple, Any]:
  return {path_names(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _rebuild_like(template: Any, old: Any, slicer: _Slicer) -> Any:
  """A tree of ``template``'s structure whose leaves are ``old``'s, sliced."""
  old_flat = _flat_by_names(old)

  def fill(path, template_leaf):
    names = path_names(path)
    if names not in old_flat:
      raise ValueError(f"no value for {'/'.join(map(str, names))} in the old state")
    old_leaf = old_flat[names]
    value = slicer(names, old_leaf)
    if value is old_leaf and np.shape(value) == np.shape(template_leaf):
      return old_leaf  # untouched (also RNG keys, which have no plain dtype)
    if np.shape(value) != np.shape(template_leaf):
      raise ValueError(
        f"{'/'.join(map(str, names))}: sliced shape {np.shape(value)} != "
        f"rebuilt model's {np.shape(template_leaf)}"
      )
    return jnp.asarray(value, dtype=template_leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, template)


def _map_param_subtrees(opt_state: Any, old_params: Any, new_params: Any, slicer: _Slicer) -> Any:
  """Replace every sub-tree of ``opt_state`` shaped like ``old_params`` by its sliced copy.

  Optax states hold per-parameter statistics as trees with the params' structure (what
  ``optax.tree_map_params`` relies on); everything else (step counts, PruneTrain's λ) is kept.
  """
  old_def = jax.tree.structure(old_params)
  old_shapes = [np.shape(x) for x in jax.tree.leaves(old_params)]

  def is_param_tree(node):
    if jax.tree.structure(node) != old_def:
      return False
    return [np.shape(x) for x in jax.tree.leaves(node)] == old_shapes

  def convert(node):
    return _rebuild_like(new_params, node, slicer) if is_param_tree(node) else node

  return jax.tree.map(convert, opt_state, is_leaf=is_param_tree)


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


def _bn_zero_input_offset(layer: Layer) -> float:
  """|BN(0)| per channel in eval mode: β − γ·μ/√(σ²+ε) (what a dead branch still adds)."""
  bn = layer.module.bn
  mean = np.asarray(bn.mean[...])
  var = np.asarray(bn.var[...])
  scale = np.asarray(bn.scale[...]) if bn.scale is not None else 1.0
  bias = np.asarray(bn.bias[...]) if bn.bias is not None else 0.0
  offset = bias - scale * mean / np.sqrt(var + bn.epsilon)
  return float(np.max(np.abs(offset))) if np.size(offset) else 0.0


def _new_spec(
  model: nnx.Module, graph: _Graph, keep: dict[int, np.ndarray], removed: set[tuple[int, int]]
) -> Any:
  spec = model.spec
  if _is_chain_model(model):
    widths = [len(keep[id(t)]) for t in graph.tensors]
    n_conv = len(model.features)
    return dataclasses.replace(spec, widths=tuple(widths[:n_conv]), hidden=tuple(widths[n_conv:]))
  # Residual: one width per stream tensor; look it up through the layers writing it.
  width_of_writer = {}
  for tensor in graph.tensors:
    for layer in tensor.writers:
      width_of_writer[layer.path] = len(keep[id(tensor)])
  stem_width = width_of_writer[("stem",)]
  stages = []
  width = stem_width
  for s, stage in enumerate(spec.stages):
    blocks = []
    for b, block in enumerate(stage.blocks):
      prefix = ("stages", s, b)
      module = model.stages[s][b]
      if module.shortcut is not None:
        width = width_of_writer[prefix + ("shortcut",)]
      if (s, b) in removed or block.widths is None:
        widths = None
      else:
        layers = graph.branches[(s, b)]
        widths = tuple(width_of_writer[layer.path] for layer in layers[:-1])
      blocks.append(dataclasses.replace(block, widths=widths))
    stages.append(dataclasses.replace(stage, width=width, blocks=tuple(blocks)))
  return dataclasses.replace(spec, stem_width=stem_width, stages=tuple(stages))


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
      like the params is sliced; other leaves (counts, PruneTrain's λ) are kept.
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
      experiments/results/prunetrain_table1_resnet32_budget.json --channel-multiple 8``,
      2026-11-22).
      Dead residual branches are still removed.

  Returns:
    ``(new_model, new_opt_state, report)``; ``new_model`` is a fresh module built from the
    smaller ``spec``; ``report`` is a :class:`ReconfigureReport`.

  Raises:
    ValueError: negative / non-finite ``threshold``, an unsupported model, or an optimizer
      state that does not match the model's params.
  """
  _check_reconfigure_args(threshold, channel_multiple)
  if not hasattr(model, "spec"):
    raise ValueError(f"model must carry a width spec (model.spec), got {type(model).__name__}")
  graph = _build_graph(model)

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
    if channel_multiple > 1:
      live = _round_up_live(tensor, live, channel_multiple)
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
  slicer = _Slicer({path: tuple(value) for path, value in index.items()})

  # 4. Rebuild from the smaller spec and move every variable over.
  new_spec = _new_spec(model, graph, keep, removed)
  # Built abstractly (no initialisation is run, nothing compiles): every variable is then
  # filled from the old model.
  new_model = nnx.eval_shape(
    lambda: type(model)(new_spec, num_classes=model.num_classes, rngs=nnx.Rngs(0))
  )
  new_model.train()
  nnx.update(
    new_model,
    _rebuild_like(nnx.as_pure(nnx.state(new_model)), nnx.as_pure(nnx.state(model)), slicer),
  )
  if _is_eval_mode(model):
    new_model.eval()

  new_opt_state = _reconfigure_opt_state(opt_state, model, new_model, slicer)

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


def _all_layers(graph: _Graph) -> list[Layer]:
  seen: dict[tuple, Layer] = {}
  for tensor in graph.tensors:
    for layer in tensor.writers + tensor.readers:
      seen.setdefault(layer.path, layer)
  return list(seen.values())


def _reconfigure_opt_state(
  opt_state: Any, model: nnx.Module, new_model: nnx.Module, slicer: _Slicer
) -> Any:
  if opt_state is None:
    return None
  old_params = nnx.as_pure(nnx.state(model, nnx.Param))
  new_params = nnx.as_pure(nnx.state(new_model, nnx.Param))
  if isinstance(opt_state, nnx.Optimizer):
    optimizer = opt_state
    pure = _map_param_subtrees(nnx.as_pure(optimizer.opt_state), old_params, new_params, slicer)
    new_optimizer = nnx.Optimizer(new_model, optimizer.tx, wrt=optimizer.wrt)
    nnx.update(new_optimizer.opt_state, nnx.state(pure))
    new_optimizer.step[...] = optimizer.step[...]
    return new_optimizer
  return _map_param_subtrees(opt_state, old_params, new_params, slicer)


# ----------------------------------------------------------------------------- training loop


def model_costs(
  model: nnx.Module, image_shape: Sequence[int], *, num_devices: int = 4
) -> dict[str, float]:
  """Per-image and per-step costs of a model (PruneTrain §5 Tab. 1, Fig. 8, Fig. 11).

  Uses :mod:`jaxprune.flops` (one trace of the forward pass; no compilation).

  Args:
    model: an NNX model.
    image_shape: one image, e.g. ``(32, 32, 3)``.
    num_devices: devices of the ring all-reduce model.

  Returns:
    ``inference_flops`` and ``train_flops`` per image, ``bn_bytes`` (BatchNorm training
    traffic per image), ``allreduce_bytes`` (bytes each device sends per step, ring
    all-reduce of all gradients) and ``params``.
  """
  shape = (1, *tuple(image_shape))
  layers, traffic = flops.layer_flops_and_batchnorm_traffic(model, shape)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  return {
    "inference_flops": float(flops.inference_flops(layers)),
    "train_flops": float(flops.training_flops_per_step(layers)),
    "bn_bytes": float(sum(t.training_bytes for t in traffic)),
    "allreduce_bytes": float(flops.allreduce_bytes(params, num_devices)),
    "params": float(_param_count(model)),
  }


class PruneTrainCallback(Reconfigure):
  """Trainer hook: reconfigure every k epochs, grow the mini-batch, account the costs.

  For :class:`jaxprune.train.Trainer` (``callbacks=[PruneTrainCallback(...)]``).  A
  :class:`jaxprune.train.Reconfigure` running :func:`reconfigure`: at the end of every
  ``every_epochs``-th epoch it reconfigures the trainer's model and optimizer state and
  installs the result when channels were removed (§4.2; the paper reconfigures every 10
  epochs on CIFAR, 5 on ImageNet).  With ``dynamic_batch`` it then grows the batch in steps
  of ``granularity`` while the compiled step's memory (XLA ``memory_analysis``) stays within
  what the dense step needed, and scales the LR by the same ratio (§4.3; the trainer
  applies both from the next epoch).  Its entries carry a ``pt_`` prefix
  (``pt_reconfigured``, ``pt_next_batch_size``, ...).

  Every epoch's record gets the costs of the model that trained it (``jaxprune.flops``):
  training FLOPs integrated over the run and the same for the dense model
  (``pt_train_flops`` / ``pt_dense_train_flops``), inference FLOPs per image, BatchNorm
  traffic and ring all-reduce bytes per epoch, parameter count, and the reconfiguration
  summary when one happened.

  Args:
    every_epochs: reconfiguration interval in epochs.
    threshold: dead-group threshold (absolute max|w|).
    image_shape: one training image, e.g. ``(32, 32, 3)``.
    dynamic_batch: grow the batch after a reconfiguration.
    granularity: batch growth step (paper: 32).
    max_batch_size: cap on the batch size (e.g. the training-set size).
    num_devices: devices of the ring all-reduce cost model (paper Fig. 11 uses 4 GPUs).
    channel_multiple: passed to :func:`reconfigure` (round kept channel counts up).
    min_flops_saving: install a reconfiguration only when it cuts the inference FLOPs by at
      least this fraction (0 = whenever a channel died, as in the paper).  Each installed
      reconfiguration recompiles the step (and, with ``dynamic_batch``, compiles it again per
      memory probe), which on a 2-core CPU costs about 25 training steps of ResNet-32 at batch
      64 (15–17 s): a few dead channels are not worth it.  Skipped dead channels stay in the
      model (zero or near zero) and go at the next reconfiguration that is worth installing.

  Example::

    callback = PruneTrainCallback(every_epochs=10, image_shape=(32, 32, 3))
    trainer = Trainer(model, with_group_lasso(train.sgd(schedule)), callbacks=[callback])
  """

  def __init__(
    self,
    *,
    every_epochs: int = 10,
    threshold: float = DEFAULT_THRESHOLD,
    image_shape: Sequence[int] = (32, 32, 3),
    dynamic_batch: bool = True,
    granularity: int = 32,
    max_batch_size: Optional[int] = None,
    num_devices: int = 4,
    channel_multiple: int = 1,
    min_flops_saving: float = 0.0,
  ):
    # checked here too, so a bad value fails when the callback is built, not epochs later
    _check_reconfigure_args(threshold, channel_multiple)
    if not 0.0 <= min_flops_saving < 1.0:
      raise ValueError(f"min_flops_saving must be in [0, 1), got {min_flops_saving!r}")
    if not isinstance(every_epochs, int) or every_epochs < 1:
      raise ValueError(f"every_epochs must be a positive int, got {every_epochs!r}")
    if num_devices < 1:
      raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    # FLOPs are counted here, not by reconfigure: the old model's costs are already known
    # and the new model's are traced once, for the report and the accounting together.
    self._reconfigure_model = functools.partial(
      reconfigure, threshold=threshold, count_flops=False, channel_multiple=channel_multiple
    )
    self._new_costs: Optional[dict[str, float]] = None
    super().__init__(
      self._reconfigure,
      every_epochs,
      image_shape=tuple(image_shape),
      grow_batch=dynamic_batch,
      granularity=granularity,
      max_batch_size=max_batch_size,
      report_metrics=_report_metrics,
      changed=self._worth,
    )
    self.min_flops_saving = float(min_flops_saving)
    self.threshold = threshold
    self.dynamic_batch = dynamic_batch
    self.num_devices = num_devices
    self._state: dict[str, Any] = {
      "batch_size": None,
      "last_step": 0,
      "costs": None,
      "dense_costs": None,
      "train_flops": 0.0,
      "dense_train_flops": 0.0,
      "images": 0,
      "bn_bytes": 0.0,
      "allreduce_bytes": 0.0,
      "dense_allreduce_bytes": 0.0,
    }

  def _reconfigure(self, model: nnx.Module, opt_state: Any) -> tuple[nnx.Module, Any, Any]:
    """:func:`reconfigure` with the report's FLOPs filled in from :func:`model_costs`."""
    new_model, new_opt_state, report = self._reconfigure_model(model, opt_state)
    old = self._state["costs"]
    if old is None:  # called before any epoch was accounted
      old = model_costs(model, self.image_shape, num_devices=self.num_devices)
    new = old
    if report.changed:
      new = model_costs(new_model, self.image_shape, num_devices=self.num_devices)
    self._new_costs = new
    report = dataclasses.replace(
      report,
      flops_before=round(old["inference_flops"]),
      flops_after=round(new["inference_flops"]),
      train_flops_before=round(old["train_flops"]),
      train_flops_after=round(new["train_flops"]),
      input_shape=(1, *self.image_shape),
    )
    return new_model, new_opt_state, report

  def _worth(self, report: ReconfigureReport) -> bool:
    """Install ``report``'s model? Something died and the FLOP saving is big enough."""
    if not report.changed:
      return False
    if self.min_flops_saving == 0.0 or report.flops_ratio is None:
      return True
    return 1.0 - report.flops_ratio >= self.min_flops_saving

  # Trainer callback protocol (jaxprune.train.Callback) -----------------------------
  def state_dict(self) -> dict[str, Any]:
    return {**self._state, **super().state_dict()}

  def load_state_dict(self, state: Any) -> None:
    state = dict(state)
    super().load_state_dict(state)
    state.pop("budget_bytes", None)
    self._state.update(state)

  def on_epoch_end(self, trainer: Any, epoch: int) -> dict[str, Any]:
    record = self._account(trainer)
    hooked = super().on_epoch_end(trainer, epoch)
    if hooked is None:
      return record
    record.update({f"pt_{key}": value for key, value in hooked.items()})
    if hooked["reconfigured"]:
      new_model = trainer.model
      costs = self._state["costs"] = self._new_costs
      record.update(
        {
          "pt_inference_flops_after": costs["inference_flops"],
          "pt_params_after": costs["params"],
          "pt_spec": repr(new_model.spec),
        }
      )
    if "next_batch_size" in hooked:
      self._state["batch_size"] = hooked["next_batch_size"]
    return record

  def _account(self, trainer: Any) -> dict[str, Any]:
    """Adds the epoch just trained to the running cost totals; returns its record entries."""
    state = self._state
    if state["costs"] is None:
      state["costs"] = model_costs(trainer.model, self.image_shape, num_devices=self.num_devices)
      state["dense_costs"] = dict(state["costs"])
    if state["batch_size"] is None:
      state["batch_size"] = int(trainer.reference_batch_size)
    reference = int(trainer.reference_batch_size or state["batch_size"])
    costs, dense = state["costs"], state["dense_costs"]
    steps = trainer.step - state["last_step"]
    images = steps * state["batch_size"]
    state["last_step"] = trainer.step
    state["images"] += images
    state["train_flops"] += costs["train_flops"] * images
    state["dense_train_flops"] += dense["train_flops"] * images
    state["bn_bytes"] += costs["bn_bytes"] * images
    state["allreduce_bytes"] += costs["allreduce_bytes"] * steps
    state["dense_allreduce_bytes"] += dense["allreduce_bytes"] * images / reference
    return {
      "pt_params": costs["params"],
      "pt_inference_flops": costs["inference_flops"],
      "pt_train_flops": state["train_flops"],
      "pt_dense_train_flops": state["dense_train_flops"],
      "pt_train_flops_ratio": state["train_flops"] / max(state["dense_train_flops"], 1.0),
      "pt_bn_bytes": state["bn_bytes"],
      "pt_epoch_allreduce_bytes": costs["allreduce_bytes"] * steps,
      "pt_allreduce_ratio": state["allreduce_bytes"] / max(state["dense_allreduce_bytes"], 1.0),
    }


def _report_metrics(report: ReconfigureReport) -> dict[str, Any]:
  """Record entries of an installed reconfiguration (``pt_``-prefixed later)."""
  return {
    "channels_removed": sum(report.channels_removed.values()),
    "layers_removed": len(report.removed_layers),
  }
