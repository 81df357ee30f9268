"""Which param leaves ClickTrain prunes, and how: the static per-layer plan of one step.

The plan is a function of the :class:`~jaxprune.clicktrain.config.Config` and the param
tree's paths and shapes (fixed under ``jit``), rebuilt at every ``init`` and ``update``, so a
model whose structure changed (PruneTrain's reconfiguration) gets a plan of its own. One thing
carries over between plans (:class:`ChosenLayers`): a layer once chosen stays chosen when a
channel surgery narrows it, so a conv that PruneTrain leaves 3 input channels is not taken for
a stem and dropped from the plan with its masks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxprune.clicktrain import patterns as _pat
from jaxprune.clicktrain._groups import group_ids
from jaxprune.clicktrain.config import (
  Config,
  LayerFilter,
  RatiosByName,
  check_ratio,
  default_layer_filter,
)
from jaxprune.clicktrain.state import PATTERN_SIZE, ClickTrainLayerState
from jaxprune.paths import path_string

__all__ = [
  "ChosenLayers",
  "Layers",
  "Plan",
  "PrunedLayer",
  "check_filter_groups",
  "check_layers",
  "check_not_empty",
  "init_layer",
  "make_plan",
  "ratios_by_name",
]

PyTree = Any


class PrunedLayer(NamedTuple):
  """The static plan of one pruned param leaf (host side, fixed by the param shapes)."""

  index: int  # position among the flattened param leaves
  kind: str  # "pattern" or "kernel"
  ratio: float  # kernel-prune ratio
  size: int  # kernel side (0 for kernel-only)
  per_filter: bool = False  # prune the same number of kernels in every filter (§5.2)
  groups: int = 0  # aligned mode: filter groups sharing patterns (0: per kernel, the paper)
  clustered: bool = False  # aligned mode: the groups are chosen when the patterns are final


Plan = dict[str, PrunedLayer]
Layers = dict[str, ClickTrainLayerState]


class ChosenLayers:
  """The layers one ``clicktrain()`` transform has chosen, by path, with the shape they had.

  The default layer filter tells the stem by its input channels (3 or fewer), a count that
  PruneTrain's reconfiguration (§4.2) also lowers: a 3x3 conv left with 3 input channels would
  drop out of the plan, its masks no longer applied, while the sliced state still holds it
  (the composed run failed ``Trainer.replace``'s check). ClickTrain's pruning decision is made
  once and kept (its hard masks hold to the end of training, §4.4), so a layer the filter chose
  stays chosen, as the same kind, at a shape that only narrows its channels (same kernel size,
  no more input or output channels). A layer the filter chooses anew is recorded at its new
  shape; one it never chose is left as the filter says.

  Example:
    >>> chosen = ChosenLayers()
    >>> chosen.record("a/kernel", (3, 3, 4, 8), "pattern")
    >>> chosen.narrowed("a/kernel", (3, 3, 3, 8)), chosen.narrowed("a/kernel", (5, 5, 3, 8))
    ('pattern', None)
  """

  def __init__(self):
    self._layers: dict[str, tuple[str, tuple[int, ...]]] = {}

  def record(self, name: str, shape: tuple[int, ...], kind: str) -> None:
    """``name`` was chosen as ``kind`` at ``shape``."""
    self._layers[name] = (kind, tuple(shape))

  def narrowed(self, name: str, shape: tuple[int, ...]) -> str | None:
    """The kind ``name`` was chosen as, if ``shape`` only narrows its recorded channels.

    ``None`` for a layer not recorded, or a shape that changes more than the channels.
    """
    if name not in self._layers or len(shape) != 4:
      return None
    kind, was = self._layers[name]
    if tuple(shape[:2]) != was[:2] or shape[2] > was[2] or shape[3] > was[3]:
      return None
    return kind


def _chosen(
  layer_filter: LayerFilter, mode: str, leaves, memory: ChosenLayers | None = None
) -> list[tuple[str, int, str, int]]:
  """``(name, leaf index, kind, kernel side)`` of every leaf ``layer_filter`` prunes (checked
  for the ``mode``), or that ``memory`` holds chosen before a channel surgery narrowed it."""
  chosen = []
  for i, (path, leaf) in enumerate(leaves):
    name, shape = path_string(path), tuple(np.shape(leaf))
    kind = layer_filter(name, shape)
    if memory is not None:
      if kind is None:
        kind = memory.narrowed(name, shape)
      elif kind in ("pattern", "kernel"):
        memory.record(name, shape, kind)
    if kind is None:
      continue
    if kind not in ("pattern", "kernel"):
      raise ValueError(f"layer_filter must return 'pattern', 'kernel' or None, got {kind!r}")
    if np.ndim(leaf) != 4:
      raise ValueError(f"layer_filter chose {name!r} of shape {np.shape(leaf)}: not 4-D")
    kh, kw = np.shape(leaf)[:2]
    if kind == "pattern" and (kh != kw or kh * kh < PATTERN_SIZE or kh < 2):
      raise ValueError(
        f"pattern pruning needs a square kernel of side >= 2: {name!r} {np.shape(leaf)}"
      )
    if kind == "pattern" and mode == "one_shot" and kh != 3:
      raise ValueError(f"mode='one_shot' uses 3x3 centre patterns; {name!r} is {kh}x{kw}")
    chosen.append((name, i, kind, kh))
  return chosen


def _ratios(cfg: Config, chosen, leaves) -> list[float]:
  """One kernel-prune ratio per chosen layer, from ``cfg.kernel_prune_ratio``.

  A pure function of the config and the params (``init`` keeps nothing aside): a sequence
  is matched to the pruned layers by position, a mapping by path.
  """
  spec = cfg.kernel_prune_ratio
  names = [c[0] for c in chosen]
  if isinstance(spec, float):
    return [spec] * len(chosen)
  if isinstance(spec, RatiosByName):
    missing = [n for n in names if n not in spec]
    if missing:
      raise ValueError(
        f"kernel_prune_ratio has no ratio for the pruned layer(s) {missing}; it names "
        f"{sorted(spec)}"
      )
    return [spec[n] for n in names]
  if callable(spec):
    return [
      check_ratio(spec(name, tuple(np.shape(leaves[i][1]))), name) for name, i, _, _ in chosen
    ]
  if len(spec) != len(chosen):
    raise ValueError(
      f"kernel_prune_ratio has {len(spec)} entries for {len(chosen)} pruned layers: {names}. "
      "A sequence is matched to the pruned layers by position, so it fits one model; for a "
      "model that loses layers (PruneTrain's reconfiguration) give the ratios by path: "
      "kernel_prune_ratio=clicktrain.ratios_by_name(params, ratios) on the full model"
    )
  return list(spec)


def make_plan(cfg: Config, params: PyTree, memory: ChosenLayers | None = None) -> Plan:
  """The pruned layers of ``params``, in param flatten order.

  Args:
    cfg: the transform's settings (layer filter, ratios, mode, ``balanced_kernels``).
    params: the param tree (arrays or shape structs).
    memory: the layers the transform chose before (kept chosen when only narrowed; updated).

  Returns:
    ``{path: PrunedLayer}``.

  Raises:
    ValueError: ``layer_filter`` returned something else than ``"pattern"``, ``"kernel"`` or
      ``None``, or chose a leaf that cannot be pruned so; a ratio sequence of another length
      than the pruned layers, or a mapping without a pruned layer's path; a ratio (from the
      callable) that is not in ``[0, 1]``.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  chosen = _chosen(cfg.layer_filter, cfg.mode, leaves, memory)
  ratios = _ratios(cfg, chosen, leaves)
  groups = cfg.aligned.filter_groups if cfg.aligned else 0
  clustered = bool(groups) and cfg.aligned.grouping == "clustered"
  return {
    name: PrunedLayer(
      i, kind, r, kh if kind == "pattern" else 0, cfg.balanced_kernels, groups, clustered
    )
    for (name, i, kind, kh), r in zip(chosen, ratios)
  }


def ratios_by_name(
  params: PyTree, ratios: Sequence[float], layer_filter: LayerFilter | None = None
) -> dict[str, float]:
  """``ratios`` (one per pruned layer of ``params``, in flatten order) keyed by layer path.

  For ``kernel_prune_ratio``: a mapping keeps each layer's ratio when a reconfiguration
  (PruneTrain's) removes other layers, where a sequence matches only the model it was written
  for.

  Args:
    params: the full model's param tree (arrays or shape structs).
    ratios: one ratio per layer ``layer_filter`` prunes.
    layer_filter: the transform's ``layer_filter`` (``None``: the default).

  Returns:
    ``{path: ratio}``.

  Raises:
    ValueError: a count of ``ratios`` other than the pruned layers', a ratio outside
      ``[0, 1]``, or a layer the filter chose that cannot be pruned as it says.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxprune import clicktrain
    >>> kernel = jnp.zeros((3, 3, 8, 8))
    >>> params = {"a": {"kernel": kernel}, "b": {"kernel": kernel}}
    >>> clicktrain.ratios_by_name(params, [0.5, 0.7])
    {'a/kernel': 0.5, 'b/kernel': 0.7}
  """
  layer_filter = default_layer_filter if layer_filter is None else layer_filter
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  names = [c[0] for c in _chosen(layer_filter, "paper", leaves)]
  ratios = list(ratios)
  if len(ratios) != len(names):
    raise ValueError(f"ratios has {len(ratios)} entries for {len(names)} pruned layers: {names}")
  return {name: check_ratio(r, name) for name, r in zip(names, ratios)}


def check_not_empty(plan: Plan, params: PyTree) -> None:
  """At ``init``: ``params`` hold at least one layer to prune.

  A model without such a layer (an MLP, or convs that are all stems or 1x1 shortcuts) would
  train dense through every stage, and the read-outs would fail only after the hard prune;
  it is refused when the state is built instead.

  Raises:
    ValueError: no leaf chosen; the message lists the 4-D leaves found (or says there are
      none) so the reader sees why the layer filter passed them over.
  """
  if plan:
    return
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  convs = [f"{path_string(p)} {tuple(np.shape(x))}" for p, x in leaves if np.ndim(x) == 4]
  if convs:
    shown = ", ".join(convs[:6]) + (f", ... ({len(convs)} in all)" if len(convs) > 6 else "")
    found = f"{len(convs)} 4-D kernel(s), none chosen: {shown}"
  else:
    found = f"no 4-D kernel among its {len(leaves)} param leaves (a model without convs)"
  raise ValueError(
    "params: clicktrain prunes conv kernels that layer_filter chooses (by default k x k or "
    f"1x1 HWIO kernels with more than 3 input channels, not on a shortcut path); found {found}"
  )


def check_filter_groups(plan: Plan, params: PyTree) -> None:
  """Aligned mode: ``filter_groups`` divides the filters of every pruned layer (``init``).

  Raises:
    ValueError: the first layer whose output channels it does not divide, named.
  """
  leaves = jax.tree.leaves(params)
  for name, layer in plan.items():
    cout = np.shape(leaves[layer.index])[3]
    if layer.groups and cout % layer.groups:
      raise ValueError(
        f"filter_groups ({layer.groups}) must divide the {cout} filters of every pruned "
        f"layer; {name!r} has {cout}"
      )


def check_layers(plan: Plan, layers: Layers, params: PyTree) -> None:
  """Checks that the params' pruned layers are those the state was built for.

  With the same shapes: a ``ValueError`` names the first that is not, instead of a bare
  ``KeyError`` later. A layer a PruneTrain reconfiguration narrowed stays in the plan
  (:class:`ChosenLayers`); a state layer whose param is still there but that the plan does not
  hold is left to the plan, which follows the params.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  w_leaves = [leaf for _, leaf in leaves]
  for name, layer in plan.items():
    if name not in layers:
      raise ValueError(
        f"params: pruned layer {name!r} is not in the ClickTrain state (built for "
        f"{sorted(layers)}): params of another structure than tx.init saw"
      )
    want, got = layers[name].pattern_mask.shape, np.shape(w_leaves[layer.index])
    if want != got:
      raise ValueError(
        f"params: {name!r} has shape {got}, the ClickTrain state was built for {want}"
      )
  paths = {path_string(p) for p, _ in leaves}
  for name in layers:
    if name not in paths:
      raise ValueError(
        f"params: the ClickTrain state's pruned layer {name!r} is missing from the params "
        "(params of another structure than tx.init saw)"
      )


def init_layer(
  leaf: jax.Array, layer: PrunedLayer, pool_size: int, mode: str
) -> ClickTrainLayerState:
  """The state of one pruned layer before any step.

  No scores, no pool, nothing pruned; the filter groups consecutive (aligned mode) or one filter
  each (paper mode).
  """
  _, _, cin, cout = leaf.shape
  ids = group_ids(cout, layer.groups) if layer.groups else np.arange(cout, dtype=np.int32)
  n_pool = pool_size if (layer.kind == "pattern" and mode == "paper") else 0
  n_pat = _pat.num_patterns(PATTERN_SIZE, layer.size) if n_pool else 0
  # Fields a layer does not use are None (empty pytree nodes; orbax cannot store
  # zero-size arrays).
  return ClickTrainLayerState(
    competitive_scores=jnp.zeros((n_pat,), jnp.int32) if n_pool else None,
    pool=jnp.zeros((n_pool,), jnp.int32) if n_pool else None,
    votes=jnp.zeros((cin, cout, n_pool), jnp.int32) if n_pool else None,
    kernel_score_sum=jnp.zeros((cin, cout), jnp.float32),
    pattern_id=jnp.full((cin, cout), -1, jnp.int32),
    kernel_keep=jnp.ones((cin, cout), bool),
    pattern_mask=jnp.ones(leaf.shape, leaf.dtype),
    filter_group=jnp.asarray(ids, jnp.int32),
  )
