"""The package's public docstrings open with a one-line summary, as Optax's do.

Public: a function, method or class whose name does not start with ``_``, in any module of
``jaxprune/``. Its summary is the docstring's first paragraph (up to the first blank line); it has
to be a single line, with the detail in the paragraphs after it.
"""

from __future__ import annotations

import ast
import pathlib

_PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jaxprune"
_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _multi_line_summaries() -> list[str]:
  """``path:line name`` of every public docstring whose summary spans several lines."""
  found = []
  for path in sorted(_PACKAGE.rglob("*.py")):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
      if not isinstance(node, _DEFINITIONS) or node.name.startswith("_"):
        continue
      docstring = ast.get_docstring(node)
      if docstring and "\n" in docstring.split("\n\n")[0]:
        where = path.relative_to(_PACKAGE.parent)
        found.append(f"{where}:{node.body[0].lineno} {node.name}")
  return found


def test_the_package_has_public_docstrings():
  # Guards the walk below: a wrong package path would make it pass on nothing.
  assert any(_PACKAGE.rglob("*.py"))
  tree = ast.parse((_PACKAGE / "train" / "trainer.py").read_text(encoding="utf-8"))
  names = {n.name for n in ast.walk(tree) if isinstance(n, _DEFINITIONS) and ast.get_docstring(n)}
  assert "Trainer" in names


def test_public_docstring_summaries_fit_on_one_line():
  found = _multi_line_summaries()
  assert not found, (
    f"{len(found)} public docstring(s) whose summary (first paragraph) spans several lines; "
    "give each a one-line summary, then a blank line and the detail:\n" + "\n".join(found)
  )
