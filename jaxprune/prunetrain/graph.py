"""The channel graph of any Flax NNX model, traced from its forward pass (PruneTrain §4.2).

PruneTrain removes a channel only where every layer that writes it and every layer that reads
it agrees it is dead (the *channel union*, §4.2 Fig. 5c). Which layers those are is read off
the model's jaxpr (:func:`jax.make_jaxpr` of ``model(x)``), not off its module tree, so a model
the library did not build is handled like one it did: every axis of every value is joined with
the axes it must stay in step with (a conv's input with its kernel's input axis, the two sides
of a residual add, a BatchNorm's statistics with its input's channels, a flattened feature map
with its Linear's rows, ...; the rules are in :mod:`jaxprune.prunetrain._channel_trace`). Each
resulting class that a conv or dense kernel produces or consumes is a :class:`ChannelGroup`:
the variables and axes that must be sliced together when one of its channels goes.

A group is *blocked* (never pruned) when it meets the model's input or output, when a
statistic is taken over its channels (LayerNorm: removing a channel changes the others'
normalisation), or when an operation the graph cannot follow touches it; the reason names the
operation, so nothing is silently pruned into a different function.

A module may declare a *removable branch* (PruneTrain §4.1 layer removal): it has
``branch_names`` (the attribute names of its branch's layers) and ``remove_branch()`` (after
which it computes what it computed with a zero branch output). A group that lies wholly inside
such a branch may then die entirely, taking the branch with it; the library's residual blocks
declare theirs. Any other group keeps at least one channel.

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional, Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.flops._trace import _input_flows, _trace, _Walker
from jaxprune.paths import ParamPath, flatten_with_paths
from jaxprune.prunetrain._channel_trace import _ChannelWalker

__all__ = [
  "DEFAULT_THRESHOLD",
  "ChannelGraph",
  "ChannelGroup",
  "ChannelUse",
  "RemovableBranch",
  "channel_graph",
  "default_input_shape",
  "live_channels",
]

# PruneTrain §4.1: "we use a small threshold of 1e-4 to zero out these weights".
DEFAULT_THRESHOLD = 1e-4


@dataclasses.dataclass(frozen=True)
class ChannelUse:
  """One axis of one model variable that carries a group's channels.

  Attributes:
    path: the variable's path, e.g. ``("features", 0, "conv", "kernel")``.
    axis: the axis of the variable.
    coords: the group's channel at each position of the axis (-1: the position belongs to
      another group concatenated on the same axis); a flattened axis repeats each channel.
    kernel: whether the variable is a conv / dense kernel (its groups decide liveness).
  """

  path: ParamPath
  axis: int
  coords: np.ndarray = dataclasses.field(repr=False, compare=False)
  kernel: bool

  @property
  def name(self) -> str:
    return "/".join(map(str, self.path))


@dataclasses.dataclass(eq=False)
class ChannelGroup:
  """Channels that are pruned together, and every variable axis they run through.

  Attributes:
    name: the first kernel that produces the group (``path[axis]``).
    width: number of channels.
    uses: every variable axis carrying the channels.
    blocked: why the group cannot be pruned (empty when it can).
    branch: path of the module whose removable branch holds the whole group, or None.
    values: the model's variables by path, as traced (the graph's :attr:`ChannelGraph.values`).
  """

  name: str
  width: int
  uses: tuple[ChannelUse, ...]
  blocked: tuple[str, ...]
  branch: Optional[ParamPath]
  values: dict = dataclasses.field(repr=False, default_factory=dict)

  @property
  def prunable(self) -> bool:
    return not self.blocked and self.width > 1 and any(u.kernel for u in self.uses)

  @property
  def kernels(self) -> tuple[ChannelUse, ...]:
    return tuple(u for u in self.uses if u.kernel)

  def magnitude(self, exclude: Sequence[ParamPath] = ()) -> np.ndarray:
    """max|w| of every channel over the group's kernels (PruneTrain's dead-group test).

    Kernels under a path prefix in ``exclude`` are left out.
    """
    out = np.zeros(self.width, np.float32)
    for use in self.kernels:
      if under(use.path, exclude):
        continue
      value = np.abs(np.asarray(self.values[use.path], np.float32))
      other = tuple(a for a in range(value.ndim) if a != use.axis)
      per_position = value.max(axis=other) if other else value
      valid = use.coords >= 0
      np.maximum.at(out, use.coords[valid], per_position[valid])
    return out


@dataclasses.dataclass
class ChannelGraph:
  """The channel groups of a model (see the module docstring).

  Attributes:
    groups: every group that a kernel produces or consumes, prunable or blocked.
    branches: path of every module declaring a removable branch -> its layers' paths.
    conv_groups: conv kernel path -> the groups axis group of a grouped conv.
    input_shape: the input the forward pass was traced for.
    values: every variable of the model (parameters and other state) by path, as traced.
    input_dtype: the dtype of that input (float32 images, int32 token ids, ...).
  """

  groups: list[ChannelGroup]
  branches: dict[ParamPath, tuple[ParamPath, ...]]
  conv_groups: dict[ParamPath, ChannelGroup]
  input_shape: tuple[int, ...]
  values: dict[ParamPath, Any] = dataclasses.field(repr=False, default_factory=dict)
  input_dtype: Any = np.dtype(np.float32)

  @property
  def prunable(self) -> list[ChannelGroup]:
    return [g for g in self.groups if g.prunable]

  @property
  def blocked(self) -> list[ChannelGroup]:
    return [g for g in self.groups if g.blocked and g.width > 1]

  def unfollowed(self) -> dict[str, list[str]]:
    """Operation the graph could not follow -> the groups it blocks."""
    out: dict[str, list[str]] = {}
    for group in self.blocked:
      if any(r.startswith("fixed") for r in group.blocked):
        continue  # the model's input or output: never pruned, whatever else touched it
      for reason in group.blocked:
        if reason.startswith("unfollowed"):
          out.setdefault(reason, []).append(group.name)
    return out

  def summary(self) -> str:
    lines = [f"{len(self.prunable)} prunable channel groups, {len(self.blocked)} blocked"]
    for group in self.blocked:
      lines.append(f"  {group.name} ({group.width}): {'; '.join(group.blocked)}")
    return "\n".join(lines)


@runtime_checkable
class RemovableBranch(Protocol):
  """What a module has to declare a removable branch.

  PruneTrain §4.1 layer removal; see the module docstring.
  """

  branch_names: Sequence[str]

  def remove_branch(self) -> None:
    """Drops the branch; the module then computes its value with a zero branch output."""


def _has_removable_branch(module: Any) -> bool:
  """A module following :class:`RemovableBranch` whose branch is still there."""
  return isinstance(module, RemovableBranch) and all(
    getattr(module, name, None) is not None for name in module.branch_names
  )


def under(path: ParamPath, prefixes: Sequence[ParamPath]) -> bool:
  """Whether ``path`` lies under (or is) one of ``prefixes``."""
  return any(path[: len(p)] == tuple(p) for p in prefixes)


def default_input_shape(model: nnx.Module) -> Optional[tuple[int, ...]]:
  """One image for a :mod:`jaxprune.models` network (from its spec), None for other models."""
  spec = getattr(model, "spec", None)
  if spec is None:
    return None
  size = 224 if getattr(spec, "stem_pool", False) else 32
  return (1, size, size, getattr(spec, "in_channels", 3))


def channel_graph(
  model: nnx.Module, input_shape: Optional[Sequence[int]] = None, *, input_dtype: Any = None
) -> ChannelGraph:
  """The channel groups of ``model``, traced from ``model(x)`` for an ``x`` of ``input_shape``.

  Args:
    model: any NNX module called as ``model(x)`` (no compilation: the forward pass is traced
      abstractly, once).
    input_shape: the shape of ``x`` (a batch of one is enough); default one 32x32 image (224
      for ImageNet) for a :mod:`jaxprune.models` network.

  Returns:
    A :class:`ChannelGraph`.

  Raises:
    ValueError: no ``input_shape`` for a model without a width spec, or one the model does
      not accept.
  """
  if input_shape is None:
    input_shape = default_input_shape(model)
    if input_shape is None:
      raise ValueError(
        f"input_shape: {type(model).__name__} has no width spec to take an input shape from; "
        "pass the shape of one input batch, e.g. (1, 32, 32, 3)"
      )
  dtype = _as_input_dtype(input_dtype)
  closed, leaves, input_index = _trace(model, input_shape, None, dtype)
  jaxpr = closed.jaxpr
  rest = flatten_with_paths(nnx.split(model, nnx.Param, ...)[2])
  variables = leaves + rest
  # Which jaxpr values are kernels, and of which parameter: the FLOP walker's records.
  flops_walker = _Walker()
  flops_walker.walk(jaxpr, _input_flows(jaxpr, len(leaves), input_index), 1)
  weight_origin = {
    id(r["weight"][0]): r["weight"][1].origin
    for r in flops_walker.records
    if r["weight"][1].origin is not None
  }
  kernel_leaves = set(weight_origin.values())

  walker = _ChannelWalker(weight_origin)
  ins = []
  for i, v in enumerate(jaxpr.invars):
    mark = ("fixed", "the model's input") if i == input_index else None
    ins.append([walker.dims.new(int(d), mark) for d in v.aval.shape])
  outs = walker.walk(jaxpr, ins, closed.consts)
  walker.keep_head_dims()
  for nodes in outs:
    for node in nodes:
      walker.dims.mark(node, ("fixed", "the model's output"))
  shape = tuple(int(d) for d in input_shape)
  return _groups(model, walker, ins, variables, kernel_leaves, shape, dtype)


def _as_input_dtype(input_dtype: Any) -> Any:
  """``input_dtype`` as a NumPy dtype (None: float32, the images the library trains on).

  Raises:
    ValueError: ``input_dtype`` is not a numeric dtype.
  """
  if input_dtype is None:
    return np.dtype(np.float32)
  try:
    dtype = np.dtype(input_dtype)
  except TypeError as err:
    raise ValueError(f"input_dtype must be a dtype such as jnp.int32, got {input_dtype!r}") from err
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(f"input_dtype must be an integer or floating dtype, got {dtype}")
  return dtype


def _groups(model, walker, ins, variables, kernel_leaves, input_shape, dtype) -> ChannelGraph:
  dims = walker.dims
  features = {dims.find(a) for node in walker.feature_nodes for a in dims.atoms(node)}
  values = {path: value for path, value in variables}
  uses: dict[int, list[ChannelUse]] = {}
  for i, (path, value) in enumerate(variables):
    for axis, node in enumerate(ins[i][: np.ndim(value)]):
      try:
        coords = dims.coords(node)
      except ValueError:
        for atom in dims.atoms(node):
          dims.mark(
            atom,
            (
              "unfollowed",
              f"{'/'.join(map(str, path))} meets its own channels in another order on one axis "
              "(a channel shuffle against a residual add)",
            ),
          )
        continue
      for atom, column in coords.items():
        if atom in features:
          uses.setdefault(atom, []).append(ChannelUse(path, axis, column, i in kernel_leaves))
  branches = {
    tuple(path): tuple(tuple(path) + (name,) for name in module.branch_names)
    for path, module in nnx.iter_graph(model)
    if isinstance(module, nnx.Module) and _has_removable_branch(module)
  }
  marks = dims.atom_marks()  # after the shuffle marks above
  groups = {}
  for atom in sorted(features):
    atom_uses = tuple(uses.get(atom, ()))
    kernels = [u for u in atom_uses if u.kernel]
    name = f"{kernels[0].name}[{kernels[0].axis}]" if kernels else f"#{atom}"
    blocked = tuple(dict.fromkeys(f"{kind}: {why}" for kind, why in marks.get(atom, ())))
    groups[atom] = ChannelGroup(
      name, dims.size(atom), atom_uses, blocked, _branch_of(atom_uses, branches), values
    )
  conv_groups = {}
  for conv in walker.convs:
    if conv.groups_node is not None:
      conv_groups[variables[conv.leaf][0]] = groups.get(dims.find(conv.groups_node))
  return ChannelGraph(list(groups.values()), branches, conv_groups, input_shape, values, dtype)


def _branch_of(uses: Sequence[ChannelUse], branches: dict) -> Optional[ParamPath]:
  """The removable branch whose layers hold every variable of the group, if any."""
  for path, layers in branches.items():
    if uses and all(under(u.path, layers) for u in uses):
      return path
  return None


def live_channels(group: ChannelGroup, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
  """Channel union (PruneTrain §4.2).

  A channel lives if any kernel's group over it has ``max|w| >= threshold``.

  Args:
    group: a group of :func:`channel_graph`.
    threshold: the dead-group threshold (absolute).

  Returns:
    A boolean vector over the group's channels.
  """
  return group.magnitude() >= threshold
