"""N:M pruning of a data gradient (SDGP Algorithm 1, §III-B) with backend dispatch, and
:class:`SDGPSettings`, the one home of SDGP's N:M settings.

``backend="auto"`` runs, on each lowering platform, the backend that measured faster there
(:data:`MEASURED_FASTER`, :func:`auto_backend`); :func:`time_backends` times both on the
current device, so a user can check their own GPU.

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

import pallas_kernels
from jaxprune.timing import median_call_ms
from pallas_kernels import nm_math

Array = jax.Array

BACKENDS = ("auto", "reference", "pallas")

# What ``backend="auto"`` runs when lowered for each platform: the backend that made the whole
# SDGP train step faster there; a platform not listed runs the reference. One NVIDIA H100, JAX
# 0.11.2, batch 128, float32, SDGP 2:4 step time over the dense step's (lower is faster):
#   sdgp-resnet9 (CIFAR)          magnitude 1.063x Pallas, 1.054x reference; MVUE 1.103x Pallas
#   imagenet-resnet18 (224x224)   magnitude 1.094x Pallas, 1.065x reference; MVUE 1.114x Pallas
# The Pallas kernel lost, so CUDA runs the reference. When the step benchmark shows the kernel
# winning on a platform, that platform's entry becomes "pallas". Read when ``nm_prune`` is
# traced: a function already compiled keeps the choice it was traced with.
MEASURED_FASTER = {"cuda": "reference"}


def auto_backend(platform: str) -> str:
  """The backend ``backend="auto"`` runs when lowered for ``platform``.

  :data:`MEASURED_FASTER`'s entry for ``platform`` (``"reference"`` when it has none), and
  ``"reference"`` whenever this JAX has no Pallas Triton backend
  (:func:`pallas_kernels.triton_available`).

  Args:
    platform: a lowering platform, as ``jax.lax.platform_dependent`` names them (``"cpu"``,
      ``"cuda"``, ``"rocm"``, ``"tpu"``).

  Returns:
    ``"reference"`` or ``"pallas"``.

  Raises:
    ValueError: :data:`MEASURED_FASTER` holds something else for ``platform``.

  Example:
    >>> auto_backend("cuda")
    'reference'
  """
  choice = MEASURED_FASTER.get(platform, "reference")
  if choice not in ("reference", "pallas"):
    raise ValueError(
      f"MEASURED_FASTER[{platform!r}] must be 'reference' or 'pallas', got {choice!r}"
    )
  if choice == "pallas" and not pallas_kernels.triton_available():
    return "reference"
  return choice


def _auto_pallas_platforms() -> tuple[str, ...]:
  """The platforms where ``"auto"`` runs the kernel, read now (a static argument of the jit,
  so a changed table or probe compiles anew instead of reusing a cached trace)."""
  return tuple(sorted(p for p in MEASURED_FASTER if auto_backend(p) == "pallas"))


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
  fusion with a nested reduction per entry, which made the 2:4 magnitude selection
  several times slower than this unrolled form (same result, checked by the tests).
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


def nm_prune_reference(
  x: Array,
  n: int,
  m: int,
  method: str,
  uniforms: Array | None,
  rescale_eps: float | None = None,
) -> Array:
  """Pure-JAX N:M pruning (the CPU path and the Pallas kernel's oracle).

  Args:
    x: array whose last axis holds the groups of ``m`` consecutive entries.
    n: entries kept per group.
    m: group size.
    method: one of ``METHODS``.
    uniforms: ``draw_uniforms(...)`` for the random methods, else ``None``.
    rescale_eps: ``rescaled_magnitude``'s ε, as in :func:`nm_prune`.

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
    pruned = pruned * nm_math.rescale_factor(abs_sum, abs_sum_pruned, rescale_eps)
  return pruned.astype(x.dtype)


def nm_prune(
  x: Array,
  n: int,
  m: int,
  method: str,
  *,
  key: Array | None = None,
  backend: str = "auto",
  rescale_eps: float | str | None = nm_math.RELEASED,
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
      ``Σ|x| / Σ|pruned|``, the sums running over every axis between the first and the
      last (H, W for NHWC). By default (``rescale_eps="released"``) the factor is the
      authors' released ``Σ|x| / (Σ|pruned| + 1e-4)``. Its absolute ε depends on the loss's
      scale; ``rescale_eps=None`` drops it: magnitude keeps the top ``n`` of every ``m``, so
      ``Σ|x| / Σ|pruned|`` lies in ``[1, m/n]`` and needs no ε (1 where ``Σ|pruned| == 0``,
      an all-zero channel), and the pruned gradient scales exactly with the loss
      (``grad(c·loss) = c·grad(loss)``: loss scaling, data-parallel local-mean losses). The
      model converter and the presets use ``None``. Needs ``x.ndim >= 2``.
    * ``"mvue"``: minimum-variance unbiased N:M (Chmiel et al., ICLR'23). Each group is
      split into ``n`` sub-blocks of ``m // n`` consecutive entries and each sub-block keeps
      one entry ``i`` with probability ``|x_i| / Σ|x|``, set to ``sign(x_i) · Σ|x|``. For
      1:2 this is Chmiel et al.'s MVUE; 2:4 is their 1:2 applied to both pairs. Supported
      whenever ``m % n == 0`` (every setting of SDGP Fig. 8); other ``n`` raise.
      ``E[out] = x`` exactly.

  Non-finite values: for the magnitude methods NaN ranks above every number (+inf
  included) and NaNs tie with each other, so a NaN is always kept and propagates (under
  ``"rescaled_magnitude"`` a (sample, channel) whose sum is not finite is not rescaled, so
  its NaN and ±inf entries pass through as ``"magnitude"`` leaves them). For
  ``"mvue"`` a sub-block holding NaN or ±inf keeps its first non-finite entry unchanged.
  ``"random"`` ignores values.

  Args:
    x: floating array (float32, bfloat16, float16), groups on the last axis.
    n: entries kept per group, ``1 <= n <= m``.
    m: group size, ``1 <= m <= 32``, must divide ``x.shape[-1]``.
    method: ``"random"``, ``"magnitude"``, ``"rescaled_magnitude"`` or ``"mvue"``.
    key: PRNG key, required for ``"random"`` and ``"mvue"``.
    backend: ``"auto"`` (per lowering platform, the backend that measured faster there:
      :func:`auto_backend`; the reference on CUDA today, where it beat the kernel on an H100,
      and wherever the kernel does not support the shape; one jitted function serves every
      platform), ``"reference"`` (pure JAX) or ``"pallas"`` (the Pallas Triton kernel;
      interpreted off GPU; needs :func:`pallas_kernels.triton_available`).
    rescale_eps: ``"released"`` (the default: ``1e-4``, :data:`RESCALE_EPS`, added to
      ``Σ|pruned|`` under ``"rescaled_magnitude"``, as the released code; nothing for the
      other methods), ``None`` (the ε-free, scale-invariant ratio) or a finite float > 0
      (only with ``method="rescaled_magnitude"``).

  Returns:
    The pruned array, same shape and dtype as ``x``.

  Raises:
    ValueError: naming the offending argument (``backend="pallas"`` too, where this JAX has
      no Pallas Triton backend; ``rescale_eps`` with another method, or not > 0).

  Example:
    >>> nm_prune(jnp.array([1., 7., -3., 2.]), 2, 4, "magnitude")
    Array([ 0.,  7., -3.,  0.], dtype=float32)
  """
  x = jnp.asarray(x)
  rescale_eps = nm_math.resolve_rescale_eps(method, rescale_eps)
  nm_math.validate(x.shape, x.dtype, n, m, method, key, rescale_eps)
  _check_backend(backend)
  return _nm_prune_jit(
    x,
    key,
    n=n,
    m=m,
    method=method,
    backend=backend,
    auto_pallas=_auto_pallas_platforms(),
    rescale_eps=None if rescale_eps is None else float(rescale_eps),
  )


def _check_backend(backend: str) -> None:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "pallas":
    pallas_kernels.check_triton("backend", backend)


@dataclasses.dataclass(frozen=True)
class SDGPSettings:
  """SDGP's N:M settings, validated once when created, then passed down as they are.

  Hashable: the static argument of SDGP's custom VJP and part of its layers' and conversion
  record's static attributes, from the preset down to the backward pass.

  Attributes:
    n, m, method, backend: as in :func:`nm_prune` (keep ``n`` of every ``m`` consecutive
      entries of the last axis, selected by ``method``). ``backend="auto"`` (the default)
      runs, per lowering platform, the backend that measured faster there
      (:data:`MEASURED_FASTER`: the reference on CUDA today), read when the backward pass is
      traced.
    rescale_eps: as in :func:`nm_prune`: ``None`` (the ε-free, scale-invariant rescale) or
      the released code's ``1e-4``; only with ``method="rescaled_magnitude"``.

  Raises:
    ValueError: a bad ``n``, ``m``, ``method``, ``backend`` or ``rescale_eps`` (named in the
      message; ``"pallas"`` where this JAX has no Pallas Triton backend).

  Example:
    >>> settings = SDGPSettings(n=2, m=4, method="mvue")
    >>> settings.uses_key
    True
  """

  n: int
  m: int
  method: str
  backend: str = "auto"
  rescale_eps: float | None = None

  def __post_init__(self):
    nm_math.validate_settings(self.n, self.m, self.method)
    nm_math.validate_rescale_eps(self.method, self.rescale_eps)
    _check_backend(self.backend)
    if self.rescale_eps is not None:
      object.__setattr__(self, "rescale_eps", float(self.rescale_eps))

  @property
  def uses_key(self) -> bool:
    """Whether ``method`` draws random numbers (``"random"``, ``"mvue"``): it needs a key."""
    return self.method in nm_math.RANDOM_METHODS

  def prune(self, x: Array, key: Array | None) -> Array:
    """``nm_prune(x, n, m, method, key=key, backend=backend)``, the settings not checked again.

    The caller guarantees the rest of :func:`nm_prune`'s contract: a floating ``x`` of at
    least 2 axes whose last axis is divisible by ``m``, and a key when :attr:`uses_key`.
    """
    return _nm_prune_jit(
      x,
      key,
      n=self.n,
      m=self.m,
      method=self.method,
      backend=self.backend,
      auto_pallas=_auto_pallas_platforms(),
      rescale_eps=self.rescale_eps,
    )


@functools.partial(
  jax.jit, static_argnames=("n", "m", "method", "backend", "auto_pallas", "rescale_eps")
)
def _nm_prune_jit(x, key, *, n, m, method, backend, auto_pallas, rescale_eps=None):
  """``auto_pallas``: the lowering platforms where ``"auto"`` runs the kernel."""
  seeds = None if key is None else nm_math.seeds_from_key(key)

  def reference(x_, seeds_):
    uniforms = _uniforms_from_seeds(seeds_, x_.shape, n, m, method)
    return nm_prune_reference(x_, n, m, method, uniforms, rescale_eps)

  if backend == "reference" or (backend == "auto" and not auto_pallas):
    return reference(x, seeds)
  # Imported on use, after the probe (_check_backend, auto_backend): the module needs the
  # Pallas Triton backend, which a future JAX may lack.
  from pallas_kernels import nm_prune as kernel_module

  def kernel_on(platform):
    # Compiled Triton when lowered for CUDA; elsewhere the kernel's own default (compiled on
    # a GPU backend, interpreted otherwise).
    interpret = False if platform == "cuda" else None
    return lambda x_, s_: kernel_module.nm_prune_pallas(
      x_, n, m, method, s_, interpret=interpret, rescale_eps=rescale_eps
    )

  # Chosen per lowering platform, so one jitted function serves every platform.
  if backend == "pallas":
    return jax.lax.platform_dependent(x, seeds, cuda=kernel_on("cuda"), default=kernel_on(None))
  if not kernel_module.supports(x.shape, n, m, method):
    return reference(x, seeds)
  branches = {platform: kernel_on(platform) for platform in auto_pallas}
  return jax.lax.platform_dependent(x, seeds, default=reference, **branches)


def time_backends(
  shape,
  n: int,
  m: int,
  method: str,
  *,
  dtype=jnp.float32,
  repeats: int = 10,
  seed: int = 0,
) -> dict[str, float]:
  """Milliseconds of :func:`nm_prune` with each backend on the default device.

  Each is the median of ``repeats`` calls of one jitted ``nm_prune`` after a warm-up call
  (compilation not counted), on the same normal random gradient. Run it on a GPU at a layer's
  output-gradient shape to check :data:`MEASURED_FASTER` there; the table itself was filled
  from whole train steps (the step benchmark), which is what a choice should rest on. Off
  GPU the kernel runs in the Pallas interpreter, so its time there says nothing about a GPU.

  Args:
    shape: the gradient's shape (NHWC for a conv), last axis divisible by ``m``.
    n, m, method: as in :func:`nm_prune`.
    dtype: the gradient's floating dtype.
    repeats: timed calls per backend.
    seed: seed of the gradient and of the random methods' key.

  Returns:
    ``{"reference": ms, "pallas": ms}``; ``"pallas"`` only where this JAX has the Pallas Triton
    backend (:func:`pallas_kernels.triton_available`).

  Raises:
    ValueError: as :func:`nm_prune` (bad ``shape``, ``n``, ``m``, ``method``, ``dtype``), a
      ``shape`` the kernel does not support, or ``repeats < 1``.

  Example:
    >>> time_backends((128, 32, 32, 256), 2, 4, "magnitude")  # doctest: +SKIP
    {'reference': 0.41, 'pallas': 0.52}
  """
  shape = tuple(int(d) for d in shape)
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats!r}")
  dtype = jnp.dtype(dtype)
  key = jax.random.key(seed)
  nm_math.validate(shape, dtype, n, m, method, key)
  x = jax.random.normal(jax.random.fold_in(key, 1), shape).astype(dtype)
  key = key if method in nm_math.RANDOM_METHODS else None
  backends = ["reference"]
  if pallas_kernels.triton_available():
    from pallas_kernels import nm_prune as kernel_module

    if not kernel_module.supports(shape, n, m, method):
      raise ValueError(f"shape: {shape} is not supported by the Pallas kernel for {method!r}")
    backends.append("pallas")
  times = {}
  for backend in backends:
    fn = jax.jit(lambda x, k, b=backend: nm_prune(x, n, m, method, key=k, backend=b))
    times[backend] = median_call_ms(fn, x, key, repeats=repeats)
  return times
