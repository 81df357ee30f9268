"""Pallas (Triton backend) kernel for SDGP N:M data-gradient pruning, selection + rescale fused.

One pass over the gradient: each program loads a block, splits it into the ``m`` columns of
its groups with strided loads (``x_ref[:, pl.ds(j, G, stride=m)]``, entry ``j`` of each of
the block's ``G`` groups), selects in registers with the ordering keys, draws and rescale
factor shared with the pure-JAX reference (``pallas_kernels.nm_math``), and stores the
columns back strided — the same
one-thread-per-group scheme as the authors' CUDA kernel (SDGP §III-A), vectorised.

Grid layout:
  * ``random`` / ``magnitude`` / ``mvue``: the gradient is viewed as ``(R, C)`` (R = every
    leading axis); blocks of ``(BR, BC)`` rows × channels, ``BC`` a multiple of ``m``.
  * ``rescaled_magnitude``: the per-(sample, channel) L1 sums run over H·W, so the gradient
    is viewed as ``(B, H·W, C)`` and a block holds the *whole* H·W extent of one sample for a
    tile of ``BC`` channels; both sums and the rescale happen in the same program (no second
    pass, no atomics). Needs H·W a power of two (Triton tensor sizes), true for the CIFAR
    ResNets; other shapes fall back to the reference under ``backend="auto"``.

Random methods draw their U[0, 1) values in registers with the counter-based
``hash_uniform`` of (two seeds, flat index of the draw) — Pallas Triton has no PRNG — and
the reference evaluates the same hash over the whole draw array, so both agree bit for bit
and the kernel reads nothing but the gradient.

The caller's pure-JAX reference (built on the same :mod:`pallas_kernels.nm_math`) is the CPU
path and the test oracle; on CPU this kernel runs with ``interpret=True``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import nm_math

Array = jax.Array

# Elements held per program: large enough to hide latency, small enough that the m strided
# columns and their comparisons stay in registers (4 warps).
_BLOCK_ELEMENTS = 4096
_RESCALE_BLOCK_ELEMENTS = 8192
_NUM_WARPS = 4


# ---- per-group selection on m register columns (column j = entry j of each group) ----
# Every operation is elementwise across columns, ranks come from pairwise comparisons, so
# Triton keeps everything in registers with no gather.


def _top_n_masks(keys: Sequence[Array], n: int) -> list[Array]:
  """``keys[j]`` is kept iff fewer than ``n`` entries rank above it.

  Entry k ranks above entry j if its key is larger, or equal and k < j (ties go to the
  lower index: the N:M contract of the magnitude methods).
  """
  m = len(keys)
  masks = []
  for j in range(m):
    rank = jnp.zeros(keys[j].shape, jnp.int32)
    for k in range(m):
      if k < j:
        rank = rank + (keys[k] >= keys[j]).astype(jnp.int32)
      elif k > j:
        rank = rank + (keys[k] > keys[j]).astype(jnp.int32)
    masks.append(rank < n)
  return masks


def _mvue_block(cols: Sequence[Array], u: Array) -> list[Array]:
  """Unbiased 1:k draw on one sub-block (Chmiel et al., ICLR'23, MVUE 1:2 generalised).

  Entry i is kept with probability |x_i| / Σ|x| and set to sign(x_i) · Σ|x|, so
  E[out_i] = x_i; choosing p_i ∝ |x_i| minimises the variance among unbiased estimators
  with one nonzero (Cauchy–Schwarz). An all-zero sub-block stays zero. If the sub-block
  holds a non-finite entry (NaN, ±inf), its first non-finite entry is kept unchanged and
  the others are zeroed, so NaN/inf propagate instead of turning into garbage sums.
  """
  k = len(cols)
  mags = [jnp.abs(c) for c in cols]
  total = mags[0]
  cumulative = [mags[0]]
  for a in mags[1:]:
    total = total + a
    cumulative.append(total)
  threshold = u * total
  # index of the chosen entry = number of partial sums <= threshold; the last partial sum
  # is left out so a threshold rounded up to the total still picks an entry.
  chosen = jnp.zeros(cols[0].shape, jnp.int32)
  for c in cumulative[:-1]:
    chosen = chosen + (c <= threshold).astype(jnp.int32)
  finite = [a < jnp.inf for a in mags]  # False for NaN and inf
  seen_nonfinite = jnp.zeros(cols[0].shape, jnp.bool_)
  outs = []
  for i in range(k):
    first_nonfinite = jnp.logical_not(finite[i]) & jnp.logical_not(seen_nonfinite)
    seen_nonfinite = seen_nonfinite | jnp.logical_not(finite[i])
    outs.append((cols[i], chosen == i, first_nonfinite))
  any_nonfinite = seen_nonfinite
  result = []
  for x_i, picked, first_nonfinite in outs:
    signed_total = jnp.where(x_i < 0, -total, jnp.where(x_i > 0, total, 0.0))
    value = jnp.where(picked, signed_total, 0.0)
    result.append(jnp.where(any_nonfinite, jnp.where(first_nonfinite, x_i, 0.0), value))
  return result


def _select_columns(
  cols: Sequence[Array],
  n: int,
  method: str,
  uniforms: Sequence[Array] | None = None,
) -> list[Array]:
  """N:M-prunes the groups given as ``m`` columns; returns ``m`` float32 columns.

  ``rescaled_magnitude`` returns the magnitude selection; the caller applies the
  per-(sample, channel) rescale because its reduction spans many groups.

  Args:
    cols: ``m`` arrays of one shape, column ``j`` = entry ``j`` of each group.
    n: entries kept per group.
    method: one of ``METHODS``.
    uniforms: ``m`` columns of U[0, 1) for ``random``; ``n`` columns (one per sub-block)
      for ``mvue``; unused otherwise.

  Returns:
    The pruned columns in float32.
  """
  cols = [c.astype(jnp.float32) for c in cols]
  m = len(cols)
  if method == "mvue":
    assert uniforms is not None and len(uniforms) == n
    block = m // n
    out: list[Array] = []
    for s in range(n):
      out.extend(_mvue_block(cols[s * block : (s + 1) * block], uniforms[s]))
    return out
  if method == "random":
    assert uniforms is not None and len(uniforms) == m
    keys = [nm_math.order_keys(u) for u in uniforms]
  else:
    keys = [nm_math.order_keys(jnp.abs(c)) for c in cols]
  masks = _top_n_masks(keys, n)
  return [jnp.where(keep, c, 0.0) for c, keep in zip(cols, masks)]


# ---- blocking and pallas_call wrappers ----


def _pow2_divisor(value: int, cap: int) -> int:
  """Largest power of two dividing ``value`` and at most ``cap`` (>= 1)."""
  p = 1
  while value % (p * 2) == 0 and p * 2 <= cap:
    p *= 2
  return p


def _is_pow2(value: int) -> bool:
  return value > 0 and value & (value - 1) == 0


def supports(shape, n: int, m: int, method: str) -> bool:
  """Whether the kernel handles this problem (else ``backend="auto"`` uses the reference)."""
  if method == "rescaled_magnitude":
    spatial = math.prod(shape[1:-1])
    return _is_pow2(spatial) and spatial * m <= 4 * _RESCALE_BLOCK_ELEMENTS
  return True


def _channel_tile(channels: int, m: int, max_groups: int) -> tuple[int, int]:
  """(groups per block, channels per block); groups a power of two dividing C / m."""
  groups = _pow2_divisor(channels // m, max(1, max_groups))
  return groups, groups * m


def _columns(ref, m: int, groups: int):
  return [ref[:, pl.ds(j, groups, stride=m)] for j in range(m)]


def _store_columns(ref, cols, m: int, groups: int) -> None:
  for j, c in enumerate(cols):
    ref[:, pl.ds(j, groups, stride=m)] = c.astype(ref.dtype)


def _uniform_columns(seed_ref, shape, width: int, groups: int, row_width: int):
  """The ``width`` draw columns of this block: hash of each draw's flat index.

  Draw ``(r, g * width + s)`` of a ``(rows, row_width)`` draw array (see
  ``nm_math.uniform_shape``) belongs to entry/sub-block ``s`` of group ``g`` in row ``r``.
  """
  block_r = shape[0]
  seeds = (seed_ref[0], seed_ref[1])
  rows = pl.program_id(0) * block_r + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  first = pl.program_id(1) * groups * width
  group = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return [
    nm_math.hash_uniform(rows * row_width + first + group * width + s, seeds) for s in range(width)
  ]


def _select_kernel(*refs, n: int, m: int, method: str, groups: int, channels: int):
  cols = _columns(refs[0], m, groups)
  ucols = None
  if method in ("random", "mvue"):
    width = m if method == "random" else n
    ucols = _uniform_columns(refs[1], cols[0].shape, width, groups, channels // m * width)
  _store_columns(refs[-1], _select_columns(cols, n, method, ucols), m, groups)


def _rescaled_kernel(x_ref, o_ref, *, n: int, m: int, groups: int, eps: float | None):
  cols = _columns(x_ref, m, groups)  # each (H*W, groups)
  pruned = _select_columns(cols, n, "magnitude")
  out = []
  for c, p in zip(cols, pruned):
    # SDGP §III-B: keep each (sample, channel) L1 norm over H, W.
    abs_sum = jnp.sum(jnp.abs(c.astype(jnp.float32)), axis=0, keepdims=True)
    abs_sum_pruned = jnp.sum(jnp.abs(p), axis=0, keepdims=True)
    out.append(p * nm_math.rescale_factor(abs_sum, abs_sum_pruned, eps))
  _store_columns(o_ref, out, m, groups)


def _compiler_params(block_elements: int):
  # Twice the warps for the big rescaled blocks (all of H*W), so fewer values per thread.
  warps = _NUM_WARPS if block_elements <= _BLOCK_ELEMENTS else 2 * _NUM_WARPS
  return plt.CompilerParams(num_warps=warps, num_stages=1)


def _default_interpret() -> bool:
  return jax.default_backend() not in ("gpu", "cuda", "rocm")


def nm_prune_pallas(
  x: Array,
  n: int,
  m: int,
  method: str,
  seeds: Array | None = None,
  *,
  interpret: bool | None = None,
  rescale_eps: float | None = None,
) -> Array:
  """N:M pruning with the fused Pallas kernel; same semantics as the reference.

  Args:
    x: floating array, groups of ``m`` on the last axis (arguments already validated with
      :func:`pallas_kernels.nm_math.validate`).
    n: entries kept per group.
    m: group size.
    method: one of :data:`pallas_kernels.nm_math.METHODS`.
    seeds: ``nm_math.seeds_from_key(key)`` for the random methods.
    interpret: run the kernel in the Pallas interpreter; ``None`` = on non-GPU backends.
    rescale_eps: ``rescaled_magnitude``'s ε (``None``: the ε-free ratio); see
      :func:`pallas_kernels.nm_math.rescale_factor`.

  Returns:
    The pruned array, same shape and dtype as ``x``.
  """
  if interpret is None:
    interpret = _default_interpret()
  if method == "rescaled_magnitude":
    return _rescaled_call(x, n, m, interpret, rescale_eps)
  return _select_call(x, n, m, method, seeds, interpret)


def _select_call(x, n, m, method, seeds, interpret):
  shape = x.shape
  channels = shape[-1]
  rows = math.prod(shape[:-1])
  groups, block_c = _channel_tile(channels, m, max(1, 256 // m))
  block_r = _pow2_divisor(rows, max(1, _BLOCK_ELEMENTS // block_c))
  grid = (rows // block_r, channels // block_c)
  x2 = x.reshape(rows, channels)
  in_specs = [pl.BlockSpec((block_r, block_c), lambda i, j: (i, j))]
  operands = [x2]
  if method in ("random", "mvue"):
    in_specs.append(pl.BlockSpec((2,), lambda i, j: (0,)))
    operands.append(seeds.astype(jnp.uint32))
  out = pl.pallas_call(
    functools.partial(_select_kernel, n=n, m=m, method=method, groups=groups, channels=channels),
    out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype),
    grid=grid,
    in_specs=in_specs,
    out_specs=pl.BlockSpec((block_r, block_c), lambda i, j: (i, j)),
    interpret=interpret,
    compiler_params=_compiler_params(block_r * block_c),
    name=f"sdgp_nm_prune_{method}_{n}_{m}",
  )(*operands)
  return out.reshape(shape)


def _rescaled_call(x, n, m, interpret, eps):
  shape = x.shape
  if not supports(shape, n, m, "rescaled_magnitude"):
    raise ValueError(
      f"x: the Pallas rescaled_magnitude kernel needs a power-of-two H*W (block holds "
      f"all of it), got shape {shape}; use backend='reference' or 'auto'"
    )
  batch, channels = shape[0], shape[-1]
  spatial = math.prod(shape[1:-1])
  groups, block_c = _channel_tile(channels, m, max(1, _RESCALE_BLOCK_ELEMENTS // (spatial * m)))
  x3 = x.reshape(batch, spatial, channels)
  spec = pl.BlockSpec((None, spatial, block_c), lambda b, j: (b, 0, j))
  out = pl.pallas_call(
    functools.partial(_rescaled_kernel, n=n, m=m, groups=groups, eps=eps),
    out_shape=jax.ShapeDtypeStruct(x3.shape, x.dtype),
    grid=(batch, channels // block_c),
    in_specs=[spec],
    out_specs=spec,
    interpret=interpret,
    compiler_params=_compiler_params(spatial * block_c),
    name=f"sdgp_nm_prune_rescaled_{n}_{m}",
  )(x3)
  return out.reshape(shape)
