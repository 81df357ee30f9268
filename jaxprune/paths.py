"""Parameter paths: one spelling of "where a leaf sits" for every module of the library.

Flax NNX ``State``, pure dicts and Linen dicts flatten to different JAX key paths for the same
parameter (an NNX ``Variable`` adds a trailing ``value`` attribute on some code paths, e.g.
``nnx.Optimizer.init`` against ``update``). Every transform that keys per-parameter state by
name, and every read-out that matches masks to parameters, goes through :func:`param_path`
so that the names agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = ["ParamPath", "flatten_with_paths", "param_path", "path_string"]

ParamPath = tuple[Any, ...]


def _key_entry(entry: Any) -> Any | None:
  """One pytree key entry → path element; ``None`` drops it (a Variable's ``value``)."""
  if isinstance(entry, jax.tree_util.DictKey):
    return entry.key
  if isinstance(entry, jax.tree_util.SequenceKey):
    return entry.idx
  if isinstance(entry, jax.tree_util.GetAttrKey):
    # NNX Variables flatten through their ``value``; paths name the variable itself.
    return None if entry.name in ("value", "raw_value", "_raw_value") else entry.name
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return entry.key
  return str(entry)


def param_path(key_path: Sequence[Any]) -> ParamPath:
  """Converts a :func:`jax.tree_util.tree_flatten_with_path` key path to a plain tuple.

  ``(DictKey('stages'), DictKey(0), DictKey('conv'), DictKey('kernel'), GetAttrKey('value'))``
  → ``('stages', 0, 'conv', 'kernel')``. Works for NNX ``State``, pure dicts and Linen dicts.
  """
  return tuple(k for k in (_key_entry(e) for e in key_path) if k is not None)


def path_string(key_path: Sequence[Any]) -> str:
  """:func:`param_path` joined by ``/``: ``'stages/0/conv/kernel'``."""
  return "/".join(str(k) for k in param_path(key_path))


def flatten_with_paths(tree: Any) -> list[tuple[ParamPath, Any]]:
  """``(param_path, leaf)`` for every leaf of ``tree``, in flatten order."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return [(param_path(path), leaf) for path, leaf in leaves]
