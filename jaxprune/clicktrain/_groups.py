"""Filter groups of ClickTrain's aligned mode: the per-kernel quantities lifted to groups.

In the aligned mode (``clicktrain(..., filter_groups=G)``) the filters of each pruned conv
form ``G`` groups, and a (group, input channel) pair takes the place of a kernel: every
quantity the paper defines per kernel (Eq. 1 pattern scores, Eq. 2 kernel scores, the DPPG
importance, the group-lasso norms) is summed over the group's filters. The per-layer states keep
their full ``(Cin, Cout)`` shapes with equal values within a group, so masks, read-outs,
checkpoints and channel slicing see the same trees as in the paper mode.

The partition is a ``(Cout,)`` int32 group id per filter held in the layer's state
(``ClickTrainLayerState.filter_group``): ``G`` runs of consecutive filters
(``filter_grouping="consecutive"``), or, with ``filter_grouping="clustered"``, the balanced
partition :func:`cluster_filters` chooses once when the patterns are finalized. Every lifting
reads the stored ids, with ``G`` segments (static under ``jit``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["cluster_filters", "first_filters", "group_ids", "group_sum", "lift"]

# Power iterations for the leading principal direction of the filters' features. The Gram
# matrix is at most Cout x Cout and the iteration runs once per layer and run; 128 steps
# separate the leading direction well beyond what the balanced cut needs.
_POWER_STEPS = 128


def group_ids(cout: int, groups: int) -> np.ndarray:
  """The group of each filter, as a ``(cout,)`` int32 array of consecutive runs.

  ``groups`` consecutive runs as equal as possible (equal when ``groups`` divides ``cout``: what
  ``clicktrain`` checks at ``init``).
  """
  groups = min(groups, cout)
  return np.concatenate(
    [
      np.full(len(run), k, np.int32)
      for k, run in enumerate(np.array_split(np.arange(cout), groups))
    ]
  )


def _ids(cout: int, groups: int, ids) -> tuple[jax.Array, int]:
  """The group ids to lift with (consecutive when ``ids`` is None) and the segment count."""
  if ids is None:
    consecutive = group_ids(cout, groups)
    return jnp.asarray(consecutive), int(consecutive.max()) + 1
  return jnp.asarray(ids, jnp.int32), groups


def group_sum(x: jax.Array, groups: int, axis: int = -1, ids=None) -> jax.Array:
  """Sums ``x`` over the filters of each group along ``axis`` (the filter axis).

  That axis becomes the group axis. ``ids``: the ``(Cout,)`` group of each filter (default
  consecutive groups, ``min(groups, size)`` of them); with ``ids`` the group axis is ``groups`` long
  (a group left empty by a channel surgery sums to 0).
  """
  axis = axis % x.ndim
  seg, num = _ids(x.shape[axis], groups, ids)
  moved = jnp.moveaxis(x, axis, 0)
  summed = jax.ops.segment_sum(moved, seg, num_segments=num)
  return jnp.moveaxis(summed, 0, axis)


def lift(x: jax.Array, groups: int, axis: int = -1, ids=None) -> jax.Array:
  """``x`` with every filter's entry along ``axis`` replaced by its group's sum.

  ``groups`` = 0: unchanged, the paper's fine-grained mode; ``ids`` as :func:`group_sum`.
  """
  axis = axis % x.ndim
  if not groups or groups >= x.shape[axis]:  # one filter per group: the kernel's own value
    return x
  seg, _ = _ids(x.shape[axis], groups, ids)
  return jnp.take(group_sum(x, groups, axis, ids), seg, axis=axis)


def first_filters(ids: jax.Array, groups: int) -> jax.Array:
  """The lowest filter of each group, as a ``(groups,)`` array.

  A group's representative column where the lifted values are equal within it; an empty group points
  at the last filter.
  """
  cout = ids.shape[0]
  first = jax.ops.segment_min(jnp.arange(cout, dtype=jnp.int32), ids, num_segments=groups)
  return jnp.minimum(first, cout - 1)


def _unit_rows(x: jax.Array) -> jax.Array:
  """Each row scaled to unit L2 norm (an all-zero row stays zero)."""
  norm = jnp.sqrt(jnp.sum(x * x, axis=1, keepdims=True))
  return x / jnp.where(norm > 0, norm, 1.0)


def cluster_filters(
  kernel_scores: jax.Array, pattern_scores: jax.Array | None, groups: int
) -> jax.Array:
  """A balanced partition of a layer's filters into ``groups`` groups whose scores agree.

  Each filter ``f`` is described by two unit-norm blocks: its Eq. 2 kernel scores over the
  input channels ``kernel_scores[:, f]`` (which channels matter to it: the kernels the group
  will keep or prune together), and, for a pattern layer, its per-kernel pattern preference
  ``pattern_scores[:, f, :]`` normalised to a distribution over the pool at each input channel
  (which taps it would keep). Unit norms compare the filters' profiles, not their magnitudes,
  and weigh the two blocks equally. The features are centred over the filters, the leading
  principal direction of the filters is found by power iteration on their ``Cout x Cout`` Gram
  matrix, the filters are ordered by their projection on it (stable: ties by index) and the
  order is cut into ``groups`` chunks of ``Cout / groups``. For two groups this is the
  spectral bisection of the filters; for more, the chunks are slabs along the direction along
  which the filters differ most. It is deterministic, balanced by construction (every group
  runs as one equal-sized product, ``AlignedConv``) and made of matrix products and a sort,
  so it runs inside ``jit``. Features that do not differ (e.g. all-zero scores) keep the
  consecutive groups.

  Groups are numbered by their lowest filter, so the partition has one canonical form.

  Args:
    kernel_scores: ``(Cin, Cout)`` summed Eq. 2 scores (>= 0).
    pattern_scores: ``(Cin, Cout, N)`` non-negative per-kernel pattern scores or votes over
      a pool of ``N`` patterns; ``None`` for a kernel-only layer.
    groups: ``G``, dividing ``Cout``.

  Returns:
    ``(Cout,)`` int32 group ids, ``Cout / G`` filters in each group.
  """
  cout = kernel_scores.shape[1]
  size = cout // groups
  blocks = [_unit_rows(jnp.asarray(kernel_scores, jnp.float32).T)]  # (Cout, Cin)
  if pattern_scores is not None:
    ps = jnp.asarray(pattern_scores, jnp.float32)
    total = jnp.sum(ps, axis=-1, keepdims=True)
    dist = ps / jnp.where(total > 0, total, 1.0)  # per kernel: a distribution over the pool
    blocks.append(_unit_rows(jnp.moveaxis(dist, 1, 0).reshape(cout, -1)))
  x = jnp.concatenate(blocks, axis=1)
  x = x - jnp.mean(x, axis=0, keepdims=True)
  gram = x @ x.T  # (Cout, Cout), positive semi-definite
  # Start from the Gram row of largest norm: it lies in the span of the filters' spread, so it
  # is not orthogonal to the leading direction unless every filter agrees (then gram = 0).
  v0 = gram[jnp.argmax(jnp.sum(gram * gram, axis=1))]

  def power(_, v):
    w = gram @ v
    n = jnp.sqrt(jnp.sum(w * w))
    return w / jnp.where(n > 0, n, 1.0)

  v = jax.lax.fori_loop(0, _POWER_STEPS, power, power(0, v0))
  v = v * jnp.where(v[jnp.argmax(jnp.abs(v))] < 0, -1.0, 1.0)  # one sign for the direction
  order = jnp.argsort(v, stable=True)
  chunk = jnp.zeros((cout,), jnp.int32).at[order].set(jnp.arange(cout, dtype=jnp.int32) // size)
  # Canonical numbering: groups in order of their lowest filter.
  rank = jnp.argsort(jnp.argsort(first_filters(chunk, groups), stable=True), stable=True)
  return rank.astype(jnp.int32)[chunk]
