"""The run's JSON-lines log: one object per epoch, rewritten from the history on resume."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["append", "rewrite"]


def rewrite(path: str | None, history: Iterable[Mapping[str, Any]]) -> None:
  """Writes ``history`` to ``path``, one JSON object a line, replacing the file atomically
  (no-op when ``path`` is ``None``)."""
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
