"""Pallas (Triton backend) kernels for pattern-sparse convolution (ClickTrain §5.2).

A pattern-pruned convolution is a sparse × dense product: the ``(Cout, K)`` filter matrix
(``K = Cin·kh·kw``), held as a row-padded ELL layout — ``values (R, width)`` and
``columns (R, width)`` int32 — times the unfolded input. The kernels work on the transposed,
coalesced form of ClickTrain §5.2: the unfolded input is ``Xt (K, P)`` (``P = N·OH·OW``), so
the column a kept weight reads is one contiguous row of ``Xt``, and an output tile is a
``(BR, BP)`` block of ``Yt (Cout, P)``. Tiling is 1-D along ``P`` per row block; every
program runs the same number of steps (the row width), which is the paper's load balance
when every filter keeps the same number of weights.

Kernels:
  * :func:`spmm` — ``Yt[r, p] = Σ_j values[r, j] · Xt[columns[r, j], p]``. Grid over (row
    tiles, P tiles), a loop over the ``width`` entries; each step gathers a ``(BR, BP)``
    tile (one coalesced row segment per row) and accumulates ``values[:, j] ⊗ tile`` in
    float32. The forward pass, and the data gradient on the *transposed* layout (for each
    filter-matrix column, the (filter, entry) pairs that read it): ``dXt = Wᵀ · dYt`` is the
    same product with rows = columns of ``W`` and ``Xt`` = ``dYt``.
  * :func:`kept_weight_grad` — ``dvalues[r, j] = Σ_p dYt[r, p] · Xt[columns[r, j], p]``:
    the weight gradient at the kept positions only (§5.2, backward phase). Grid over (row
    tiles, width entries), a loop over P tiles with a ``(BR, BP)`` float32 accumulator
    reduced once at the end.

What Pallas Triton lowers, and why the kernels look like this (probed on JAX 0.10):
  * The gather indexes the ref with two broadcast integer arrays,
    ``x_ref.at[idx[:, None], p[None, :]]``, not ``x_ref.at[idx, pl.ds(p0, BP)]``: both lower
    to Triton (a pointer tensor ``base + idx·P + p``, contiguous along ``p``), but the
    interpreter's load rule (``interpret=True``, the CPU test path) implements only
    all-slice or all-array indexers.
  * Ragged tiles (``R`` or ``P`` not a multiple of the tile) use
    :func:`jax.experimental.pallas.triton.load` / ``store`` with masks and ``other=0`` on
    whole-array refs (no ``BlockSpec``): Triton tensors must have power-of-two sizes, the
    arrays need not.
  * Loops are ``lax.fori_loop`` with static trip counts (``scf.for`` in Triton).
  * Flat offsets are int32: :func:`supports` rejects operands of 2³¹ elements or more.

Only Pallas → Triton IR runs in the default test suite (CUDA cross-lowering on CPU). An
opt-in test feeds that IR to a separately installed ``triton`` compiler (3.9.0 checked), which
takes both kernels through its own passes to PTX and cubin for sm_80 and sm_90 on CPU.

The pure-JAX references (:func:`spmm_reference`, :func:`kept_weight_grad_reference`) are
the test oracles; on CPU the kernels run with ``interpret=True``.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

Array = jax.Array

__all__ = [
  "kept_weight_grad",
  "kept_weight_grad_reference",
  "spmm",
  "spmm_reference",
  "supports",
]

# Default tiles: a (rows × P) float32 accumulator of 32×128 (SpMM) or 16×256 (weight
# gradient) holds 32 values per thread at 4 warps, enough work per gather to hide latency.
_SPMM_TILE = (32, 128)
_GRAD_TILE = (16, 256)
_NUM_WARPS = 4
_INT32_LIMIT = 2**31


def supports(num_rows: int, num_columns: int, num_points: int) -> bool:
  """Whether the kernels handle a ``(num_rows, num_columns)`` sparse matrix × ``(num_columns, P)``.

  Offsets into both dense operands are int32, so each must have fewer than 2³¹ elements.
  """
  return max(num_rows, num_columns) * max(num_points, 1) < _INT32_LIMIT


def spmm_reference(values: Array, columns: Array, xt: Array) -> Array:
  """Pure-JAX :func:`spmm`: ``Yt[r, p] = Σ_j values[r, j] · xt[columns[r, j], p]`` (float32)."""
  gathered = jnp.take(xt, columns, axis=0).astype(jnp.float32)  # (R, width, P)
  return jnp.einsum("rj,rjp->rp", values.astype(jnp.float32), gathered)


def kept_weight_grad_reference(dyt: Array, xt: Array, columns: Array) -> Array:
  """Pure-JAX :func:`kept_weight_grad`: ``Σ_p dyt[r, p] · xt[columns[r, j], p]`` (float32)."""
  gathered = jnp.take(xt, columns, axis=0).astype(jnp.float32)  # (R, width, P)
  return jnp.einsum("rp,rjp->rj", dyt.astype(jnp.float32), gathered)


def _tile(size: int, cap: int) -> int:
  """Power-of-two tile: ``cap`` or the smallest power of two covering ``size``."""
  return min(cap, pl.next_power_of_2(max(size, 1)))


def _default_interpret() -> bool:
  return jax.default_backend() not in ("gpu", "cuda", "rocm")


def _check(values_shape, columns, xt, name: str) -> None:
  if columns.ndim != 2 or not jnp.issubdtype(columns.dtype, jnp.integer):
    raise ValueError(f"columns must be a 2-D integer array, got {columns.dtype}{columns.shape}")
  if tuple(values_shape) != tuple(columns.shape):
    raise ValueError(f"{name} shape {tuple(values_shape)} does not match columns {columns.shape}")
  if xt.ndim != 2:
    raise ValueError(f"xt must be 2-D (K, P), got shape {xt.shape}")
  if not supports(columns.shape[0], xt.shape[0], xt.shape[1]):
    raise ValueError(f"xt: {xt.shape} is too large for int32 offsets (see supports())")


def _launch(body, operands, *, points, tile, interpret, out_shape, over_points, name):
  """Runs ``body`` on a (row tiles, P tiles or width entries) grid; operands[0] = columns."""
  rows, width = operands[0].shape
  block_r, block_p = _tile(rows, tile[0]), _tile(points, tile[1])
  if interpret is None:
    interpret = _default_interpret()
  return pl.pallas_call(
    functools.partial(body, block_r=block_r, block_p=block_p, rows=rows, points=points),
    out_shape=out_shape,
    grid=(pl.cdiv(rows, block_r), pl.cdiv(points, block_p) if over_points else width),
    interpret=interpret,
    compiler_params=plt.CompilerParams(num_warps=_NUM_WARPS, num_stages=2),
    name=name,
  )(*operands)


def _spmm_kernel(cols_ref, vals_ref, x_ref, o_ref, *, block_r, block_p, rows, points):
  r0 = pl.program_id(0) * block_r
  p0 = pl.program_id(1) * block_p
  row_ok = r0 + jnp.arange(block_r) < rows
  p = p0 + jnp.arange(block_p)
  tile_ok = row_ok[:, None] & (p < points)[None, :]

  def body(j, acc):
    idx = plt.load(cols_ref.at[pl.ds(r0, block_r), j], mask=row_ok, other=0)
    v = plt.load(vals_ref.at[pl.ds(r0, block_r), j], mask=row_ok, other=0)
    # One contiguous segment of Xt per row: the coalesced gather of §5.2.
    x = plt.load(x_ref.at[idx[:, None], p[None, :]], mask=tile_ok, other=0)
    return acc + v.astype(jnp.float32)[:, None] * x.astype(jnp.float32)

  width = cols_ref.shape[1]
  acc = lax.fori_loop(0, width, body, jnp.zeros((block_r, block_p), jnp.float32))
  plt.store(o_ref.at[pl.ds(r0, block_r), pl.ds(p0, block_p)], acc.astype(o_ref.dtype), mask=tile_ok)


def spmm(
  values: Array,
  columns: Array,
  xt: Array,
  *,
  out_dtype=None,
  tile: tuple[int, int] = _SPMM_TILE,
  interpret: bool | None = None,
) -> Array:
  """ELL sparse ``(R, K)`` × dense ``xt (K, P)`` with the Pallas kernel.

  Args:
    values: ``(R, width)`` entries; padding entries must be 0.
    columns: ``(R, width)`` int32 column of each entry, in ``[0, K)`` (padding too).
    xt: ``(K, P)`` dense operand (the unfolded input, transposed).
    out_dtype: result dtype; default ``xt.dtype``. Accumulation is float32.
    tile: ``(rows, points)`` per program, powers of two (clamped to the problem).
    interpret: run in the Pallas interpreter; ``None`` = on non-GPU backends.

  Returns:
    ``(R, P)``.

  Raises:
    ValueError: mismatched shapes, non-integer columns, or operands too large.
  """
  _check(values.shape, columns, xt, "values")
  return _launch(
    _spmm_kernel,
    (columns.astype(jnp.int32), values, xt),
    points=xt.shape[1],
    tile=tile,
    interpret=interpret,
    out_shape=jax.ShapeDtypeStruct((columns.shape[0], xt.shape[1]), out_dtype or xt.dtype),
    over_points=True,
    name="clicktrain_pattern_spmm",
  )


def _grad_kernel(cols_ref, dy_ref, x_ref, o_ref, *, block_r, block_p, rows, points):
  r0 = pl.program_id(0) * block_r
  j = pl.program_id(1)
  row_ok = r0 + jnp.arange(block_r) < rows
  idx = plt.load(cols_ref.at[pl.ds(r0, block_r), j], mask=row_ok, other=0)

  def body(t, acc):
    p = t * block_p + jnp.arange(block_p)
    tile_ok = row_ok[:, None] & (p < points)[None, :]
    dy = plt.load(dy_ref.at[pl.ds(r0, block_r), pl.ds(t * block_p, block_p)], mask=tile_ok, other=0)
    x = plt.load(x_ref.at[idx[:, None], p[None, :]], mask=tile_ok, other=0)
    return acc + dy.astype(jnp.float32) * x.astype(jnp.float32)

  acc = lax.fori_loop(0, pl.cdiv(points, block_p), body, jnp.zeros((block_r, block_p), jnp.float32))
  plt.store(o_ref.at[pl.ds(r0, block_r), j], jnp.sum(acc, axis=1).astype(o_ref.dtype), mask=row_ok)


def kept_weight_grad(
  dyt: Array,
  xt: Array,
  columns: Array,
  *,
  out_dtype=jnp.float32,
  tile: tuple[int, int] = _GRAD_TILE,
  interpret: bool | None = None,
) -> Array:
  """Weight gradient at the kept positions: ``dvalues[r, j] = ⟨dyt[r, :], xt[columns[r, j], :]⟩``.

  Args:
    dyt: ``(R, P)`` output gradient, transposed.
    xt: ``(K, P)`` unfolded input, transposed.
    columns: ``(R, width)`` int32 layout columns (padding entries are computed too; the
      caller masks them).
    out_dtype: result dtype (accumulation is float32).
    tile: ``(rows, points)`` per program and loop step, powers of two.
    interpret: run in the Pallas interpreter; ``None`` = on non-GPU backends.

  Returns:
    ``(R, width)``.

  Raises:
    ValueError: mismatched shapes, non-integer columns, or operands too large.
  """
  _check(columns.shape, columns, xt, "columns")
  if tuple(dyt.shape) != (columns.shape[0], xt.shape[1]):
    raise ValueError(f"dyt shape {dyt.shape} is not (R, P) = {(columns.shape[0], xt.shape[1])}")
  return _launch(
    _grad_kernel,
    (columns.astype(jnp.int32), dyt, xt),
    points=xt.shape[1],
    tile=tile,
    interpret=interpret,
    out_shape=jax.ShapeDtypeStruct(columns.shape, out_dtype),
    over_points=False,
    name="clicktrain_pattern_kept_weight_grad",
  )
