"""N:M pruning of a data gradient (SDGP Algorithm 1, §III-B) with backend dispatch, and
:class:`SDGPSettings`, the one home of SDGP's N:M settings.

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774

  Chmiel, Hubara, Banner and Soudry, "Minimum Variance Unbiased N:M Sparsity for the Neural
  Gradients", ICLR 2023 (``method="mvue"``). https://arxiv.org/abs/2203.10991
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import nm_math

Array = jax.Array

BACKENDS = ("auto", "reference", "pallas")


def draw_uniforms(key: Array | None, shape, n: int, m: int, method: str) -> Array | None:
  """The U[0, 1) draws a random method consumes (``hash_uniform`` of the flat index).

  The Pallas kernel recomputes exactly these values in registers from the same seeds.
  """
  seeds = None if key is None else nm_math.seeds_from_key(key)
  return _uniforms_from_seeds(seeds, shape, n, m, method)


def _uniforms_from_seeds(seeds, shape, n: int, m: int, method: str) -> Array | None:
  ushape = nm_math.uniform_shape(shape, n, m, method)
  if ushape is None:
    return None
  index = jax.lax.broadcasted_iota(jnp.uint32, (math.prod(ushape),), 0).reshape(ushape)
  return nm_math.hash_uniform(index, seeds)


# Up to this group size the ranking is unrolled over the m columns (below); beyond it the
# m² unrolled comparisons make compilation slow (≈5 s at m = 32), so one (…, m, m) reduce.
_UNROLL_MAX_M = 8


def _top_n_mask(keys: Array, n: int) -> Array:
  """Keep-mask of the ``n`` largest keys on the last axis, ties to the lower index.

  Entry k ranks above entry j if ``keys[k] > keys[j]``, or equal with k < j; an entry is
  kept iff fewer than ``n`` entries rank above it.

  For ``m <= 8`` the count is written as elementwise ops between the m columns
  ``keys[..., k]``: XLA:CPU emits the ``(..., m, m)`` compare-and-reduce form as a loop
  fusion with a nested reduction per entry, which made the 2:4 magnitude selection about
  2.5x slower than this unrolled form (same result, checked by the tests).
  """
  m = keys.shape[-1]
  if m <= _UNROLL_MAX_M:
    columns = [keys[..., k] for k in range(m)]
    kept = []
    for j in range(m):
      above = [
        (columns[k] >= columns[j]) if k < j else (columns[k] > columns[j])
        for k in range(m)
        if k != j
      ]
      rank = sum((a.astype(jnp.int32) for a in above), jnp.zeros(keys.shape[:-1], jnp.int32))
      kept.append(rank < n)
    return jnp.stack(kept, axis=-1)
  index = jnp.arange(m)
  key_j, key_k = keys[..., :, None], keys[..., None, :]
  lower = index[None, :] < index[:, None]  # [j, k]: k < j
  above = (key_k > key_j) | ((key_k == key_j) & lower)
  return jnp.sum(above, axis=-1, dtype=jnp.int32) < n


def _mvue_reference(grouped: Array, n: int, uniforms: Array) -> Array:
  """Unbiased 1:(m/n) draw per sub-block (Chmiel et al., ICLR'23 MVUE, generalised).

  Entry i of a sub-block is kept with probability |x_i| / Σ|x| and set to
  sign(x_i) · Σ|x|: E[out_i] = x_i, and p_i ∝ |x_i| minimises the variance among unbiased
  estimators with one nonzero per sub-block (Cauchy–Schwarz).
  """
  blocks = grouped.reshape(grouped.shape[:-1] + (n, grouped.shape[-1] // n))
  k = blocks.shape[-1]
  mags = jnp.abs(blocks)
  # running sums in index order, as the kernel adds them (same float rounding)
  partial = [mags[..., 0]]
  for i in range(1, k):
    partial.append(partial[-1] + mags[..., i])
  total = partial[-1]
  threshold = uniforms * total
  # chosen entry = number of partial sums <= threshold (the last one excluded, so a
  # threshold rounded up to the total still picks an entry)
  chosen = sum((p <= threshold).astype(jnp.int32) for p in partial[:-1]) if k > 1 else 0
  # A non-finite entry is kept unchanged (the first one of its sub-block). Found with a
  # select chain over the k columns rather than argmax, which XLA:CPU lowers to a slow
  # variadic reduction (this halved the CPU selection time for 1:4 and 8:32; 2:4 unchanged).
  first_nonfinite = jnp.full(total.shape, k, jnp.int32)
  for i in reversed(range(k)):
    first_nonfinite = jnp.where(~(mags[..., i] < jnp.inf), i, first_nonfinite)
  any_nonfinite = first_nonfinite < k
  kept_index = jnp.where(any_nonfinite, first_nonfinite, chosen)
  # Assembled column by column and stacked (not one broadcast over the block axis): XLA:CPU
  # then computes the sub-block's draw once for all k outputs instead of once per output
  # entry (2:4 selection about 1.6x faster).
  columns = []
  for i in range(k):
    entry = blocks[..., i]
    kept_value = jnp.where(any_nonfinite, entry, jnp.sign(entry) * total)
    columns.append(jnp.where(kept_index == i, kept_value, 0.0))
  return jnp.stack(columns, axis=-1).reshape(grouped.shape)


def nm_prune_reference(x: Array, n: int, m: int, method: str, uniforms: Array | None) -> Array:
  """Pure-JAX N:M pruning (the CPU path and the Pallas kernel's oracle).

  Args:
    x: array whose last axis holds the groups of ``m`` consecutive entries.
    n: entries kept per group.
    m: group size.
    method: one of ``METHODS``.
    uniforms: ``draw_uniforms(...)`` for the random methods, else ``None``.

  Returns:
    The pruned array, same shape and dtype as ``x``.
  """
  shape = x.shape
  grouped = x.astype(jnp.float32).reshape(shape[:-1] + (shape[-1] // m, m))
  if method == "mvue":
    ugrouped = uniforms.reshape(grouped.shape[:-1] + (n,))
    pruned = _mvue_reference(grouped, n, ugrouped)
  else:
    if method == "random":
      keys = nm_math.order_keys(uniforms.reshape(grouped.shape))
    else:
      keys = nm_math.order_keys(jnp.abs(grouped))
    pruned = jnp.where(_top_n_mask(keys, n), grouped, 0.0)
  pruned = pruned.reshape(shape)
  if method == "rescaled_magnitude":
    # SDGP §III-B: per (sample, channel), L1 over every axis in between (H, W for NHWC).
    axes = tuple(range(1, x.ndim - 1))
    abs_sum = jnp.sum(jnp.abs(x.astype(jnp.float32)), axis=axes, keepdims=True)
    abs_sum_pruned = jnp.sum(jnp.abs(pruned), axis=axes, keepdims=True)
    pruned = pruned * nm_math.rescale_factor(abs_sum, abs_sum_pruned)
  return pruned.astype(x.dtype)


def nm_prune(
  x: Array,
  n: int,
  m: int,
  method: str,
  *,
  key: Array | None = None,
  backend: str = "auto",
) -> Array:
  """Keeps ``n`` of every ``m`` consecutive entries along the last axis (SDGP Alg. 1).

  SDGP (McDanel et al., 2022) prunes the output data gradient of each conv before the
  input gradient is computed; groups are ``m`` consecutive channels at one (n, h, w)
  position of an NHWC tensor.

  Methods (SDGP §III-B, plus the unbiased estimator SDGP lacks):
    * ``"random"``: a uniformly random ``n``-subset of each group is kept, no rescale
      (biased, as in the authors' code).
    * ``"magnitude"``: the ``n`` entries with the largest ``|x|``; ties go to the lower
      index.
    * ``"rescaled_magnitude"``: magnitude, then every (sample, channel) is multiplied by
      ``Σ|x| / (Σ|pruned| + 1e-4)``, the sums running over every axis between the first
      and the last (H, W for NHWC). Needs ``x.ndim >= 2``.
    * ``"mvue"``: minimum-variance unbiased N:M (Chmiel et al., ICLR'23). Each group is
      split into ``n`` sub-blocks of ``m // n`` consecutive entries and each sub-block keeps
      one entry ``i`` with probability ``|x_i| / Σ|x|``, set to ``sign(x_i) · Σ|x|``. For
      1:2 this is Chmiel et al.'s MVUE; 2:4 is their 1:2 applied to both pairs. Supported
      whenever ``m % n == 0`` (every setting of SDGP Fig. 8); other ``n`` raise.
      ``E[out] = x`` exactly.

  Non-finite values: for the magnitude methods NaN ranks above every number (+inf
  included) and NaNs tie with each other, so a NaN is always kept and propagates (under
  ``"rescaled_magnitude"`` it also makes its (sample, channel) NaN through the sums). For
  ``"mvue"`` a sub-block holding NaN or ±inf keeps its first non-finite entry unchanged.
  ``"random"`` ignores values.

  Args:
    x: floating array (float32, bfloat16, float16), groups on the last axis.
    n: entries kept per group, ``1 <= n <= m``.
    m: group size, ``1 <= m <= 32``, must divide ``x.shape[-1]``.
    method: ``"random"``, ``"magnitude"``, ``"rescaled_magnitude"`` or ``"mvue"``.
    key: PRNG key, required for ``"random"`` and ``"mvue"``.
    backend: ``"auto"`` (the Pallas kernel when lowered for a GPU, the reference
      otherwise; chosen per lowering platform, so one jitted function serves both),
      ``"reference"`` or ``"pallas"`` (the kernel; interpreted on CPU).

  Returns:
    The pruned array, same shape and dtype as ``x``.

  Raises:
    ValueError: naming the offending argument.

  Example:
    >>> nm_prune(jnp.array([1., 7., -3., 2.]), 2, 4, "magnitude")
    Array([ 0.,  7., -3.,  0.], dtype=float32)
  """
  x = jnp.asarray(x)
  nm_math.validate(x.shape, x.dtype, n, m, method, key)
  _check_backend(backend)
  return _nm_prune_jit(x, key, n=n, m=m, method=method, backend=backend)


def _check_backend(backend: str) -> None:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@dataclasses.dataclass(frozen=True)
class SDGPSettings:
  """SDGP's N:M settings, validated once when created, then passed down as they are.

  Hashable: the static argument of SDGP's custom VJP and part of its layers' and conversion
  record's static attributes, from the preset down to the backward pass.

  Attributes:
    n, m, method, backend: as in :func:`nm_prune` (keep ``n`` of every ``m`` consecutive
      entries of the last axis, selected by ``method``).

  Raises:
    ValueError: a bad ``n``, ``m``, ``method`` or ``backend`` (named in the message).

  Example:
    >>> settings = SDGPSettings(n=2, m=4, method="mvue")
    >>> settings.uses_key
    True
  """

  n: int
  m: int
  method: str
  backend: str = "auto"

  def __post_init__(self):
    nm_math.validate_settings(self.n, self.m, self.method)
    _check_backend(self.backend)

  @property
  def uses_key(self) -> bool:
    """Whether ``method`` draws random numbers (``"random"``, ``"mvue"``): it needs a key."""
    return self.method in nm_math.RANDOM_METHODS

  def prune(self, x: Array, key: Array | None) -> Array:
    """``nm_prune(x, n, m, method, key=key, backend=backend)``, the settings not checked again.

    The caller guarantees the rest of :func:`nm_prune`'s contract: a floating ``x`` of at
    least 2 axes whose last axis is divisible by ``m``, and a key when :attr:`uses_key`.
    """
    return _nm_prune_jit(x, key, n=self.n, m=self.m, method=self.method, backend=self.backend)


@functools.partial(jax.jit, static_argnames=("n", "m", "method", "backend"))
def _nm_prune_jit(x, key, *, n, m, method, backend):
  seeds = None if key is None else nm_math.seeds_from_key(key)

  def reference(x_, seeds_):
    uniforms = _uniforms_from_seeds(seeds_, x_.shape, n, m, method)
    return nm_prune_reference(x_, n, m, method, uniforms)

  if backend == "reference":
    return reference(x, seeds)
  # Imported here: pallas_kernels imports this package's shared definitions.
  try:
    from pallas_kernels import nm_prune as kernel_module
  except ImportError:  # a JAX without Pallas Triton: "auto" falls back to the reference
    if backend == "pallas":
      raise
    return reference(x, seeds)

  if backend == "pallas":
    return kernel_module.nm_prune_pallas(x, n, m, method, seeds)
  if not kernel_module.supports(x.shape, n, m, method):
    return reference(x, seeds)
  return jax.lax.platform_dependent(
    x,
    seeds,
    cuda=lambda x_, s_: kernel_module.nm_prune_pallas(x_, n, m, method, s_, interpret=False),
    default=reference,
  )
