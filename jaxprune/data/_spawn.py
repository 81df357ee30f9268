"""Spawned worker processes and the main script: find the missing ``__main__`` guard.

A worker started with the ``spawn`` method (grain's, and the only one safe with JAX's threads)
re-runs the main module before it does its work (Python's ``multiprocessing`` "safe importing
of main module"). A script that builds and iterates a loader at its top level, without an
``if __name__ == "__main__":`` guard, therefore makes every worker run the whole script again,
up to its own attempt to start workers, where ``multiprocessing`` stops it and the worker dies.
"""

from __future__ import annotations

import ast
import sys
import tokenize

__all__ = ["GUARD_ADVICE", "unguarded_main_script"]

GUARD_ADVICE = (
  'put the code that builds and iterates the loader under `if __name__ == "__main__":` (or '
  "in a function called from there), or pass num_workers=0 to decode in this process"
)


def _is_main_test(node: ast.AST) -> bool:
  """``__name__ == "__main__"`` (either way round)."""
  if not isinstance(node, ast.Compare):
    return False
  operands = [node.left, *node.comparators]
  return any(isinstance(o, ast.Name) and o.id == "__name__" for o in operands) and any(
    isinstance(o, ast.Constant) and o.value == "__main__" for o in operands
  )


def unguarded_main_script() -> str | None:
  """The main script's path if spawned workers would re-run it and it has no guard.

  ``None`` when there is nothing to re-run (an interactive session or notebook: no file; a
  package's ``__main__``, as ``python -m pytest``, which ``multiprocessing`` skips), when the
  source cannot be read or parsed (no evidence either way), or when it compares
  ``__name__`` with ``"__main__"`` anywhere.
  """
  main = sys.modules.get("__main__")
  path = getattr(main, "__file__", None)
  spec_name = getattr(getattr(main, "__spec__", None), "name", None)
  if path is None or (spec_name is not None and spec_name.split(".")[-1] == "__main__"):
    return None
  try:
    with tokenize.open(path) as file:
      tree = ast.parse(file.read())
  except (OSError, SyntaxError, UnicodeDecodeError):
    return None
  return None if any(_is_main_test(node) for node in ast.walk(tree)) else str(path)
