"""JSON encoding of model width specs (frozen dataclasses of ints / tuples) for checkpoints.

A reconfigured (pruned) model has a smaller spec than the one the run started with;
the checkpoint records it so a resume can rebuild the model before restoring arrays.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

_DATACLASS = "__dataclass__"
_TUPLE = "__tuple__"


def encode_spec(obj: Any) -> Any:
  """JSON-compatible form of a spec: dataclasses, tuples, lists, dicts and scalars."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    cls = type(obj)
    return {
      _DATACLASS: f"{cls.__module__}:{cls.__qualname__}",
      "fields": {
        f.name: encode_spec(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init
      },
    }
  if isinstance(obj, tuple):
    return {_TUPLE: [encode_spec(v) for v in obj]}
  if isinstance(obj, list):
    return [encode_spec(v) for v in obj]
  if isinstance(obj, dict):
    return {str(k): encode_spec(v) for k, v in obj.items()}
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  if hasattr(obj, "item"):  # numpy scalar
    return obj.item()
  raise ValueError(f"spec: cannot encode {type(obj).__name__} as JSON")


def decode_spec(data: Any) -> Any:
  """Inverse of :func:`encode_spec` (imports the dataclass named in the record)."""
  if isinstance(data, dict) and _DATACLASS in data:
    module_name, _, qualname = data[_DATACLASS].partition(":")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
      cls = getattr(cls, part)
    if not dataclasses.is_dataclass(cls):
      raise ValueError(f"spec: {data[_DATACLASS]} is not a dataclass")
    return cls(**{k: decode_spec(v) for k, v in data["fields"].items()})
  if isinstance(data, dict) and _TUPLE in data:
    return tuple(decode_spec(v) for v in data[_TUPLE])
  if isinstance(data, list):
    return [decode_spec(v) for v in data]
  if isinstance(data, dict):
    return {k: decode_spec(v) for k, v in data.items()}
  return data
