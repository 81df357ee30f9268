"""experiments.run: the one entry point takes the multi-host flags out for every experiment."""

import argparse
import ast
import re
from pathlib import Path

import pytest

from experiments import run as run_module


def test_multihost_flags_start_jax_distributed_and_the_rest_reaches_the_experiment(monkeypatch):
  started, received = [], []
  monkeypatch.setattr(run_module.multihost, "initialize", started.append)
  monkeypatch.setattr(run_module, "load", lambda name: received.append(name) or received.append)
  argv = ["quickstart", "--epochs", "2", "--num-processes", "2", "--process-id", "1"]
  argv += ["--coordinator-address", "127.0.0.1:5", "--out", "x"]
  assert run_module.main(argv) == 0
  assert received == ["quickstart", ["--epochs", "2", "--out", "x"]]
  (flags,) = started
  assert (flags.num_processes, flags.process_id, flags.coordinator_address) == (2, 1, "127.0.0.1:5")


def test_flags_are_not_abbreviated():
  flags, rest = run_module.split_multihost(["x", "--process", "3", "--num", "1"])
  assert rest == ["x", "--process", "3", "--num", "1"]
  assert flags.process_id is None and flags.num_processes is None


def test_inconsistent_multihost_flags_exit_with_the_error(capsys):
  assert run_module.main(["quickstart", "--num-processes", "2", "--process-id", "2"]) == 2
  assert "process_id 2" in capsys.readouterr().err


REPO = Path(__file__).resolve().parents[2]
_WINGS = ("clicktrain", "prunetrain", "sdgp", "benchmarks", "gpu")
# Which wings each wing may import (besides experiments.common, which every wing may):
# the paper wings stand alone, the queue drives the paper tables.
_MAY_IMPORT = {
  "common": set(),
  "clicktrain": set(),
  "prunetrain": set(),
  "sdgp": set(),
  "benchmarks": set(),
  "gpu": {"clicktrain", "prunetrain", "sdgp"},
}


def _documented_names() -> set[str]:
  texts = [REPO / "README.md", REPO / "experiments" / "gpu" / "run.sh"]
  for folder, pattern in (("docs", "*.md"), ("notebooks", "*"), ("experiments/results", "*.md")):
    texts += [p for p in (REPO / folder).rglob(pattern) if p.is_file()]
  names = set()
  for path in texts:
    names |= set(re.findall(r"experiments\.run ([a-z][a-z0-9_]*)", path.read_text()))
  return names


def test_every_documented_command_runs_from_its_wing():
  documented = _documented_names()
  assert {"clicktrain_table1", "step_bench", "gpu_queue", "quickstart"} <= documented
  assert documented <= set(run_module.COMMANDS), documented - set(run_module.COMMANDS)
  for name in run_module.COMMANDS:
    assert callable(run_module.load(name)), name


def test_every_module_with_a_main_is_a_command():
  listed = set(run_module.COMMANDS.values())
  for wing in _WINGS:
    for path in (REPO / "experiments" / wing).glob("*.py"):
      tree = ast.parse(path.read_text())
      if any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body):
        assert f"{wing}.{path.stem}" in listed, path


def test_unknown_command_names_the_choices(capsys):
  assert run_module.main(["clicktrain_tabel1"]) == 2
  err = capsys.readouterr().err
  assert "unknown experiment 'clicktrain_tabel1'" in err and "clicktrain_table1" in err


def _imported_wings(path: Path) -> set[str]:
  wings = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("experiments"):
      parts = node.module.split(".")
      if len(parts) > 1:
        wings.add(parts[1])
      else:  # from experiments import <wing>
        wings |= {alias.name for alias in node.names}
    elif isinstance(node, ast.Import):
      for alias in node.names:
        parts = alias.name.split(".")
        if parts[0] == "experiments" and len(parts) > 1:
          wings.add(parts[1])
  return wings - {"run"}


def test_wings_import_only_common_and_what_they_drive():
  for wing, allowed in _MAY_IMPORT.items():
    for path in (REPO / "experiments" / wing).glob("*.py"):
      imported = _imported_wings(path) - {wing}
      if wing != "common":
        imported.discard("common")
      assert imported <= allowed, f"{path.relative_to(REPO)} imports {sorted(imported - allowed)}"


def test_runner_lists_and_rejects_unknown(capsys):
  assert {"quickstart", "cifar_baseline"} <= set(run_module.available())
  assert "run" not in run_module.available()
  assert run_module.main(["--list"]) == 0
  lines = capsys.readouterr().out.splitlines()
  # One line per command: its name and the first line of its module's docstring, plain.
  assert [line.split()[0] for line in lines] == run_module.available()
  quickstart = next(line for line in lines if line.startswith("quickstart "))
  assert quickstart.split(None, 1)[1] == (
    "Quickstart: train on scikit-learn's 8x8 digits and print a results table."
  )
  train_step = next(line for line in lines if line.startswith("bench_train_step "))
  assert "jaxprune.train's split/merge jax.jit step vs nnx.jit" in train_step  # no ``markup``
  assert run_module.main(["--help"]) == 0
  shown = capsys.readouterr().out
  assert "python -m experiments.run NAME" in shown and "jaxprune.multihost (" in shown
  assert not any(mark in shown for mark in ("``", ":data:", ":mod:", ":func:"))
  with pytest.raises(ValueError, match="unknown experiment 'no_such_experiment'"):
    run_module.load("no_such_experiment")
  assert run_module.main(["no_such_experiment"]) == 2
  assert "unknown experiment" in capsys.readouterr().err


@pytest.mark.parametrize(
  "command", ["quickstart", "clicktrain_table1", "prunetrain_table1", "sdgp_table1", "sdgp_fig8"]
)
def test_every_flag_of_the_readme_commands_says_what_it_does(monkeypatch, capsys, command):
  # Every option the parser of a command the README runs defines (its own and the shared
  # ones) has a help text.
  missing: dict[str, list[str]] = {}
  add_argument = argparse.ArgumentParser.add_argument

  def recording(parser, *names, **kwargs):
    if names and names[0].startswith("--") and not kwargs.get("help"):
      missing.setdefault(current, []).append(names[0])
    return add_argument(parser, *names, **kwargs)

  monkeypatch.setattr(argparse.ArgumentParser, "add_argument", recording)
  current = command
  with pytest.raises(SystemExit) as exit_:
    run_module.load(command)(["--help"])
  assert exit_.value.code == 0
  assert "--seed" in capsys.readouterr().out
  assert not missing
