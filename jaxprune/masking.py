"""Weight masks shared by every method: an Optax mask transform, saving / loading, and a
registry of the optimizer states that carry masks.

* :func:`mask` — a gradient transformation whose update is ``m ⊙ (p + u) − p``: placed last in a
  chain, masked weights are exactly 0 after ``optax.apply_updates``, whatever came before it
  (e.g. ``optax.adamw`` chained *outside* a pruning wrapper, whose moments would otherwise
  re-fill pruned positions). Placed before an optimizer with masked weights already zero, it
  feeds that optimizer zero gradients there, so its moments stay zero.
* :func:`apply_masks` — zero the masked weights once.
* :func:`save_masks` / :func:`load_masks` — an ``.npz`` keyed by
  :func:`jaxprune.paths.path_string`, exact round trip.
* :func:`register_mask_source` / :func:`find_masks` — the masks a training state promises,
  whatever transform holds them (a pruning method registers its state type), so that a
  training loop can check them without knowing the method: :class:`RefillCheck`.

A mask pytree has the structure of the params; a ``None`` leaf is "not masked"; other leaves
are bool or 0/1 arrays of the param's shape (1 / True = kept).

Example:
  >>> import jax.numpy as jnp, optax
  >>> from jaxprune import masking
  >>> params = {"w": jnp.array([1.0, 2.0, 3.0]), "b": jnp.zeros(2)}
  >>> m = {"w": jnp.array([True, False, True]), "b": None}
  >>> tx = optax.chain(optax.adamw(0.1), masking.mask(m))
  >>> params = masking.apply_masks(params, m)
  >>> state = tx.init(params)
  >>> u, state = tx.update({"w": jnp.ones(3), "b": jnp.ones(2)}, state, params)
  >>> float(optax.apply_updates(params, u)["w"][1])
  0.0
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxprune._states import as_pure, find_states, named_leaves as _named_leaves
from jaxprune.paths import path_string

__all__ = [
  "MaskState",
  "RefillCheck",
  "apply_masks",
  "count_refilled",
  "find_masks",
  "load_masks",
  "mask",
  "register_mask_source",
  "save_masks",
]

PyTree = Any
MaskFn = Callable[[PyTree], PyTree]
_NONE_KEY = "__none__"  # the .npz entry listing the paths of None leaves (not a path_string)


class MaskState(NamedTuple):
  """The masks in force (bool, ``None`` where not masked).

  Kept so that checkpoints and :func:`find_masks` see them.
  """

  masks: PyTree


# ------------------------------------------------------------------ validation
def _check_values(name: str, masks: PyTree) -> None:
  """Finite and binary, where the values are known (skipped under tracing)."""
  for path, m in _named_leaves(masks).items():
    if m is None or isinstance(m, jax.core.Tracer):
      continue
    a = np.asarray(m)
    if a.dtype == bool:
      continue
    if not np.issubdtype(a.dtype, np.number):
      raise ValueError(f"{name}: mask {path!r} has dtype {a.dtype}; expected bool or 0/1 numbers")
    if not np.all(np.isfinite(a)):
      raise ValueError(f"{name}: mask {path!r} has non-finite values")
    if not np.all((a == 0) | (a == 1)):
      raise ValueError(f"{name}: mask {path!r} has values other than 0 and 1")


def _aligned(name: str, masks: PyTree, params: PyTree) -> dict[str, jax.Array | None]:
  """``{path_string: bool mask or None}`` for every param, checking structure and shapes."""
  got, want = _named_leaves(masks), _named_leaves(params)
  if set(got) != set(want):
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    raise ValueError(
      f"{name}: structure does not match params (missing {missing[:3]}, unexpected {extra[:3]})"
    )
  out = {}
  for path, p in want.items():
    m = got[path]
    if m is not None and np.shape(m) != np.shape(p):
      raise ValueError(f"{name}: mask {path!r} has shape {np.shape(m)}, param {np.shape(p)}")
    out[path] = None if m is None else jnp.asarray(m) != 0
  return out


# ------------------------------------------------------------------ the transform
def mask(masks: PyTree | MaskFn) -> optax.GradientTransformationExtraArgs:
  """Keeps masked weights exactly zero: the update becomes ``m ⊙ (p + u) − p``.

  Computed as ``where(m, u, −p)``: kept entries pass ``u`` bit for bit, masked ones make
  ``p + update`` exactly 0. Put it **last** in a chain to keep pruned weights at zero whatever
  the transforms before it do (moments, weight decay, a wrapper's own masking). Put it
  **before** an optimizer (``optax.chain(mask(m), optax.adamw(...))``) with the masked weights
  already zero (:func:`apply_masks`) to feed the optimizer zero gradients there, so its moments
  stay zero.

  Args:
    masks: a pytree with the params' structure (``None`` leaves: not masked; bool or 0/1
      arrays of the param's shape, 1 = kept), or a function ``params -> such a pytree``
      called at ``init`` and at every ``update``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`MaskState`; its
    ``update`` needs ``params``.

  Raises:
    ValueError: ``masks`` has non-finite or non-binary values, or (at ``init`` / ``update``)
      a structure or shapes that do not match the params; ``update`` without ``params``.

  Example:
    >>> tx = optax.chain(optax.sgd(0.1, momentum=0.9), mask(weight_masks))  # doctest: +SKIP
  """
  if not callable(masks):
    _check_values("masks", masks)

  def current(params):
    m = masks(as_pure(params)) if callable(masks) else masks
    if callable(masks):
      _check_values("masks(params)", m)
    named = _aligned("masks", m, params)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(as_pure(params))
    return named, jax.tree.unflatten(treedef, [named[path_string(p)] for p, _ in leaves_with_paths])

  def init_fn(params):
    return MaskState(current(params)[1])

  def update_fn(updates, state, params=None, **extra_args):
    del state, extra_args
    if params is None:
      raise ValueError("mask needs params: update(updates, state, params)")
    named, tree = current(params)
    p_named = _named_leaves(params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    out = []
    for path, u in flat:
      name = path_string(path)
      m = named[name]
      out.append(u if m is None else jnp.where(m, u, -p_named[name]).astype(u.dtype))
    return jax.tree.unflatten(treedef, out), MaskState(tree)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def apply_masks(params: PyTree, masks: PyTree) -> PyTree:
  """``params`` with every masked entry set to exactly 0 (``None`` mask leaves: unchanged).

  Raises:
    ValueError: ``masks`` does not match ``params`` in structure or shapes, or has
      non-finite / non-binary values.
  """
  _check_values("masks", masks)
  named = _aligned("masks", masks, params)
  flat, treedef = jax.tree_util.tree_flatten_with_path(as_pure(params))
  out = []
  for path, p in flat:
    m = named[path_string(path)]
    out.append(p if m is None else jnp.where(m, p, jnp.zeros_like(p)))
  return jax.tree.unflatten(treedef, out)


# ------------------------------------------------------------------ files
def save_masks(path: str | os.PathLike, masks: PyTree) -> None:
  """Write ``masks`` to an ``.npz`` keyed by :func:`jaxprune.paths.path_string`.

  Dtypes are kept; the paths of ``None`` leaves are listed too.

  Raises:
    ValueError: non-finite or non-binary mask values.
  """
  _check_values("masks", masks)
  named = _named_leaves(masks)
  arrays = {k: np.asarray(v) for k, v in named.items() if v is not None}
  arrays[_NONE_KEY] = np.asarray(sorted(k for k, v in named.items() if v is None), dtype=str)
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def load_masks(path: str | os.PathLike, params: PyTree | None = None) -> PyTree:
  """Read masks written by :func:`save_masks`.

  Args:
    path: the ``.npz`` file.
    params: optional template; the masks come back in its structure.

  Returns:
    ``{path_string: array or None}`` without ``params``; with it, a pytree like ``params``.

  Raises:
    ValueError: the file's paths or shapes do not match ``params``, or it holds non-binary
      values.
  """
  with np.load(path, allow_pickle=False) as f:
    named: dict[str, np.ndarray | None] = {k: f[k] for k in f.files if k != _NONE_KEY}
    named.update({str(k): None for k in f[_NONE_KEY]} if _NONE_KEY in f.files else {})
  _check_values(f"load_masks({os.fspath(path)!r})", named)
  if params is None:
    return named
  want = _named_leaves(params)
  if set(named) != set(want):
    missing, extra = sorted(set(want) - set(named)), sorted(set(named) - set(want))
    raise ValueError(
      f"params: the mask file {os.fspath(path)!r} does not match "
      f"(missing {missing[:3]}, unexpected {extra[:3]})"
    )
  for k, m in named.items():
    if m is not None and m.shape != np.shape(want[k]):
      raise ValueError(
        f"params: mask {k!r} in the file has shape {m.shape}, param {np.shape(want[k])}"
      )
  flat, treedef = jax.tree_util.tree_flatten_with_path(as_pure(params))
  return jax.tree.unflatten(treedef, [named[path_string(p)] for p, _ in flat])


# ------------------------------------------------------------------ registry
_SOURCES: dict[type, Callable[[Any, PyTree], PyTree | None]] = {}


def register_mask_source(state_type: type, fn: Callable[[Any, PyTree], PyTree | None]) -> None:
  """Declare that an optimizer state of ``state_type`` carries masks the weights obey.

  Args:
    state_type: the state class (a NamedTuple) of a transform.
    fn: ``fn(state, params) -> mask pytree`` (like ``params``, ``None`` = not masked), or
      ``None`` while the state promises no masks yet (e.g. before a hard prune).
  """
  _SOURCES[state_type] = fn


def find_masks(opt_state: Any, params: PyTree) -> PyTree | None:
  """The masks promised by the registered states inside ``opt_state`` (host side).

  Returns:
    A pytree like ``params`` (pure arrays): bool, False where any source prunes the entry,
    ``None`` where no source masks the param; or ``None`` when no source is found.
  """
  if not _SOURCES:
    return None
  found = find_states(opt_state, tuple(_SOURCES))
  combined: dict[str, np.ndarray] = {}
  for state in found:
    fn = next(f for t, f in _SOURCES.items() if isinstance(state, t))
    got = fn(state, params)
    if got is None:
      continue
    for name, m in _named_leaves(got).items():
      if m is not None:
        keep = np.asarray(m) != 0
        combined[name] = keep & combined[name] if name in combined else keep
  if not combined:
    return None
  flat, treedef = jax.tree_util.tree_flatten_with_path(as_pure(params))
  return jax.tree.unflatten(treedef, [combined.get(path_string(p)) for p, _ in flat])


register_mask_source(MaskState, lambda state, params: state.masks)


def count_refilled(masks: PyTree, params: PyTree) -> tuple[int, str | None]:
  """Non-zero ``params`` entries where ``masks`` prunes, and the first such param's path."""
  named = _named_leaves(masks)
  total, first = 0, None
  for name, p in _named_leaves(params).items():
    m = named.get(name)
    if m is None:
      continue
    n = int(np.count_nonzero(np.asarray(p)[~(np.asarray(m) != 0)]))
    if n and first is None:
      first = name
    total += n
  return total, first


class RefillCheck:
  """Warns when weights that the optimizer state's masks prune are not zero.

  That happens when a transform chained after the masking (e.g. ``optax.adamw`` outside a
  pruning wrapper) re-fills them; the fix is :func:`mask` last in the chain. Call it at epoch
  ends (host side; it costs a walk over the state's nodes unless a mask source is found).
  A source is checked only once it was also found at the previous call: a method may announce
  its masks at an epoch end and apply them from the next step on.

  Example:
    >>> check = RefillCheck()
    >>> for epoch in range(epochs):  # doctest: +SKIP
    ...   params, opt_state = train_one_epoch(params, opt_state)
    ...   check(opt_state, params)
  """

  def __init__(self):
    self._armed = False

  def __call__(self, opt_state: Any, params: PyTree, *, stacklevel: int = 2) -> int:
    """Returns the number of non-zero pruned entries (0 when nothing is checked)."""
    masks = find_masks(opt_state, params)
    armed, self._armed = self._armed, masks is not None
    if masks is None or not armed:
      return 0
    total, first = count_refilled(masks, params)
    if total:
      warnings.warn(
        f"{total} pruned weights are non-zero (first in {first!r}): a transform chained after "
        "the masking re-filled them; put jaxprune.masking.mask(...) last in the chain",
        RuntimeWarning,
        stacklevel=stacklevel + 1,
      )
    return total
