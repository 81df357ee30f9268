"""The aligned (group-shared) pattern layout of a pruned conv kernel: built once, hashable.

In the aligned layout the filters of a conv are split into groups, and within a group every
input channel is either pruned or keeps **one** set of taps (a ClickTrain pattern) shared by
all the group's filters. :func:`build_aligned_layout` reads such a layout off a 0/1 mask
(checking the sharing) and :func:`aligned_mask` writes the mask of per-(group, channel) tap
sets; :mod:`jaxprune.clicktrain.execution.aligned_conv` runs the convolution on it.
``docs/design.md`` (ClickTrain, aligned mode) says why and how the paper's quantities are
lifted to groups.

Example:
  >>> import numpy as np
  >>> taps = np.zeros((2, 3, 3, 3)); taps[:, 0, 1, :] = 1; taps[:, 0, 0, 1] = 1  # channel 0
  >>> layout = build_aligned_layout(aligned_mask(taps, 4), filter_groups=2)
  >>> [g.filters for g in layout.groups], layout.nnz
  ([(0, 1), (2, 3)], 16)
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import numpy as np

from jaxprune.clicktrain.execution.pattern_layout import _as_binary_mask

__all__ = [
  "AlignedGroup",
  "AlignedLayout",
  "aligned_mask",
  "build_aligned_layout",
  "group_filters",
  "tap_blocks",
]

Taps = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class AlignedGroup:
  """One group of filters sharing their input channels' tap sets.

  Attributes:
    filters: the output channels of the group, increasing.
    blocks: ``((taps, channels), ...)``: each distinct tap set of the group (``taps``: kernel
      positions ``(i, j)``, row-major) with the input channels that keep it, increasing.
      Channels absent from every block are pruned for the whole group.
  """

  filters: tuple[int, ...]
  blocks: tuple[tuple[Taps, tuple[int, ...]], ...]

  @property
  def channels(self) -> tuple[int, ...]:
    """The kept input channels in the order the columns read them (block by block)."""
    return tuple(c for _, chans in self.blocks for c in chans)

  @property
  def contraction(self) -> int:
    """Rows of the group's packed weight matrix: Σ over blocks of taps · channels."""
    return sum(len(taps) * len(chans) for taps, chans in self.blocks)


@dataclasses.dataclass(frozen=True)
class AlignedLayout:
  """Static description of an aligned pattern-pruned HWIO kernel (hashable, built once).

  Attributes:
    kernel_shape: ``(kh, kw, Cin, Cout)``.
    groups: one :class:`AlignedGroup` per filter group; together they cover every filter once.
  """

  kernel_shape: tuple[int, int, int, int]
  groups: tuple[AlignedGroup, ...]

  @property
  def nnz(self) -> int:
    """Kept weights."""
    return sum(g.contraction * len(g.filters) for g in self.groups)

  @property
  def sparsity(self) -> float:
    """Fraction of the kernel's weights that are zero."""
    return 1.0 - self.nnz / float(np.prod(self.kernel_shape))

  @property
  def filter_order(self) -> tuple[int, ...]:
    """The filters in the order the groups produce them."""
    return tuple(f for g in self.groups for f in g.filters)

  def mask(self) -> np.ndarray:
    """The ``(kh, kw, Cin, Cout)`` float32 0/1 mask of the kept weights."""
    m = np.zeros(self.kernel_shape, np.float32)
    for group in self.groups:
      f = np.asarray(group.filters)
      for taps, chans in group.blocks:
        for i, j in taps:
          m[i, j, np.asarray(chans)[:, None], f[None, :]] = 1.0
    return m


def group_filters(filter_groups: Any, cout: int) -> tuple[tuple[int, ...], ...]:
  """``filter_groups`` (a count of consecutive groups, or explicit groups) → filter tuples.

  Args:
    filter_groups: an int ``G`` ≥ 1 dividing ``cout`` (groups of ``cout / G`` consecutive
      filters), or a sequence of filter-index sequences partitioning ``range(cout)``.
    cout: the conv's output channels.

  Raises:
    ValueError: ``G`` not a positive int dividing ``cout``, or groups that do not partition
      the filters.
  """
  if isinstance(filter_groups, (int, np.integer)) and not isinstance(filter_groups, bool):
    g = int(filter_groups)
    if g < 1 or cout % g:
      raise ValueError(
        f"filter_groups must be a positive int dividing the {cout} filters, got {filter_groups}"
      )
    size = cout // g
    return tuple(tuple(range(k * size, (k + 1) * size)) for k in range(g))
  try:
    groups = tuple(tuple(operator.index(f) for f in group) for group in filter_groups)
  except TypeError:
    raise ValueError(
      f"filter_groups must be an int or a sequence of filter-index groups, got {filter_groups!r}"
    ) from None
  flat = sorted(f for group in groups for f in group)
  if flat != list(range(cout)) or any(not group for group in groups):
    raise ValueError(f"filter_groups must partition the {cout} filters into non-empty groups")
  return tuple(tuple(sorted(group)) for group in groups)


def _runs_of_equal_filters(m: np.ndarray) -> list[list[int]]:
  """Maximal runs of consecutive filters with identical masks (``filter_groups="auto"``)."""
  runs = [[0]] if m.shape[3] else []
  for f in range(1, m.shape[3]):
    if np.array_equal(m[..., f], m[..., f - 1]):
      runs[-1].append(f)
    else:
      runs.append([f])
  return runs


def tap_blocks(channel_taps: np.ndarray) -> tuple[tuple[Taps, tuple[int, ...]], ...]:
  """``(kh, kw, Cin)`` 0/1 taps per input channel → :attr:`AlignedGroup.blocks`.

  Each distinct tap set (row-major positions; sets ordered lexicographically) with its channels,
  increasing; channels without a tap are left out.
  """
  by_taps: dict[Taps, list[int]] = {}
  for c in range(channel_taps.shape[2]):
    taps = tuple((int(i), int(j)) for i, j in np.argwhere(channel_taps[:, :, c]))
    if taps:
      by_taps.setdefault(taps, []).append(c)
  return tuple((taps, tuple(by_taps[taps])) for taps in sorted(by_taps))


def build_aligned_layout(mask: Any, filter_groups: Any = 1) -> AlignedLayout:
  """The aligned layout of ``mask``, checking that it is shared within each filter group.

  Args:
    mask: ``(kh, kw, Cin, Cout)`` binary mask of the kept weights.
    filter_groups: as :func:`group_filters`, or ``"auto"``: the maximal runs of consecutive
      filters whose masks are equal (always succeeds; e.g. after a PruneTrain reconfiguration
      removed filters unevenly from the groups of ClickTrain's aligned mode).

  Returns:
    An :class:`AlignedLayout`; blocks are ordered by tap set (row-major positions, then
    lexicographic), channels increasing within a block.

  Raises:
    ValueError: a mask that is not 4-D binary, bad ``filter_groups``, or a mask whose kernels
      differ within a group (the first offending filter and channel are named).
  """
  m = _as_binary_mask(mask)
  kh, kw, cin, cout = m.shape
  if isinstance(filter_groups, str):
    if filter_groups != "auto":
      raise ValueError(f"filter_groups must be an int, groups or 'auto', got {filter_groups!r}")
    filter_groups = _runs_of_equal_filters(m)
  groups = []
  for filters in group_filters(filter_groups, cout):
    sub = m[:, :, :, list(filters)]  # (kh, kw, Cin, F_g)
    differs = np.argwhere((sub != sub[..., :1]).any(axis=(0, 1)))
    if differs.size:
      c, k = (int(v) for v in differs[0])
      raise ValueError(
        f"mask is not shared within filter group {filters[0]}..{filters[-1]}: filter "
        f"{filters[k]} differs from filter {filters[0]} at input channel {c}"
      )
    groups.append(AlignedGroup(tuple(filters), tap_blocks(sub[..., 0])))
  return AlignedLayout((kh, kw, cin, cout), tuple(groups))


def aligned_mask(channel_taps: Any, cout: int, filter_groups: Any = None) -> np.ndarray:
  """The HWIO mask of per-(group, input channel) tap sets.

  Args:
    channel_taps: ``(G, Cin, kh, kw)`` 0/1: the taps each input channel keeps in each group
      (all zero: pruned for the group).
    cout: the conv's output channels.
    filter_groups: as :func:`group_filters` with ``G`` groups; default ``G`` consecutive groups.

  Returns:
    ``(kh, kw, Cin, Cout)`` float32 mask.

  Raises:
    ValueError: ``channel_taps`` not 4-D, or a group count that differs from ``filter_groups``.
  """
  taps = np.asarray(channel_taps, np.float32)
  if taps.ndim != 4:
    raise ValueError(f"channel_taps must be (G, Cin, kh, kw), got shape {taps.shape}")
  groups = group_filters(taps.shape[0] if filter_groups is None else filter_groups, cout)
  if len(groups) != taps.shape[0]:
    raise ValueError(f"channel_taps has {taps.shape[0]} groups, filter_groups {len(groups)}")
  mask = np.zeros((*taps.shape[2:], taps.shape[1], cout), np.float32)
  for k, filters in enumerate(groups):
    mask[:, :, :, list(filters)] = np.transpose(taps[k], (1, 2, 0))[..., None]
  return mask
