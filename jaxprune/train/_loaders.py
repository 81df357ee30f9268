"""What the trainer asks of a training loader, for loaders with or without each method: its
batch size, its position (for exact resume) and a new batch size (PruneTrain §4.3)."""

from __future__ import annotations

from typing import Any

__all__ = ["batch_size", "position", "restore", "set_batch_size"]


def batch_size(loader: Any) -> int | None:
  """The loader's ``batch_size`` (``None`` if it has none)."""
  size = getattr(loader, "batch_size", None)
  return int(size) if size is not None else None


def position(loader: Any) -> Any:
  """Position of a loader: ``jaxprune.data.Loader.state()`` or a ``state_dict()``."""
  for name in ("state", "state_dict"):
    method = getattr(loader, name, None)
    if callable(method):
      return method()
  return None


def restore(loader: Any, state: Any) -> None:
  """Puts a loader back at a :func:`position` (``restore`` or ``load_state_dict``)."""
  for name in ("restore", "load_state_dict"):
    method = getattr(loader, name, None)
    if callable(method):
      method(state)
      return


def set_batch_size(loader: Any, batch_size: int) -> None:
  """``loader.set_batch_size(batch_size)`` if it has one, else sets the attribute."""
  if hasattr(loader, "set_batch_size"):
    loader.set_batch_size(batch_size)
  else:
    loader.batch_size = batch_size

