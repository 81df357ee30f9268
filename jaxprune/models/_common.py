"""Helpers shared by the models: spec validation, width scaling and precision."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp


def require_positive(field: str, value: object) -> None:
  """Raise ``ValueError`` naming ``field`` unless ``value`` is an int >= 1."""
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ValueError(f"{field} must be a positive int, got {value!r}")


def scale_width(width: int, multiplier: float) -> int:
  """``round(width * multiplier)``, at least 1: the one rounding rule used by every spec."""
  return max(1, int(round(width * multiplier)))


def check_multiplier(multiplier: float) -> None:
  if not multiplier > 0:
    raise ValueError(f"multiplier must be > 0, got {multiplier}")


def check_layer_paths(widths: Mapping[str, int], known: Mapping[str, int]) -> None:
  """Raise ``ValueError`` naming ``widths``' keys that are not layer paths of the spec."""
  unknown = sorted(set(widths) - set(known))
  if unknown:
    raise ValueError(f"widths: unknown layer paths {unknown}; known: {sorted(known)}")


def check_no_removed_blocks(removed_blocks: Iterable[str], spec: object) -> None:
  """Raise ``ValueError`` for a branch removal asked of a spec without residual branches."""
  removed = sorted(removed_blocks)
  if removed:
    raise ValueError(
      f"removed_blocks: {type(spec).__name__} has no removable branches, got {removed}"
    )


def check_precision(dtype: Any, param_dtype: Any) -> tuple[jnp.dtype | None, jnp.dtype]:
  """Validated ``(dtype, param_dtype)`` of a model, as ``jnp.dtype`` (``dtype`` may be ``None``).

  ``dtype`` is the compute dtype (Flax's meaning: ``None`` infers it from the inputs and
  parameters, i.e. float32 here); ``param_dtype`` the dtype parameters are stored in.

  Raises:
    ValueError: either is not a floating-point dtype (the message names it).
  """
  checked = []
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value is None and name == "dtype":
      checked.append(None)
      continue
    try:
      value = jnp.dtype(value)
    except TypeError:
      raise ValueError(f"{name} must be a floating-point dtype, got {value!r}") from None
    if not jnp.issubdtype(value, jnp.floating):
      raise ValueError(f"{name} must be a floating-point dtype, got {value!r}")
    checked.append(value)
  return checked[0], checked[1]


def float32_logits(logits: jax.Array) -> jax.Array:
  """``logits`` in at least float32.

  The loss and its gradient start in float32 whatever the compute dtype (a no-op for float32 models,
  so their results are unchanged).
  """
  return logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
