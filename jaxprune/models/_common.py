"""Helpers shared by the width specs: validation and width scaling."""

from __future__ import annotations


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
