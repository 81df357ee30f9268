"""Definitions shared by the N:M reference and the Pallas kernel.

Argument validation, the ordering keys of the magnitude methods (NaN above +inf), the
counter-based uniforms of the random methods and the rescale factor: both implementations
use these so they agree bit for bit, while each implements the per-group selection its own
way (vectorised ``(..., m, m)`` comparisons in the reference, ``m`` register columns in the
kernel).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array

METHODS = ("random", "magnitude", "rescaled_magnitude", "mvue")
# The methods that draw random numbers (they need a PRNG key).
RANDOM_METHODS = ("random", "mvue")

# SDGP §III-B: the ε the authors' released code adds to the kept L1 norm (after the sum) before
# dividing. Not the default: an absolute ε makes the rescale depend on the loss's scale (see
# ``rescale_factor``); pass it as ``rescale_eps`` to reproduce the released formula.
RESCALE_EPS = 1e-4

# The paper's CUDA kernel handles groups of up to 32 entries (one thread per group).
MAX_GROUP = 32

_CANONICAL_NAN_BITS = 0x7FC00000


def validate_settings(n, m, method: str) -> None:
  """Raises ``ValueError`` naming the bad one of ``n``, ``m``, ``method`` (no tensor needed)."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if not isinstance(m, int) or isinstance(m, bool) or m < 1 or m > MAX_GROUP:
    raise ValueError(f"m must be an int in [1, {MAX_GROUP}], got {m!r}")
  if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > m:
    raise ValueError(f"n must be an int with 1 <= n <= m={m}, got {n!r}")
  if method == "mvue" and m % n != 0:
    raise ValueError(
      f"n: method 'mvue' needs m divisible by n (n independent unbiased 1:(m/n) "
      f"draws per group), got n={n}, m={m}"
    )


def validate_key(method: str, key) -> None:
  """Raises ``ValueError`` when ``method`` draws random numbers and ``key`` is ``None``."""
  if method in RANDOM_METHODS and key is None:
    raise ValueError(f"key is required for method {method!r}")


# The default of the contract's functions (``nm_prune``, ``sdgp_conv``): ``rescaled_magnitude``
# with the released code's ε (``Σ|x| / (Σ|pruned| + 1e-4)``), no ε for the other methods.
RELEASED = "released"


def resolve_rescale_eps(method: str, rescale_eps):
  """``rescale_eps`` with :data:`RELEASED` resolved: :data:`RESCALE_EPS` for
  ``method="rescaled_magnitude"``, None for the methods that do not rescale; any other value
  as given (checked by :func:`validate_rescale_eps`)."""
  if isinstance(rescale_eps, str) and rescale_eps == RELEASED:
    return RESCALE_EPS if method == "rescaled_magnitude" else None
  return rescale_eps


def validate_rescale_eps(method: str, rescale_eps) -> None:
  """Raises ``ValueError`` unless ``rescale_eps`` is ``None`` or a finite float > 0 given with
  ``method="rescaled_magnitude"`` (the only method that rescales)."""
  if rescale_eps is None:
    return
  number = isinstance(rescale_eps, (int, float)) and not isinstance(rescale_eps, bool)
  if not (number and 0.0 < float(rescale_eps) < float("inf")):
    raise ValueError(f"rescale_eps must be None or a finite float > 0, got {rescale_eps!r}")
  if method != "rescaled_magnitude":
    raise ValueError(
      f"rescale_eps: only method 'rescaled_magnitude' rescales, got method {method!r} "
      f"with rescale_eps={rescale_eps!r}"
    )


def validate(shape: Sequence[int], dtype, n, m, method: str, key, rescale_eps=None) -> None:
  """Raises ``ValueError`` naming the bad argument of ``nm_prune``."""
  validate_settings(n, m, method)
  validate_rescale_eps(method, rescale_eps)
  if len(shape) < 1 or shape[-1] % m != 0:
    raise ValueError(f"x: last axis ({shape[-1] if shape else 'none'}) must be divisible by m={m}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"x must have a floating dtype, got {dtype}")
  if method == "rescaled_magnitude" and len(shape) < 2:
    raise ValueError("x: method 'rescaled_magnitude' needs at least 2 axes (sample, ..., channel)")
  validate_key(method, key)


def uniform_shape(shape: Sequence[int], n: int, m: int, method: str) -> tuple[int, ...] | None:
  """Shape of the uniforms a method consumes (``None`` for deterministic methods).

  ``random`` draws one uniform per entry (the kept set is the ``n`` largest draws, a
  uniformly random ``n``-subset). ``mvue`` draws one per sub-block of ``m // n`` entries,
  laid out group-major: entry ``g * n + s`` of the last axis is sub-block ``s`` of group ``g``.
  """
  if method == "random":
    return tuple(shape)
  if method == "mvue":
    return tuple(shape[:-1]) + (shape[-1] // m * n,)
  return None


def seeds_from_key(key: Array) -> Array:
  """Two uint32 seeds for ``hash_uniform`` (one small threefry draw)."""
  return jax.random.bits(key, (2,), jnp.uint32)


def _mix32(h: Array) -> Array:
  # "lowbias32" integer finaliser (C. Wellons): a bijection on uint32 with low bias.
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def hash_uniform(index: Array, seeds) -> Array:
  """Counter-based U[0, 1) draws: a hash of (seeds, flat element index), float32.

  Used instead of ``jax.random.uniform`` over the whole gradient so the Pallas kernel can
  make the very same draws in registers (no extra pass over a uniforms tensor) and so
  XLA needs no large threefry computation. 24-bit resolution.
  """
  seed0, seed1 = seeds[0], seeds[1]  # a (2,) array, or two scalars inside a kernel
  index = index.astype(jnp.uint32)
  h = _mix32(_mix32(index ^ seed0) + seed1)
  return (h >> 8).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-24)


def order_keys(magnitudes: Array) -> Array:
  """int32 keys ordering non-negative floats, NaN above +inf, all NaNs equal."""
  magnitudes = magnitudes.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(magnitudes, jnp.int32)
  return jnp.where(magnitudes != magnitudes, jnp.int32(_CANONICAL_NAN_BITS), bits)


def rescale_factor(abs_sum: Array, abs_sum_pruned: Array, eps: float | None = None) -> Array:
  """SDGP §III-B rescaled magnitude: the factor that restores each (sample, channel) L1 norm.

  ``eps=None`` (the default): ``Σ|x| / Σ|pruned|``, with no ε. Magnitude keeps the ``n``
  largest of every ``m``, so ``Σ|pruned| >= (n/m) · Σ|x|`` and the ratio lies in ``[1, m/n]``
  whenever ``Σ|x| > 0``; it is then homogeneous of degree 0, so the pruned gradient scales
  exactly with the loss (a loss scale, a data-parallel device's local-mean loss). Where
  ``Σ|pruned| == 0`` (an all-zero channel) the factor is 1.

  ``eps`` a float: ``Σ|x| / (Σ|pruned| + eps)``, the authors' released formula (``eps=1e-4``,
  :data:`RESCALE_EPS`). An absolute ε against sums of order 1e-3 (a mean loss's cotangents)
  shrinks the factor by a loss-scale-dependent amount.

  Either way, where ``Σ|x|`` is not finite (a NaN or ±inf in the channel, or an overflow) the
  factor is 1: the channel keeps the magnitude selection as it is, so a NaN stays NaN and an
  inf stays an inf of its sign (``inf / inf`` would turn it into NaN), and its finite entries
  are not scaled by an undefined ratio.
  """
  finite = jnp.isfinite(abs_sum)
  if eps is None:
    ok = finite & (abs_sum_pruned > 0)
    ratio = abs_sum / jnp.where(ok, abs_sum_pruned, 1.0)
  else:
    ok = finite
    ratio = abs_sum / (abs_sum_pruned + eps)
  return jnp.where(ok, ratio, 1.0)
