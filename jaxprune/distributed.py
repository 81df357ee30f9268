"""Sparse gradient all-reduce over a named mapped axis (ClickTrain §5.3).

Once pruning masks are final, pruned weights stay exactly zero for the rest of
training, so their gradients need not cross the network: ClickTrain §5.3 sends
only the unpruned entries. Here that is expressed with JAX collectives over an
``axis_name``, so the same code runs inside ``jax.pmap`` and ``jax.shard_map``
(single- or multi-host after ``jax.distributed.initialize``); XLA does the
transport.

The index arrays are built once, on the host, when the masks are final
(``mask_indices``), as ClickTrain §5.1 builds its CSR index arrays once. Each
reduction then gathers the kept entries into one compact vector per leaf,
reduces that, and scatters it back into a zero-filled gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxprune._states import named_leaves
from jaxprune.paths import path_string

__all__ = [
  "mask_indices",
  "sparse_psum",
  "sparse_pmean",
  "reduced_elements",
  "allreduce_gradients",
  "AllreduceGradientsState",
  "SCOPE_PREFIX",
  "per_device_keys",
  "device_key",
]

# Each leaf's reduction runs under ``jax.named_scope(f"{SCOPE_PREFIX}[{path}]")``.
SCOPE_PREFIX = "allreduce"

PyTree = Any


def mask_indices(masks: PyTree) -> PyTree:
  """Host-side flat indices of the kept entries of every mask leaf.

  Args:
      masks: a pytree of boolean / {0, 1} arrays, or ``None`` leaves for
          parameters that are reduced densely.

  Returns:
      A pytree of the same structure whose leaves are sorted ``int32`` NumPy
      arrays of flat (row-major) indices where the mask is nonzero, or ``None``
      where the mask leaf was ``None``.

  Example:
      >>> import numpy as np
      >>> mask_indices({"w": np.array([[1, 0], [0, 1]])})["w"]
      array([0, 3], dtype=int32)
  """

  def one(mask):
    if mask is None:
      return None
    flat = np.asarray(mask).reshape(-1)
    return np.flatnonzero(flat).astype(np.int32)

  return jax.tree.map(one, masks, is_leaf=lambda x: x is None)


def _reduce_leaf(g: jax.Array, idx, axis_name, op) -> jax.Array:
  if idx is None:
    return op(g, axis_name)
  idx = jnp.asarray(idx)
  if idx.ndim != 1:
    raise ValueError(f"indices: expected 1-D index arrays, got shape {idx.shape}")
  flat = g.reshape(-1)
  compact = op(flat[idx], axis_name)
  # Pruned entries stay exactly zero after the hard prune, so the reduced
  # gradient there is zero too (ClickTrain §5.3): scatter into zeros.
  out = jnp.zeros_like(flat).at[idx].set(compact, indices_are_sorted=True, unique_indices=True)
  return out.reshape(g.shape)


def _check_indices(idx: np.ndarray, size: int) -> None:
  """Host-side indices must be what :func:`mask_indices` gives: sorted, unique, in range.

  The scatter in :func:`_reduce_leaf` promises ``indices_are_sorted`` / ``unique_indices``
  and XLA drops out-of-range positions (negative ones wrap on the gather), so anything else
  would reduce the wrong entries without an error.
  """
  if idx.ndim != 1:
    raise ValueError(f"indices: expected 1-D index arrays, got shape {idx.shape}")
  if idx.size and not np.issubdtype(idx.dtype, np.integer):
    raise ValueError(f"indices: expected integer index arrays, got dtype {idx.dtype}")
  if idx.size == 0:
    return
  if idx.min() < 0 or idx.max() >= size:
    raise ValueError(
      f"indices: must lie in [0, {size}) for a leaf of {size} entries, got "
      f"min {int(idx.min())}, max {int(idx.max())}"
    )
  if np.any(np.diff(idx) <= 0):
    raise ValueError("indices: must be strictly increasing (sorted, no duplicates)")


def _index_leaves(tree: PyTree, indices: PyTree | None) -> list[Any]:
  """The leaf of ``indices`` for each leaf of ``tree``, in ``tree``'s flatten order.

  Matched by parameter path, not by container: either may be an NNX ``State`` (of Variables
  or ``nnx.as_pure``) or a plain dict, as masks and params are elsewhere in the library.

  Raises:
    ValueError: ``indices`` does not name the same leaves as ``tree``.
  """
  names = [path_string(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if indices is None:
    return [None] * len(names)
  got = named_leaves(indices)
  if set(got) != set(names):
    missing, extra = sorted(set(names) - set(got)), sorted(set(got) - set(names))
    raise ValueError(
      f"indices: structure does not match the tree (missing {missing[:3]}, unexpected {extra[:3]})"
    )
  return [got[name] for name in names]


def _reduce_tree(grads: PyTree, indices: PyTree | None, axis_name, op) -> PyTree:
  keyed, treedef = jax.tree_util.tree_flatten_with_path(grads)
  g_leaves = [g for _, g in keyed]
  i_leaves = _index_leaves(grads, indices)
  for g, idx in zip(g_leaves, i_leaves):
    if idx is not None and int(np.shape(idx)[0]) > int(np.size(g)):
      raise ValueError(f"indices: {np.shape(idx)[0]} indices for a leaf of {np.size(g)} entries")
    if idx is not None and not isinstance(idx, jax.core.Tracer):
      _check_indices(np.asarray(idx), int(np.size(g)))
  reduced = []
  for (key_path, g), idx in zip(keyed, i_leaves):
    # The scope names the parameter in the compiled program's metadata, so the bytes of
    # each all-reduce can be traced back to its layer (flops.compiled_allreduces).
    with jax.named_scope(f"{SCOPE_PREFIX}[{path_string(key_path)}]"):
      reduced.append(_reduce_leaf(g, idx, axis_name, op))
  return treedef.unflatten(reduced)


def sparse_psum(grads: PyTree, indices: PyTree | None, axis_name: Any) -> PyTree:
  """``lax.psum`` of only the kept entries of each leaf; the rest come back zero.

  Must be called inside a function mapped over ``axis_name`` (``jax.pmap``,
  ``jax.shard_map``).

  Args:
      grads: pytree of per-device gradients.
      indices: pytree from :func:`mask_indices` with the leaves of ``grads``, matched by
          parameter path (an NNX ``State`` and a plain dict pair up; ``None`` leaves are
          reduced densely), or ``None`` for a fully dense reduction.
          Each leaf: sorted, unique flat positions in ``[0, size)``. Host (NumPy /
          concrete) indices are checked; traced indices cannot be, and out-of-range
          ones are then dropped and unsorted or duplicate ones give undefined results.
      axis_name: the mapped axis to reduce over.

  Returns:
      The reduced pytree; entries outside ``indices`` are zero.

  Raises:
      ValueError: ``indices`` that do not name the leaves of ``grads``; host-side
          ``indices`` that are not 1-D integer arrays of sorted, unique positions within
          their leaf.
  """
  return _reduce_tree(grads, indices, axis_name, jax.lax.psum)


def sparse_pmean(grads: PyTree, indices: PyTree | None, axis_name: Any) -> PyTree:
  """Like :func:`sparse_psum` but averages over the axis (data-parallel SGD)."""
  return _reduce_tree(grads, indices, axis_name, jax.lax.pmean)


def reduced_elements(params: PyTree, indices: PyTree | None = None) -> tuple[int, int]:
  """Elements sent per all-reduce: ``(sparse, dense)``, for volume accounting.

  Args:
      params: the parameter (or gradient) pytree: an NNX ``State`` as ``nnx.state(...)`` or
          ``nnx.as_pure(...)`` return it, or a plain dict.
      indices: :func:`mask_indices` of the masks, in any of those containers (matched to
          ``params`` by parameter path), or ``None`` for a dense reduction.

  Returns:
      ``(sparse, dense)``: the kept entries (every entry of a ``None`` leaf) and all entries.

  Raises:
      ValueError: ``indices`` does not name the same leaves as ``params``.
  """
  p_leaves = jax.tree.leaves(params)
  dense = sum(int(np.size(p)) for p in p_leaves)
  sparse = sum(
    int(np.size(p)) if i is None else int(np.shape(i)[0])
    for p, i in zip(p_leaves, _index_leaves(params, indices))
  )
  return sparse, dense


class AllreduceGradientsState(NamedTuple):
  """Stateless: the index arrays are static and live in the closure."""


def allreduce_gradients(
  axis_name: Any,
  *,
  indices: PyTree | None = None,
  mean: bool = True,
) -> optax.GradientTransformation:
  """Data-parallel gradient reduction that sends only unpruned entries.

  ClickTrain §5.3: after the hard prune the pruned weights stay zero, so only
  the gradient entries at kept positions are all-reduced. Put this first in an
  ``optax.chain`` inside the mapped train step.

  Args:
      axis_name: the ``pmap`` / ``shard_map`` axis to reduce over.
      indices: pytree from :func:`mask_indices` (built once when masks are
          final), or ``None`` to reduce every entry (the dense baseline).
      mean: average (``pmean``) rather than sum.

  Returns:
      An ``optax.GradientTransformation``.

  Example:
      >>> idx = mask_indices(final_masks)  # doctest: +SKIP
      >>> tx = optax.chain(allreduce_gradients("batch", indices=idx),
      ...                  optax.sgd(0.1, momentum=0.9))  # doctest: +SKIP
  """
  op = sparse_pmean if mean else sparse_psum

  def init_fn(params):
    del params
    return AllreduceGradientsState()

  def update_fn(updates, state, params=None):
    del params
    return op(updates, indices, axis_name), state

  return optax.GradientTransformation(init_fn, update_fn)


# The mapped axis whose index random layers fold into their keys while a data-parallel step
# is traced (read synchronously at trace time, as `jax.lax.axis_index` needs the axis bound).
_KEY_AXIS: contextvars.ContextVar = contextvars.ContextVar("device_key_axis", default=None)


@contextlib.contextmanager
def per_device_keys(axis_name: Any) -> Iterator[None]:
  """While tracing a mapped step, make :func:`device_key` fold in the device's axis index.

  Data parallelism replicates every random stream, so without this each device would draw
  the same random numbers for its own shard of the batch. Inside this context a random layer
  (e.g. SDGP's ``random`` / ``mvue`` data-gradient pruning) uses ``fold_in(key, axis_index)``
  for its draw, while the key it keeps in its state advances as on one device: the state
  stays replicated and the draws are reproducible from the seed and the device's position.

  Args:
    axis_name: the ``shard_map`` / ``pmap`` axis of the data-parallel step.
  """
  token = _KEY_AXIS.set(axis_name)
  try:
    yield
  finally:
    _KEY_AXIS.reset(token)


def device_key(key: jax.Array | None) -> jax.Array | None:
  """``key`` folded with this device's index inside :func:`per_device_keys`, else ``key``."""
  axis_name = _KEY_AXIS.get()
  if key is None or axis_name is None:
    return key
  return jax.random.fold_in(key, jax.lax.axis_index(axis_name))
