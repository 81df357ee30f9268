"""Argument checks shared by the library's convolutions (pattern-sparse and SDGP): strides,
dilations and padding in ``nnx.Conv``'s forms, brought to what ``lax.conv_general_dilated``
takes, with a ``ValueError`` naming the argument for anything else."""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = ["canonical_padding", "spatial_pair"]


def spatial_pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
  """One positive int or a pair of them (strides, dilations) → ``(height, width)``.

  Raises:
    ValueError: not one or two positive integers (the message names ``name``).
  """
  try:
    pair = (
      (operator.index(value),) * 2
      if not isinstance(value, Sequence)
      else tuple(operator.index(v) for v in value)
    )
  except TypeError:
    pair = ()
  if len(pair) != 2 or min(pair) < 1:
    raise ValueError(f"{name} must be a positive int or a pair of them, got {value!r}")
  return pair  # type: ignore[return-value]


def canonical_padding(
  padding, strings: Sequence[str] = ("SAME", "VALID")
) -> str | tuple[tuple[int, int], ...]:
  """The upper-case padding string or ``((top, bottom), (left, right))`` of ``padding``.

  ``padding``: a padding string (any case), an int, or one int or ``(lo, hi)`` pair per spatial axis
  (``nnx.Conv``'s forms).

  Args:
    padding: the padding as given.
    strings: the padding strings the caller supports (``lax`` also knows ``"SAME_LOWER"``).

  Raises:
    ValueError: another string (e.g. ``"CIRCULAR"``), not two spatial axes, or a negative pad.
  """
  if isinstance(padding, str):
    if padding.upper() not in strings:
      raise ValueError(
        f"padding must be one of {', '.join(map(repr, strings))} or explicit pairs, got {padding!r}"
      )
    return padding.upper()
  if isinstance(padding, int):
    padding = (padding, padding)
  try:
    pads = tuple(
      (int(p), int(p)) if isinstance(p, int) else tuple(int(v) for v in p) for p in padding
    )
  except TypeError:
    pads = ()
  if len(pads) != 2 or any(len(p) != 2 or min(p) < 0 for p in pads):
    raise ValueError(f"padding pairs must be ((top, bottom), (left, right)) >= 0, got {padding!r}")
  return pads
