"""Helpers shared by the width specs: validation and width scaling."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


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
