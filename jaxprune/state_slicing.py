"""Slicing every piece of state a channel surgery touches with the same kept-index arrays.

Shared by the methods, below them: PruneTrain's reconfiguration (§4.2) slices with it, and a
method whose optimizer state holds per-parameter arrays registers its slicer here without
importing PruneTrain. PruneTrain keeps the momentums of the remaining channels "as is": after a
reconfiguration, every per-parameter statistic must be sliced exactly like its parameter.
:class:`ChannelSlices` holds the kept input / output channel indices of every sliced layer and
applies them to

* the model's variables (kernels, biases, BatchNorm scale / bias / running statistics),
* every sub-tree of an optimizer state shaped like the params (momentum, Adam moments, ...),
* any optimizer state whose per-parameter arrays are *not* param-shaped, through a slicer
  registered for its type with :func:`register_state_slicer` (e.g. ClickTrain's per-layer
  masks, scores and votes, keyed by parameter path). The methods that own such a state
  register their slicer; this module imports none of them.

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.models.conversions import submodule
from jaxprune.paths import ParamPath, param_path

__all__ = [
  "ChannelSlices",
  "StateSlicer",
  "SurgeryPlan",
  "applied_plans",
  "apply_plan",
  "register_state_slicer",
  "registered_state_slicers",
]

Index = Optional[np.ndarray]
StateSlicer = Callable[[Any, "ChannelSlices"], Any]

_STATE_SLICERS: dict[type, StateSlicer] = {}


def register_state_slicer(state_type: type, slicer: StateSlicer) -> None:
  """Teaches a channel surgery (:func:`jaxprune.prunetrain.reconfigure`) to slice a state type.

  Use it for a state that holds per-parameter arrays in another layout than the params
  (param-shaped sub-trees are found and sliced without registration).

  Args:
    state_type: the state's class (e.g. a ``NamedTuple``); matched with ``isinstance``
      wherever it sits in an optimizer state (inside ``optax.chain``, wrappers, ...).
    slicer: ``(state, slices) -> new_state`` with ``slices`` a :class:`ChannelSlices`;
      it must also slice any inner optimizer state it wraps (``slices.slice_state``).

  Raises:
    ValueError: ``state_type`` is not a class or ``slicer`` is not callable.

  Example:
    >>> def slice_mine(state, slices):
    ...   return state._replace(scores={
    ...     path: slices.take(score, path, in_axis=0, out_axis=1)
    ...     for path, score in state.scores.items() if not slices.removed(path)})
    >>> register_state_slicer(MyState, slice_mine)  # doctest: +SKIP
  """
  if not isinstance(state_type, type):
    raise ValueError(f"state_type must be a class, got {state_type!r}")
  if not callable(slicer):
    raise ValueError(f"slicer must be callable, got {type(slicer).__name__}")
  _STATE_SLICERS[state_type] = slicer


def registered_state_slicers() -> dict[type, StateSlicer]:
  """A copy of the registry: state type -> slicer."""
  return dict(_STATE_SLICERS)


def _slicer_for(node: Any) -> Optional[StateSlicer]:
  for state_type, slicer in _STATE_SLICERS.items():
    if isinstance(node, state_type):
      return slicer
  return None


def _take(array: Any, in_index: Index, out_index: Index, in_axis: int, out_axis: int) -> Any:
  """``array`` with ``in_index`` kept along ``in_axis`` and ``out_index`` along ``out_axis``.

  Done in NumPy on the host: an eager ``jnp.take`` would compile one gather per shape.
  """
  if array is None or (in_index is None and out_index is None):
    return array
  dtype = getattr(array, "dtype", None)
  array = np.asarray(array)
  if in_index is not None:
    array = np.take(array, in_index, axis=in_axis)
  if out_index is not None:
    array = np.take(array, out_index, axis=out_axis)
  return jnp.asarray(array, dtype=dtype)


def _take_axes(array: Any, index: Sequence[Any]) -> Any:
  """``array`` with ``index[a]`` kept along every axis ``a`` (``None``: all), on the host."""
  dtype = array.dtype
  array = np.asarray(array)
  for axis, kept in enumerate(index):
    if kept is not None:
      array = np.take(array, np.asarray(kept, int), axis=axis)
  return jnp.asarray(array, dtype=dtype)


class ChannelSlices:
  """The kept channels of one reconfiguration, and how to apply them to any state.

  Built by a channel surgery (:func:`jaxprune.prunetrain.reconfigure`); registered state
  slicers receive it.

  Args:
    layer_index: layer path (attribute path tuple, e.g. ``("stages", 0, 1, "conv1")``) ->
      ``(kept input channels, kept output channels)``; ``None`` = all kept.
    old_params, new_params: the params before and after (pure trees).
    leaf_index: variable path (tuple, e.g. ``("stages", 0, 1, "conv1", "conv", "kernel")``) ->
      kept indices per axis (``None``: all kept); takes precedence over ``layer_index`` (what a
      traced channel graph gives: any axis of any variable).
  """

  def __init__(
    self,
    layer_index: Mapping[tuple, tuple[Index, Index]],
    old_params: Any,
    new_params: Any,
    *,
    leaf_index: Optional[Mapping[tuple, tuple[Index, ...]]] = None,
  ):
    self.layer_index = dict(layer_index)
    self.leaf_index = {
      tuple(path): tuple(None if i is None else np.asarray(i, int) for i in index)
      for path, index in (leaf_index or {}).items()
    }
    self.old_params = old_params
    self.new_params = new_params
    self._old_names = {
      param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(old_params)[0]
    }
    self._new_names = {
      param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(new_params)[0]
    }

  # ------------------------------------------------------------------ by parameter path
  def _names(self, path: str | tuple) -> tuple:
    return path if isinstance(path, tuple) else _path(path)

  def _layer_of(self, names: tuple) -> Optional[tuple[tuple[Index, Index], tuple]]:
    for length in range(len(names) - 1, 0, -1):
      indices = self.layer_index.get(names[:length])
      if indices is not None:
        return indices, names[length:]
    return None

  def kernel_index(self, path: str | tuple) -> tuple[Index, Index]:
    """Kept ``(input, output)`` channels of the kernel parameter at ``path``.

    ``path`` is a ``jaxprune.paths.path_string`` such as ``"stages/0/1/conv1/conv/kernel"``, or its
    tuple; ``None`` where all are kept.
    """
    names = self._names(path)
    if names in self.leaf_index:
      index = self.leaf_index[names]
      return (index[-2], index[-1]) if len(index) >= 2 else (None, None)
    found = self._layer_of(names)
    if found is None or found[1][-1:] != ("kernel",):
      return None, None
    return found[0]

  def removed(self, path: str | tuple) -> bool:
    """Whether the parameter at ``path`` is gone (its residual branch was removed)."""
    names = self._names(path)
    return names in self._old_names and names not in self._new_names

  def take(self, array: Any, path: str | tuple, *, in_axis: int, out_axis: int) -> Any:
    """``array`` sliced with the kept channels of the kernel at ``path``.

    Along ``in_axis`` / ``out_axis`` with the kept input / output channels (``None`` stays
    ``None``).
    """
    return _take(array, *self.kernel_index(path), in_axis, out_axis)

  # ------------------------------------------------------------------ whole trees
  def slice_leaf(self, names: tuple, leaf: Any) -> Any:
    """One variable, found by its full path, sliced.

    Kernels on both channel axes, 1-D vectors (BatchNorm statistics, biases) on their output
    channels; anything else unchanged.
    """
    if names in self.leaf_index:
      return _take_axes(leaf, self.leaf_index[names])
    found = self._layer_of(names)
    if found is None:
      return leaf
    (in_index, out_index), remainder = found
    ndim = np.ndim(leaf)
    if remainder[-1:] == ("kernel",) and ndim in (2, 4):
      in_axis, out_axis = (2, 3) if ndim == 4 else (0, 1)
      return _take(leaf, in_index, out_index, in_axis, out_axis)
    if ndim == 1 and out_index is not None:  # conv BN scale/bias/mean/var, linear bias
      return _take(leaf, None, out_index, 0, 0)
    return leaf

  def rebuild_like(self, template: Any, old: Any) -> Any:
    """A tree of ``template``'s structure whose leaves are ``old``'s (same paths), sliced."""
    old_flat = {param_path(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(old)[0]}

    def fill(path, template_leaf):
      names = param_path(path)
      if names not in old_flat:
        raise ValueError(f"no value for {'/'.join(map(str, names))} in the old state")
      old_leaf = old_flat[names]
      value = self.slice_leaf(names, old_leaf)
      if value is old_leaf and np.shape(value) == np.shape(template_leaf):
        return old_leaf  # untouched (also RNG keys, which have no plain dtype)
      if np.shape(value) != np.shape(template_leaf):
        raise ValueError(
          f"{'/'.join(map(str, names))}: sliced shape {np.shape(value)} != "
          f"rebuilt model's {np.shape(template_leaf)}"
        )
      return jnp.asarray(value, dtype=template_leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, template)

  def slice_state(self, opt_state: Any) -> Any:
    """An optimizer state for the new params.

    Every sub-tree shaped like the old params is rebuilt sliced, every state with a registered
    slicer goes through it, the rest (step counts, PruneTrain's λ) is kept.

    Raises:
      ValueError: an array leaf (ndim >= 1) outside every such sub-tree: ``opt_state`` does
        not match the model's params.
    """
    old_def = jax.tree.structure(self.old_params)
    old_shapes = [np.shape(x) for x in jax.tree.leaves(self.old_params)]

    def is_param_tree(node):
      if jax.tree.structure(node) != old_def:
        return False
      return [np.shape(x) for x in jax.tree.leaves(node)] == old_shapes

    def is_leaf(node):
      return _slicer_for(node) is not None or is_param_tree(node)

    def convert(path, node):
      slicer = _slicer_for(node)
      if slicer is not None:
        return slicer(node, self)
      if is_param_tree(node):
        return self.rebuild_like(self.new_params, node)
      if np.ndim(node) >= 1:
        # Kept unsliced it would no longer fit the new params: the state was built for
        # another model, or on nnx.state (Variable nodes) instead of pure arrays.
        raise ValueError(
          f"opt_state: leaf {jax.tree_util.keystr(path)} of shape {np.shape(node)} is in no "
          "sub-tree shaped like the model's params (built for another model, or on "
          "nnx.state(...) instead of nnx.as_pure(nnx.state(model, nnx.Param))?)"
        )
      return node

    return jax.tree.map_with_path(convert, opt_state, is_leaf=is_leaf)


# ----------------------------------------------------------------------------- plans

_PLANS = "surgery_plans"


def _key(path: Sequence[Any]) -> str:
  return "/".join(map(str, path))


def _path(key: str) -> ParamPath:
  return tuple(int(p) if p.isdigit() else p for p in key.split("/")) if key else ()


@dataclasses.dataclass(frozen=True)
class SurgeryPlan:
  """One reconfiguration, in terms of the model's variables.

  Attributes:
    slices: variable path (``"a/0/kernel"``) -> kept indices per axis (``None``: all kept).
    removed: paths of the modules whose removable branch goes (``remove_branch()``).
    attributes: module path -> layer attributes to set (``in_features``, ``num_features``, ...).
    widths: kernel owner path -> output width after (for a width spec and the report).

  Made by :func:`jaxprune.prunetrain.plan_reconfiguration`; JSON-serialisable, so a checkpoint
  of a reconfigured run carries its plans and a restarted process that builds the full-size
  model re-applies them (:func:`apply_plan`) before reading the weights.
  """

  slices: Mapping[str, tuple[Optional[tuple[int, ...]], ...]]
  removed: tuple[str, ...]
  attributes: Mapping[str, Mapping[str, Any]]
  widths: Mapping[str, int]

  def to_json(self) -> dict[str, Any]:
    return {
      "slices": {k: [None if i is None else list(i) for i in v] for k, v in self.slices.items()},
      "removed": list(self.removed),
      "attributes": {k: {a: _jsonable(x) for a, x in v.items()} for k, v in self.attributes.items()},
      "widths": dict(self.widths),
    }

  @classmethod
  def from_json(cls, data: Mapping[str, Any]) -> "SurgeryPlan":
    return cls(
      slices={
        k: tuple(None if i is None else tuple(int(j) for j in i) for i in v)
        for k, v in data["slices"].items()
      },
      removed=tuple(data["removed"]),
      attributes={
        k: {a: tuple(x) if isinstance(x, list) else x for a, x in v.items()}
        for k, v in data["attributes"].items()
      },
      widths=dict(data["widths"]),
    )


def _jsonable(value: Any) -> Any:
  return list(value) if isinstance(value, tuple) else value


def apply_plan(model: nnx.Module, plan: SurgeryPlan) -> None:
  """Performs ``plan`` on ``model`` in place.

  Removes the branches, slices every variable named in ``plan.slices``, sets the layer attributes
  and, for a model carrying a width spec, its narrower spec.

  Raises:
    ValueError: a variable of the plan is missing from the model or has another rank (the
      plan was made for another model).
  """
  for key in plan.removed:
    submodule(model, _path(key)).remove_branch()
  variables = {
    _key(path): node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Variable)
  }
  for key, index in plan.slices.items():
    if key not in variables or np.ndim(variables[key][...]) != len(index):
      raise ValueError(f"plan: variable {key} is not in the model, or not of rank {len(index)}")
    variables[key].set_value(_take_axes(variables[key][...], index))
  for key, entry in plan.attributes.items():
    module = submodule(model, _path(key))
    for name, value in entry.items():
      setattr(module, name, value)
  spec = getattr(model, "spec", None)
  if spec is not None and hasattr(spec, "with_widths"):
    model.spec = _narrower_spec(spec, plan)
  # Recorded on the model (a string: static, part of its graph definition) for checkpoints.
  setattr(model, _PLANS, json.dumps([p.to_json() for p in (*applied_plans(model), plan)]))


def _narrower_spec(spec: Any, plan: SurgeryPlan) -> Any:
  """A :mod:`jaxprune.models` width spec after ``plan`` (its layer paths name the ``ConvBN``,
  whose kernel sits in ``conv``; ``with_widths`` ignores the layers of removed branches)."""
  known = spec.layer_widths()
  widths = {}
  for owner, width in plan.widths.items():
    name = owner[: -len("/conv")] if owner.endswith("/conv") else owner
    if name in known:
      widths[name] = width
  return spec.with_widths(widths, removed_blocks=list(plan.removed))


def applied_plans(model: nnx.Module) -> tuple[SurgeryPlan, ...]:
  """The plans :func:`apply_plan` performed on ``model``, in order.

  Including those performed on the model it was cloned from.
  """
  return tuple(SurgeryPlan.from_json(p) for p in json.loads(getattr(model, _PLANS, "[]")))

