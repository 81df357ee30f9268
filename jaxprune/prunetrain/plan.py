"""Deciding what one reconfiguration removes (PruneTrain §4.2 channel union, §4.1 layer removal).

:func:`plan_reconfiguration` decides, from a model's :func:`~jaxprune.prunetrain.channel_graph`,
which channels and residual branches die, and writes it as a
:class:`~jaxprune.state_slicing.SurgeryPlan` in terms of the model's own variables.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from jaxprune.models.conversions import submodule
from jaxprune.paths import ParamPath
from jaxprune.prunetrain.graph import (
  DEFAULT_THRESHOLD,
  ChannelGraph,
  ChannelGroup,
  live_channels,
  under,
)
from jaxprune.state_slicing import SurgeryPlan, _key, _path

__all__ = ["plan_reconfiguration", "rounded_width"]

# Layer attributes that follow their variables' widths, by module type.
_NORMS = (nnx.BatchNorm, nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm)


def rounded_width(width: int, multiple: int, cap: int) -> int:
  """``width`` rounded up to a multiple of ``multiple``, at most ``cap``.

  ``cap`` is the width it was pruned from; the result is the width a reconfiguration keeps with
  ``channel_multiple=multiple``.
  """
  return min(cap, -(-width // multiple) * multiple)


def _channel_step(group: ChannelGroup, multiple: int) -> int:
  """The kept-channel step that keeps every axis of ``group`` a multiple of ``multiple``.

  A channel spans ``r`` positions of an axis flattened with others (a head: its head_dim
  columns), so a count of channels ``k`` gives ``k·r`` positions; a multiple of
  ``multiple / gcd(multiple, r)`` channels is enough there (any count of 4-wide heads keeps a
  projection a multiple of 4).
  """
  step = 1
  for use in group.uses:
    per_channel = max(1, int(np.sum(use.coords >= 0)) // max(group.width, 1))
    step = math.lcm(step, multiple // math.gcd(multiple, per_channel))
  return step


def _kept(group: ChannelGroup, exclude: Sequence[ParamPath], threshold: float, multiple: int):
  """The kept channels of a group: the live ones (channel union), at least the strongest one,
  rounded up to ``multiple`` with the strongest dead ones."""
  strength = group.magnitude(exclude)
  live = strength >= threshold
  target = max(1, int(live.sum()))
  if multiple > 1:
    target = rounded_width(target, _channel_step(group, multiple), group.width)
  if target > live.sum():
    dead = np.flatnonzero(~live)
    # strongest first; ties to the lower index
    live[dead[np.argsort(-strength[dead], kind="stable")[: target - int(live.sum())]]] = True
  return np.flatnonzero(live)


def plan_reconfiguration(
  model: nnx.Module,
  graph: ChannelGraph,
  *,
  threshold: float = DEFAULT_THRESHOLD,
  multiple: int = 1,
) -> SurgeryPlan:
  """Which channels and branches of ``model`` die, from its channel graph.

  PruneTrain §4.2 channel union, §4.1 layer removal.

  Args:
    model: the model ``graph`` was traced from.
    graph: :func:`~jaxprune.prunetrain.channel_graph` of ``model``.
    threshold: a kernel group is dead when ``max|w| < threshold``.
    multiple: every kept width is rounded up to a multiple of this (capped at the width).

  Returns:
    The :class:`SurgeryPlan` (empty when nothing dies).
  """
  # 1. A removable branch whose inner group died entirely goes (§4.1); decided first, since a
  #    removed branch neither reads nor writes the groups around it any more.
  removed = sorted(
    {
      g.branch
      for g in graph.prunable
      if g.branch is not None and not live_channels(g, threshold).any()
    }
  )
  # Only the branch's own layers go: a projection shortcut beside them stays.
  removed_layers = [layer for path in removed for layer in graph.branches[path]]

  # 2. Channel union over the remaining kernels of every group.
  keep: dict[int, np.ndarray] = {}
  for group in graph.prunable:
    if group.branch in removed:
      continue
    kept = _kept(group, removed_layers, threshold, multiple)
    if len(kept) < group.width:
      keep[id(group)] = kept

  # 3. Per variable axis: the positions whose channel survives in every group on that axis.
  per_axis: dict[ParamPath, dict[int, np.ndarray]] = {}
  for group in graph.groups:
    if id(group) not in keep:
      continue
    mask = np.isin(np.arange(group.width), keep[id(group)])
    for use in group.uses:
      if under(use.path, removed_layers):
        continue
      axis_keep = per_axis.setdefault(use.path, {}).setdefault(
        use.axis, np.ones(len(use.coords), bool)
      )
      valid = use.coords >= 0
      axis_keep[valid] &= mask[use.coords[valid]]
  slices = {
    _key(path): tuple(
      tuple(int(i) for i in np.flatnonzero(axes[a])) if a in axes else None
      for a in range(np.ndim(graph.values[path]))
    )
    for path, axes in per_axis.items()
  }
  attributes, widths = _attributes(model, graph, slices, keep, removed_layers)
  return SurgeryPlan(slices, tuple(_key(p) for p in removed), attributes, widths)


def _new_shape(shape: tuple, index: tuple) -> tuple:
  return tuple(n if i is None else len(i) for n, i in zip(shape, index))


def _attributes(model, graph, slices, keep, removed_layers):
  """The layer attributes that follow the sliced variables, and every kernel's new width."""
  attributes: dict[str, dict[str, Any]] = {}
  widths: dict[str, int] = {}
  shapes = {u.path: np.shape(graph.values[u.path]) for group in graph.groups for u in group.uses}
  new_shapes = {p: _new_shape(s, slices.get(_key(p), (None,) * len(s))) for p, s in shapes.items()}
  for path, shape in new_shapes.items():
    if under(path, removed_layers):
      continue
    owner = path[:-1]
    module = submodule(model, owner)
    if path[-1] == "kernel" and isinstance(module, nnx.Conv):
      group = graph.conv_groups.get(path)
      groups = module.feature_group_count
      if group is not None and id(group) in keep:
        groups = len(keep[id(group)])
      widths[_key(owner)] = shape[-1]
      attributes[_key(owner)] = {
        "in_features": shape[-2] * groups,
        "out_features": shape[-1],
        "feature_group_count": groups,
        "kernel_shape": tuple(shape),
      }
    elif path[-1] == "kernel" and isinstance(module, nnx.Linear):
      widths[_key(owner)] = shape[-1]
      attributes[_key(owner)] = {"in_features": shape[0], "out_features": shape[1]}
    elif path[-1] == "kernel" and isinstance(module, nnx.LinearGeneral):
      n_in = len(module.in_features)
      widths[_key(owner)] = int(np.prod(shape[n_in:]))
      attributes[_key(owner)] = {
        "in_features": tuple(shape[:n_in]),
        "out_features": tuple(shape[n_in:]),
      }
      parent = submodule(model, owner[:-1]) if owner else None
      if isinstance(parent, nnx.MultiHeadAttention) and owner[-1] in ("query", "key"):
        # (features, heads, head_dim): the attention's head counts follow its projections.
        entry = attributes.setdefault(_key(owner[:-1]), {})
        if owner[-1] == "query":
          entry.update(num_heads=shape[1], qkv_features=shape[1] * shape[2])
        else:
          entry["num_kv_heads"] = shape[1]
    elif isinstance(module, _NORMS) and len(shape) == 1:
      entry = {"num_features": shape[0]}
      if isinstance(module, nnx.GroupNorm):
        entry["num_groups"] = shape[0] // module.group_size
      attributes[_key(owner)] = entry
  # Only what changes.
  attributes = {
    k: {a: v for a, v in entry.items() if getattr(submodule(model, _path(k)), a, None) != v}
    for k, entry in attributes.items()
  }
  return {k: v for k, v in attributes.items() if v}, widths
