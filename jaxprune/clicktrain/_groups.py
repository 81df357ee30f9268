"""Filter groups of ClickTrain's aligned mode: the per-kernel quantities lifted to groups.

In the aligned mode (``clicktrain(..., filter_groups=G)``) the filters of each pruned conv
form ``G`` groups of consecutive output channels, and a (group, input channel) pair takes the
place of a kernel: every quantity the paper defines per kernel (Eq. 1 pattern scores, Eq. 2
kernel scores, the DPPG importance, the group-lasso norms) is summed over the group's filters.
The per-layer states keep their full ``(Cin, Cout)`` shapes with equal values within a group,
so masks, read-outs, checkpoints and channel slicing see the same trees as in the paper mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["group_ids", "group_sum", "lift"]


def group_ids(cout: int, groups: int) -> np.ndarray:
  """``(cout,)`` int32: the group of each filter, ``groups`` consecutive runs as equal as
  possible (equal when ``groups`` divides ``cout``: what ``clicktrain`` checks at ``init``;
  a PruneTrain reconfiguration may leave other widths)."""
  groups = min(groups, cout)
  return np.concatenate(
    [
      np.full(len(run), k, np.int32)
      for k, run in enumerate(np.array_split(np.arange(cout), groups))
    ]
  )


def group_sum(x: jax.Array, groups: int, axis: int = -1) -> jax.Array:
  """Sums ``x`` over the filters of each group along ``axis`` (the filter axis): that axis
  becomes the group axis (``min(groups, size)`` long)."""
  axis = axis % x.ndim
  ids = group_ids(x.shape[axis], groups)
  moved = jnp.moveaxis(x, axis, 0)
  summed = jax.ops.segment_sum(moved, jnp.asarray(ids), num_segments=int(ids.max()) + 1)
  return jnp.moveaxis(summed, 0, axis)


def lift(x: jax.Array, groups: int, axis: int = -1) -> jax.Array:
  """``x`` with every filter's entry along ``axis`` replaced by its group's sum (``groups``
  = 0: unchanged, the paper's fine-grained mode)."""
  axis = axis % x.ndim
  if not groups or groups >= x.shape[axis]:  # one filter per group: the kernel's own value
    return x
  ids = group_ids(x.shape[axis], groups)
  return jnp.take(group_sum(x, groups, axis), jnp.asarray(ids), axis=axis)
