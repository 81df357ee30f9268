"""Tests for ``import jaxprune``: heavy optional dependencies load only when used; the import
floors (paper packages side by side, ``methods`` above them, no circle)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_jaxprune_leaves_orbax_and_matplotlib_out_until_used(tmp_path):
  # A fresh interpreter: this test process may already have imported both.
  script = textwrap.dedent(
    f"""
    import sys

    import jaxprune

    def loaded(package):
      return sorted(m for m in sys.modules if m == package or m.startswith(package + "."))

    assert jaxprune.__file__.startswith({str(_REPO_ROOT)!r}), jaxprune.__file__
    assert not loaded("orbax"), loaded("orbax")
    assert not loaded("matplotlib"), loaded("matplotlib")
    # Checkpointing still works, and is what brings orbax in.
    jaxprune.train.CheckpointStore({str(tmp_path / "ckpt")!r})
    assert "orbax.checkpoint" in sys.modules
    """
  )
  result = subprocess.run(
    [sys.executable, "-c", script],
    cwd=_REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr


def _papers() -> set[str]:
  from jaxprune import methods

  return {paper.name for paper in methods.PAPERS}


def test_every_paper_package_is_listed_and_exposed():
  """A package with a ``preset`` module is a paper: it must be in ``methods.PAPERS`` (which the
  registry, the package face and the experiments read), and ``jaxprune`` must expose it."""
  import jaxprune
  from jaxprune import methods

  packages = {path.parent.name for path in (_REPO_ROOT / "jaxprune").glob("*/preset.py")}
  assert packages == _papers()
  for paper in methods.PAPERS:
    assert getattr(jaxprune, paper.name) is paper.package and paper.name in jaxprune.__all__
    assert set(paper.methods) <= set(methods.available())


def _unit_imports() -> dict[str, set[str]]:
  """Which unit of ``jaxprune`` (a subpackage or top-level module) imports which, read from
  the source: every ``import`` statement, those inside functions included."""
  package = _REPO_ROOT / "jaxprune"
  units = {p.stem for p in package.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
  units.discard("__init__")
  graph: dict[str, set[str]] = {unit: set() for unit in units}
  for path in package.rglob("*.py"):
    parts = path.relative_to(package).with_suffix("").parts
    if parts == ("__init__",):
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        names = [f"{node.module}.{alias.name}" for alias in node.names]
      else:
        continue
      for name in names:
        target = name.split(".")
        if target[0] == "jaxprune" and len(target) > 1 and target[1] in units:
          graph[parts[0]].add(target[1])
  for unit in graph:
    graph[unit].discard(unit)
  return graph


def test_paper_packages_stand_side_by_side_below_methods():
  graph = _unit_imports()
  papers = _papers()
  assert set(graph) >= papers | {"methods"}
  for paper in papers:
    assert not graph[paper] & (papers - {paper}), (paper, graph[paper])
  importers = {unit for unit, targets in graph.items() if targets & (papers | {"methods"})}
  assert importers == {"methods"}, importers


def test_no_import_circle():
  graph = _unit_imports()
  done: set[str] = set()

  def visit(unit, stack):
    assert unit not in stack, " -> ".join([*stack, unit])
    if unit not in done:
      for target in sorted(graph[unit]):
        visit(target, [*stack, unit])
      done.add(unit)

  for unit in sorted(graph):
    visit(unit, [])


def test_the_install_holds_the_library_only():
  """``pip install`` ships ``jaxprune`` and ``pallas_kernels``; ``experiments`` runs from a
  checkout, and matplotlib (which no library module imports) is an extra."""
  import tomllib

  project = tomllib.loads((_REPO_ROOT / "pyproject.toml").read_text())
  assert project["tool"]["setuptools"]["packages"]["find"]["include"] == [
    "jaxprune*",
    "pallas_kernels*",
  ]
  assert not [d for d in project["project"]["dependencies"] if d.startswith("matplotlib")]
  for package in ("jaxprune", "pallas_kernels"):
    for path in (_REPO_ROOT / package).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
          names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
          names = [node.module]
        else:
          continue
        assert not {n.split(".")[0] for n in names} & {"experiments", "matplotlib"}, path


_CLICKTRAIN = _REPO_ROOT / "jaxprune" / "clicktrain"
_EXECUTION = "jaxprune.clicktrain.execution"


def _imported(path: pathlib.Path) -> list[tuple[str, str]]:
  """``(module, name)`` of every name a source file imports (``name`` empty for a plain
  ``import module``), those inside functions included; relative imports resolved."""
  package = ".".join(path.relative_to(_REPO_ROOT).with_suffix("").parts[:-1])
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found += [(alias.name, "") for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = package.rsplit(".", node.level - 1)[0] if node.level else ""
      module = ".".join(p for p in (base, node.module or "") if p)
      found += [(module, alias.name) for alias in node.names]
  return found


def _reaches_execution(module: str, name: str) -> bool:
  target = f"{module}.{name}" if name else module
  return target == _EXECUTION or target.startswith(_EXECUTION + ".")


def test_clicktrain_training_half_does_not_import_the_execution_half():
  # The rule (jaxprune/clicktrain/__init__.py): no module of the training half imports
  # jaxprune.clicktrain.execution, except the package's __init__, which re-exports names from
  # the subpackage's face (never from one of its modules), and the preset, the one bridge,
  # which takes SparseExecution from it and nothing else.
  allowed = {"__init__.py": None, "preset.py": {"SparseExecution"}}
  seen = {}
  for path in sorted(_CLICKTRAIN.glob("*.py")):
    reached = [(m, n) for m, n in _imported(path) if _reaches_execution(m, n)]
    if not reached:
      continue
    assert path.name in allowed, (path.name, reached)
    assert all(m == _EXECUTION for m, _ in reached), (path.name, reached)
    seen[path.name] = {n for _, n in reached}
  assert seen["preset.py"] == allowed["preset.py"]
  assert "SparseExecution" in seen["__init__.py"]


def test_clicktrain_names_have_one_home():
  # A module's __all__ lists what it defines; only the package faces (__init__) re-export.
  for path in sorted(_CLICKTRAIN.rglob("*.py")):
    if path.name == "__init__.py":
      continue
    tree = ast.parse(path.read_text())
    defined, exported = set(), []
    for node in tree.body:
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        defined.add(node.name)
      elif isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
          for leaf in ast.walk(target):
            if isinstance(leaf, ast.Name):
              defined.add(leaf.id)
          if isinstance(target, ast.Name) and target.id == "__all__":
            exported = [ast.literal_eval(e) for e in node.value.elts]
    assert not set(exported) - defined, (path.name, sorted(set(exported) - defined))


def test_clicktrain_all_is_the_user_surface():
  from jaxprune import clicktrain
  from jaxprune.clicktrain import execution

  for package in (clicktrain, execution):
    assert len(package.__all__) == len(set(package.__all__)), package.__name__
    missing = [name for name in package.__all__ if not hasattr(package, name)]
    assert not missing, (package.__name__, missing)
  # The design's contracts are on the package's face; internals and the deprecated name are not.
  for name in ("pattern_scores", "kernel_scores", "all_patterns", "dppg_candidates"):
    assert name in clicktrain.__all__, name
  for name in ("convert_model", "vote", "select_pool", "full_mask", "PRUNED", "build_layout"):
    assert name not in clicktrain.__all__, name
  assert set(clicktrain.__all__) - set(execution.__all__) >= {"clicktrain", "masks", "method"}
