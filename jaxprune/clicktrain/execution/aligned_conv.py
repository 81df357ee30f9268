"""Group-shared ("aligned") pattern-sparse convolution: static slices and one matrix product.

The paper's fine-grained patterns (a 4-of-9 pattern per kernel, ClickTrain §4) give every
filter its own sparse row, which a GPU runs as an irregular SpMM well below cuDNN's speed. On
an aligned layout (:mod:`jaxprune.clicktrain.execution.aligned_layout`: filters in groups
sharing each kept input channel's pattern) the kept channels of each group are gathered in
pattern order, so each pattern's channels are contiguous; each tap of a pattern is a static
spatial slice of the padded input; the slices are concatenated along channels and multiplied
by the packed kept weights in one dense matrix product, batched over the groups:

    Y_g[(n, h, w), f] = Σ_r X_cols[(n, h, w), r] · W_g[r, f],   r = (pattern, tap, channel)

a contraction of ``4 · kept`` instead of ``9 · Cin``. With several groups a (tap, channel)
pair two groups keep is made twice; ``columns="shared"`` instead makes the union of the
groups' pairs once and multiplies it by every filter's masked packed weights (one product,
more multiply-adds, fewer columns written: :func:`shared_columns`). The kernel stays the dense HWIO
parameter: the packed weights are gathered from it on every call (weights are far fewer than
activations), so its gradient is the scattered packed gradient, zero at pruned positions. The
data and weight gradients are autodiff's transposes of the slices and products; the channel
gather's transpose is written as a gather too (no scatter).

Beyond the paper, after the 1×N block pattern (Lin et al., 2021) and column-vector-wise
sparsity (Tan et al., 2022): group the filters that agree, then share. Measured cost against
cuDNN and XLA:CPU: ``experiments/results/benchmarks/`` (``aligned_bench``).

Example::

  layout = build_aligned_layout(mask, filter_groups=2)     # mask: HWIO 0/1, shared per group
  y = aligned_conv(x, kernel, layout, strides=1, padding="SAME")   # == conv(x, kernel * mask)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxprune._conv_args import canonical_padding, spatial_pair
from jaxprune.clicktrain.execution.aligned_layout import AlignedGroup, AlignedLayout, tap_blocks

__all__ = ["COLUMNS", "AlignedConvFn", "aligned_conv", "check_columns", "shared_columns"]

# How an aligned conv of several filter groups makes its im2col columns (see aligned_conv).
COLUMNS = ("per_group", "shared")


def check_columns(columns: str | None, *, optional: bool = False) -> None:
  """Raises ``ValueError`` naming ``columns`` unless it is one of :data:`COLUMNS`.

  None is accepted where ``optional``: the dispatch measures both.
  """
  if columns in COLUMNS or (optional and columns is None):
    return
  allowed = ("None", *COLUMNS) if optional else COLUMNS
  raise ValueError(f"columns must be one of {', '.join(allowed)}; got {columns!r}")


def _inverse_positions(channels: tuple[int, ...], cin: int) -> np.ndarray:
  """``(D, cin)``: each channel's ``d``-th position in ``channels``, or ``len(channels)`` (a
  zero column) where it occurs fewer than ``d + 1`` times; ``D``: the most any occurs."""
  positions: list[list[int]] = [[] for _ in range(cin)]
  for k, c in enumerate(channels):
    positions[c].append(k)
  depth = max(1, max(len(p) for p in positions))
  inverse = np.full((depth, cin), len(channels), np.int32)
  for c, ks in enumerate(positions):
    inverse[: len(ks), c] = ks
  return inverse


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _select_channels(x: jax.Array, channels: tuple[int, ...], cin: int) -> jax.Array:
  del cin
  return jnp.take(x, jnp.asarray(channels, jnp.int32), axis=3)


def _select_channels_fwd(x, channels, cin):
  return _select_channels(x, channels, cin), None


def _select_channels_bwd(channels, cin, residual, g):
  # A gather's transpose is a scatter-add; with the positions fixed it is a gather from the
  # cotangent padded with a zero column (one gather per repeat of a channel across groups).
  del residual
  padded = jnp.concatenate([g, jnp.zeros((*g.shape[:3], 1), g.dtype)], axis=3)
  inverse = _inverse_positions(channels, cin)
  dx = jnp.take(padded, jnp.asarray(inverse[0]), axis=3)
  for row in inverse[1:]:
    dx = dx + jnp.take(padded, jnp.asarray(row), axis=3)
  return (dx,)


_select_channels.defvjp(_select_channels_fwd, _select_channels_bwd)


def _take_channels(x: jax.Array, channels: tuple[int, ...]) -> jax.Array:
  """``x[..., channels]``: a static slice when the channels are one increasing run."""
  if channels == tuple(range(channels[0], channels[0] + len(channels))):
    if len(channels) == x.shape[3]:
      return x
    return lax.slice_in_dim(x, channels[0], channels[0] + len(channels), axis=3)
  return _select_channels(x, channels, x.shape[3])


def _columns(xg: jax.Array, groups: Sequence[AlignedGroup], out_hw, strides) -> jax.Array:
  """Im2col columns ``(N, OH, OW, Σ contraction)`` of ``groups`` from ``xg`` (the groups'
  channels side by side, padded): static slices, one concat."""
  n = xg.shape[0]
  (oh, ow), (sh, sw) = out_hw, strides
  cols, start = [], 0
  for group in groups:
    for taps, chans in group.blocks:
      for i, j in taps:
        limit = (n, i + (oh - 1) * sh + 1, j + (ow - 1) * sw + 1, start + len(chans))
        cols.append(lax.slice(xg, (0, i, j, start), limit, (1, sh, sw, 1)))
      start += len(chans)
  return cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=3)


def _packed_weights(kernel: jax.Array, group: AlignedGroup) -> jax.Array:
  """The group's ``(contraction, F_g)`` kept weights, rows in the columns' order."""
  rows = [(i, j, c) for taps, chans in group.blocks for i, j in taps for c in chans]
  i, j, c = (np.asarray(v, np.int32) for v in zip(*rows))
  f = np.asarray(group.filters, np.int32)
  if f.size == kernel.shape[3] and (f == np.arange(f.size)).all():
    return kernel[i, j, c, :]
  return kernel[i[:, None], j[:, None], c[:, None], f[None, :]]


@functools.lru_cache(maxsize=256)
def shared_columns(layout: AlignedLayout) -> tuple[AlignedGroup, np.ndarray, np.ndarray]:
  """The layout's groups folded into one over the union of their (tap, input channel) pairs.

  Every (tap, channel) pair that some group reads becomes one column, materialized once and
  read by every filter: one matrix product with no filter permutation, whose contraction is
  the union's size rather than each group's. The group's packed weights are masked: a group
  that does not read a column multiplies it by an exact zero, and its weight there gets a zero
  gradient. The mask is kept per group and spread to the filters when called, so a compiled
  step holds ``contraction × G`` booleans, not ``contraction × Cout`` (large constants make
  XLA:CPU's compiler run out of memory on a whole ResNet).

  Returns:
    ``(group, group_mask, filter_group)``: an :class:`AlignedGroup` of every filter whose
    blocks are the union's tap sets; the ``(contraction, G)`` bool mask of the pairs each
    layout group keeps; each filter's group, ``(Cout,)`` int32 (the packed weights' mask is
    ``group_mask[:, filter_group]``).
  """
  m = layout.mask()
  blocks = tap_blocks(m.any(axis=3))
  group = AlignedGroup(tuple(range(m.shape[3])), blocks)
  rows = [(i, j, c) for taps, chans in blocks for i, j in taps for c in chans]
  first = [g.filters[0] for g in layout.groups]
  i, j, c = (np.asarray(v, np.int32) for v in zip(*rows)) if rows else [np.zeros(0, np.int32)] * 3
  group_mask = m[i[:, None], j[:, None], c[:, None], np.asarray(first)[None, :]] > 0
  filter_group = np.zeros(m.shape[3], np.int32)
  for k, g in enumerate(layout.groups):
    filter_group[list(g.filters)] = k
  return group, group_mask, filter_group


def _group_products(x, kernel, groups, pads, out_hw, strides, precision, preferred, shared=None):
  """``(N, OH, OW, Σ F_g)`` of ``groups`` of one contraction size: one channel gather, one
  concat of static slices, one matrix product batched over the groups (``shared``: the
  ``(group_mask, filter_group)`` of a single shared group, :func:`shared_columns`)."""
  xg = _take_channels(x, tuple(c for g in groups for c in g.channels))
  xg = jnp.pad(xg, ((0, 0), *pads, (0, 0)))
  cols = _columns(xg, groups, out_hw, strides)
  cols = cols.reshape(-1, len(groups), groups[0].contraction)
  weights = jnp.stack([_packed_weights(kernel, g) for g in groups]).astype(cols.dtype)
  if shared is not None:
    group_mask, filter_group = (jnp.asarray(a) for a in shared)
    weights = jnp.where(group_mask[:, filter_group], weights, jnp.zeros((), weights.dtype))
  y = jnp.einsum(
    "mgr,grf->mgf", cols, weights, precision=precision, preferred_element_type=preferred
  )
  return y.reshape(x.shape[0], *out_hw, -1)


def aligned_conv(
  x: jax.Array,
  kernel: jax.Array,
  layout: AlignedLayout,
  *,
  strides: int | Sequence[int] = 1,
  padding: Any = "SAME",
  precision: Any = None,
  preferred_element_type: Any = None,
  columns: str = "per_group",
) -> jax.Array:
  """``conv(x, kernel * layout.mask())`` (NHWC × HWIO) as slices + one GEMM per group.

  Args:
    x: ``(N, H, W, Cin)`` input.
    kernel: ``(kh, kw, Cin, Cout)`` dense kernel; weights outside the layout are ignored (and
      get a zero gradient).
    layout: from :func:`~jaxprune.clicktrain.execution.aligned_layout.build_aligned_layout`.
    strides: an int or ``(sh, sw)``.
    padding: ``"SAME"``, ``"VALID"`` or explicit ``((top, bottom), (left, right))``.
    precision, preferred_element_type: passed to the matrix products.
    columns: ``"per_group"``: each group's columns, one product batched over the groups (the
      fewest multiply-adds; the columns of a pair two groups read are made twice);
      ``"shared"``: the union of the groups' (tap, channel) pairs made once and one product
      over every filter (:func:`shared_columns`: fewer columns to write when the groups keep
      much the same inputs, more multiply-adds). One group: the same either way.

  Returns:
    ``(N, OH, OW, Cout)``. Per group, a pruned weight is absent rather than a multiplying
    zero: a non-finite input reaches only the outputs that read it through a kept weight.
    Shared, it reaches every filter's outputs that read it through a pair some group keeps
    (``0 · nan``), as in the dense masked conv (which spreads it through every pair).

  Raises:
    ValueError: shapes that do not match the layout, bad strides / padding, or ``columns``
      not one of :data:`COLUMNS`.
  """
  check_columns(columns)
  kh, kw, cin, cout = layout.kernel_shape
  if tuple(kernel.shape) != tuple(layout.kernel_shape):
    raise ValueError(f"kernel shape {tuple(kernel.shape)} != layout's {layout.kernel_shape}")
  if x.ndim != 4 or x.shape[3] != cin:
    raise ValueError(f"x must be (N, H, W, {cin}), got {tuple(x.shape)}")
  strides = spatial_pair(strides, "strides")
  padding = canonical_padding(padding)
  if isinstance(padding, str):
    padding = tuple(lax.padtype_to_pads(x.shape[1:3], (kh, kw), strides, padding))
  (pt, pb), (pl, pr) = padding
  out_hw = (
    (x.shape[1] + pt + pb - kh) // strides[0] + 1,
    (x.shape[2] + pl + pr - kw) // strides[1] + 1,
  )
  if min(out_hw) < 1:
    raise ValueError(f"x {tuple(x.shape)} is smaller than the kernel after padding {padding}")
  if columns == "shared" and len(layout.groups) > 1:
    group, *shared = shared_columns(layout)
    if not group.blocks:
      dtype = preferred_element_type or jnp.result_type(x.dtype, kernel.dtype)
      return jnp.zeros((x.shape[0], *out_hw, cout), dtype)
    return _group_products(
      x, kernel, [group], padding, out_hw, strides, precision, preferred_element_type, shared
    )
  # Groups of one shape (as many channels kept and as many filters: the usual case) run as
  # one batched product; a layout with groups of several shapes (e.g. after PruneTrain removed
  # filters from some groups) runs one batched product per shape.
  batches: dict[tuple[int, int], list[AlignedGroup]] = {}
  for g in layout.groups:
    if g.blocks:
      batches.setdefault((g.contraction, len(g.filters)), []).append(g)
  parts, order = [], []
  for batch in batches.values():
    parts.append(
      _group_products(x, kernel, batch, padding, out_hw, strides, precision, preferred_element_type)
    )
    order += [f for g in batch for f in g.filters]
  pruned = [f for g in layout.groups if not g.blocks for f in g.filters]
  if pruned:  # groups with every channel pruned output zeros
    dtype = preferred_element_type or jnp.result_type(x.dtype, kernel.dtype)
    parts.append(jnp.zeros((x.shape[0], *out_hw, len(pruned)), dtype))
    order += pruned
  y = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=3)
  if tuple(order) != tuple(range(cout)):  # filters produced out of order: permute back once
    y = jnp.take(y, jnp.asarray(np.argsort(order), jnp.int32), axis=3)
  return y


@dataclasses.dataclass(frozen=True)
class AlignedConvFn:
  """:func:`aligned_conv` with ``lax.conv_general_dilated``'s signature (hashable).

  What an ``nnx.Conv``'s ``conv_general_dilated`` attribute can hold: the layer keeps its
  Variables and its call, and only the convolution changes.
  """

  layout: AlignedLayout
  columns: str = "per_group"

  def __call__(
    self,
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
    preferred_element_type=None,
    **unused,
  ):
    del dimension_numbers, unused  # nnx.Conv: always NHWC × HWIO
    for name, value in (("lhs_dilation", lhs_dilation), ("rhs_dilation", rhs_dilation)):
      if value is not None and tuple(np.broadcast_to(value, (2,))) != (1, 1):
        raise ValueError(f"{name} {value!r} is not supported by the aligned convolution")
    if feature_group_count != 1:
      raise ValueError("feature_group_count: grouped convolutions are not supported")
    return aligned_conv(
      lhs,
      rhs,
      self.layout,
      strides=tuple(window_strides),
      padding=padding,
      precision=precision,
      preferred_element_type=preferred_element_type,
      columns=self.columns,
    )
