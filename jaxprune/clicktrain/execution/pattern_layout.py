"""Fixed-position sparse layout of a pattern-pruned conv kernel (ClickTrain §5.1).

Once ClickTrain's patterns and kernels are final, the non-zero positions of a layer never
change again. The paper therefore builds the CSR index arrays (``rowPtr``, ``colInd``) once
and, before every sparse product, only *gathers* the current values at those fixed positions
instead of running a general dense → CSR conversion (cuSPARSE ``dense2csr``).

The sparse matrix is the conv's *filter matrix*: one row per filter (output channel) ``f``
and one column per input position ``r = c·kh·kw + i·kw + j`` (input channel ``c``, kernel
row ``i``, column ``j``), the order in which :func:`jax.lax.conv_general_dilated_patches`
flattens a patch. The convolution is then ``Y[p, f] = Σ_r W[f, r] · X_col[p, r]``.

:class:`PatternLayout` holds the column indices row by row, padded to the longest row (an ELL
layout): ``columns[f, :row_nnz[f]]`` are the kept positions of filter ``f`` in increasing
order, the padding repeats the row's last column (or 0) and is masked by ``valid``. When every
filter keeps the same number of weights (the paper's load-balance constraint, §5.2) there is
no padding and the layout is exactly CSR with equal rows; :attr:`PatternLayout.row_ptr` and
:attr:`PatternLayout.col_ind` give the CSR arrays in any case.

Index arrays are built once, on the host, by :func:`build_layout`; :func:`to_values`
(dense HWIO kernel → ``(Cout, width)`` values) and :func:`to_dense` (its inverse, zeros
elsewhere) are jit-able gathers / scatters that reuse them.

Example:
  >>> import numpy as np, jax.numpy as jnp
  >>> mask = np.zeros((3, 3, 2, 2), bool); mask[:2, :2] = True   # one 2x2 pattern everywhere
  >>> layout = build_layout(mask)
  >>> layout.width, layout.row_nnz.tolist()
  (8, [8, 8])
  >>> values = to_values(jnp.ones((3, 3, 2, 2)), layout)           # (Cout, width)
  >>> bool((to_dense(values, layout) == mask).all())
  True

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PatternLayout", "build_layout", "to_dense", "to_values", "transposed_values"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PatternLayout:
  """Row-padded (ELL) index arrays of one pattern-pruned HWIO kernel.

  A pytree: the index arrays are leaves (they travel through ``jit`` and into checkpoints),
  the kernel shape is static.

  Attributes:
    columns: ``(Cout, width)`` int32, kept filter-matrix columns of each filter, increasing;
      padding repeats the row's last column.
    valid: ``(Cout, width)`` bool, False on padding.
    kernel_shape: ``(kh, kw, Cin, Cout)`` of the dense kernel.
    transposed_entries: ``(Cin·kh·kw, width_t)`` int32, for each filter-matrix column the
      flat indices ``f·width + k`` of the entries ``(f, k)`` that read it, increasing; padding
      repeats the row's last index (or 0). ``None`` on layouts built without it.
    transposed_valid: ``(Cin·kh·kw, width_t)`` bool, False on padding.
  """

  columns: jax.Array
  valid: jax.Array
  kernel_shape: tuple[int, int, int, int] = dataclasses.field(metadata={"static": True})
  transposed_entries: jax.Array | None = None
  transposed_valid: jax.Array | None = None

  @property
  def width(self) -> int:
    """Entries per row (the longest row's non-zeros)."""
    return int(self.columns.shape[1])

  @property
  def row_nnz(self) -> np.ndarray:
    """Non-zeros per filter, ``(Cout,)``."""
    return np.asarray(self.valid).sum(axis=1)

  @property
  def balanced(self) -> bool:
    """Every filter keeps the same number of weights (no padding)."""
    return bool(np.asarray(self.valid).all())

  @property
  def row_ptr(self) -> np.ndarray:
    """CSR ``rowPtr``: ``(Cout + 1,)`` offsets into :attr:`col_ind`."""
    return np.concatenate([[0], np.cumsum(self.row_nnz)]).astype(np.int32)

  @property
  def col_ind(self) -> np.ndarray:
    """CSR ``colInd``: the kept columns of every row, concatenated."""
    return np.asarray(self.columns)[np.asarray(self.valid)].astype(np.int32)

  @property
  def nnz(self) -> int:
    return int(np.asarray(self.valid).sum())

  @property
  def sparsity(self) -> float:
    """Fraction of the kernel's weights that are zero."""
    return 1.0 - self.nnz / float(np.prod(self.kernel_shape))


def _as_binary_mask(mask: Any) -> np.ndarray:
  m = np.asarray(mask)
  if m.ndim != 4:
    raise ValueError(f"mask must be a 4-D HWIO kernel mask, got shape {m.shape}")
  if m.dtype != bool:
    if not np.all(np.isfinite(m)) or not np.all((m == 0) | (m == 1)):
      raise ValueError("mask must hold only 0 and 1 (or booleans)")
    m = m.astype(bool)
  return m


def build_layout(mask: Any, *, nnz_per_kernel: int | None = 4, kernel: Any = None) -> PatternLayout:
  """Index arrays of a pattern-pruned kernel, built once on the host (ClickTrain §5.1).

  Args:
    mask: ``(kh, kw, Cin, Cout)`` binary mask of the kept weights (ClickTrain's P ⊙ K).
    nnz_per_kernel: every kernel ``mask[:, :, c, f]`` must keep 0 or exactly this many
      weights (ClickTrain keeps 4 of 9); ``None`` accepts any count.
    kernel: optional dense kernel of the same shape, checked to be zero where ``mask`` is
      (a layout is only exact for weights that are already pruned).

  Returns:
    A :class:`PatternLayout`.

  Raises:
    ValueError: a mask that is not 4-D or not binary, a kernel with another number of
      non-zeros than ``nnz_per_kernel`` (the first offending kernel is named), a ``kernel``
      of another shape, or non-zero / non-finite weights at pruned positions.
  """
  m = _as_binary_mask(mask)
  kh, kw, cin, cout = m.shape
  if nnz_per_kernel is not None:
    counts = m.sum(axis=(0, 1))  # (Cin, Cout)
    bad = np.argwhere((counts != 0) & (counts != nnz_per_kernel))
    if bad.size:
      c, f = (int(v) for v in bad[0])
      raise ValueError(
        f"mask: kernel (input channel {c}, filter {f}) keeps {int(counts[c, f])} weights; "
        f"a pattern layout needs 0 or {nnz_per_kernel} per kernel ({len(bad)} kernels differ)"
      )
  if kernel is not None:
    w = np.asarray(kernel)
    if w.shape != m.shape:
      raise ValueError(f"kernel shape {w.shape} does not match mask shape {m.shape}")
    pruned = w[~m]
    if not np.all(np.isfinite(pruned)) or np.any(pruned != 0):
      raise ValueError("kernel has non-zero (or non-finite) weights at pruned positions")
  # Filter-matrix rows: (Cout, Cin*kh*kw) with column r = c*kh*kw + i*kw + j.
  rows = np.transpose(m, (3, 2, 0, 1)).reshape(cout, cin * kh * kw)
  row_nnz = rows.sum(axis=1)
  width = max(int(row_nnz.max()) if cout else 0, 1)
  columns, valid = _ell_rows([np.flatnonzero(r) for r in rows], width)
  # Transpose (§5.2 data gradient): entry (f, k) is flat index f*width + k; scanning the
  # valid entries in flat order keeps each column's list increasing.
  flat = np.flatnonzero(valid.ravel())
  order = np.argsort(columns.ravel()[flat], kind="stable")
  col_nnz = rows.sum(axis=0)
  t_width = max(int(col_nnz.max()) if col_nnz.size else 0, 1)
  t_entries, t_valid = _ell_rows(np.split(flat[order], np.cumsum(col_nnz)[:-1]), t_width)
  return PatternLayout(
    jnp.asarray(columns),
    jnp.asarray(valid),
    (kh, kw, cin, cout),
    jnp.asarray(t_entries),
    jnp.asarray(t_valid),
  )


def _ell_rows(members: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
  """Rows of increasing indices → row-padded ``(index, valid)``; padding repeats the last."""
  index = np.zeros((len(members), width), np.int32)
  valid = np.zeros((len(members), width), bool)
  for row, m in enumerate(members):
    index[row, : m.size] = m
    index[row, m.size :] = m[-1] if m.size else 0
    valid[row, : m.size] = True
  return index, valid


def _filter_matrix(kernel: jax.Array) -> jax.Array:
  """HWIO kernel → ``(Cout, Cin·kh·kw)`` filter matrix in patch order."""
  kh, kw, cin, cout = kernel.shape
  return jnp.transpose(kernel, (3, 2, 0, 1)).reshape(cout, cin * kh * kw)


def to_values(kernel: jax.Array, layout: PatternLayout) -> jax.Array:
  """Dense HWIO kernel → ``(Cout, width)`` values at the layout's fixed positions.

  The paper's ``Convert2CSR`` with pre-defined positions: one gather, no search. Padding
  entries are 0. Differentiable: the VJP scatters back to a dense kernel, zeros elsewhere.
  """
  if tuple(kernel.shape) != tuple(layout.kernel_shape):
    raise ValueError(
      f"kernel shape {tuple(kernel.shape)} does not match the layout's {layout.kernel_shape}"
    )
  fm = _filter_matrix(kernel)
  values = jnp.take_along_axis(fm, layout.columns, axis=1)
  return jnp.where(layout.valid, values, jnp.zeros((), values.dtype))


def to_dense(values: jax.Array, layout: PatternLayout) -> jax.Array:
  """Inverse of :func:`to_values`: ``(Cout, width)`` values → dense HWIO kernel, zeros elsewhere."""
  kh, kw, cin, cout = layout.kernel_shape
  if tuple(values.shape) != (cout, layout.width):
    raise ValueError(
      f"values shape {tuple(values.shape)} is not (Cout, width) = {(cout, layout.width)}"
    )
  values = jnp.where(layout.valid, values, jnp.zeros((), values.dtype))
  rows = jnp.arange(cout)[:, None]
  fm = jnp.zeros((cout, cin * kh * kw), values.dtype).at[rows, layout.columns].add(values)
  return jnp.transpose(fm.reshape(cout, cin, kh, kw), (2, 3, 1, 0))


def transposed_values(values: jax.Array, layout: PatternLayout) -> jax.Array:
  """``(Cout, width)`` values → the ``(Cin·kh·kw, width_t)`` values of ``Wᵀ`` (one gather).

  Row ``r`` holds the weights of filter-matrix column ``r`` in the order of
  ``layout.transposed_entries``; the filter of each is ``transposed_entries // width``.
  Padding entries are 0.

  Raises:
    ValueError: a layout without the transposed index arrays, or a values shape mismatch.
  """
  if layout.transposed_entries is None or layout.transposed_valid is None:
    raise ValueError("layout has no transposed index arrays; build it with build_layout")
  cout = layout.kernel_shape[3]
  if tuple(values.shape) != (cout, layout.width):
    raise ValueError(
      f"values shape {tuple(values.shape)} is not (Cout, width) = {(cout, layout.width)}"
    )
  gathered = jnp.take(values.reshape(-1), layout.transposed_entries, axis=0)
  return jnp.where(layout.transposed_valid, gathered, jnp.zeros((), values.dtype))
