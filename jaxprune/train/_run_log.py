"""The run's JSON-lines log (one object per epoch, rewritten from the history on resume) and
the one-line epoch summary printed off a terminal."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["append", "epoch_line", "rewrite"]


def rewrite(path: str | None, history: Iterable[Mapping[str, Any]]) -> None:
  """Writes ``history`` to ``path``, one JSON object a line.

  Replaces the file atomically (no-op when ``path`` is ``None``).
  """
  if path is None:
    return
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for record in history:
      f.write(json.dumps(record) + "\n")
  os.replace(tmp, path)


def append(path: str | None, record: Mapping[str, Any]) -> None:
  """Appends one epoch's ``record`` to ``path`` (no-op when ``path`` is ``None``)."""
  if path is None:
    return
  with open(path, "a") as f:
    f.write(json.dumps(record) + "\n")


def epoch_line(
  record: Mapping[str, Any], epochs: int, seconds: float, *, compiles: bool = False
) -> str:
  """One epoch's summary for a log.

  Args:
    record: the epoch's record: its epoch, train loss and accuracy, and test accuracy when
      the epoch was evaluated.
    epochs: the run's epochs.
    seconds: the epoch's seconds (training, evaluation and hooks).
    compiles: the epoch is the first of a ``fit``, whose seconds include compiling the steps
      (often most of them): the line says so, so that nobody reads them as the epoch's cost.

  Returns:
    The line.
  """
  parts = [
    f"epoch {record['epoch']}/{epochs}",
    f"train_loss {record['train_loss']:.4f}",
    f"train_acc {record['train_acc']:.4f}",
  ]
  if "test_acc" in record:
    parts.append(f"test_acc {record['test_acc']:.4f}")
  if record.get("nonfinite_steps"):
    parts.append(f"nonfinite_steps {record['nonfinite_steps']}")
  note = ", compiling the steps included" if compiles else ""
  return "  ".join(parts) + f"  ({seconds:.1f} s{note})"
