"""Run an experiment: ``python -m experiments.run NAME [args...]``.

``NAME`` is one of :data:`COMMANDS`, the one list of the commands the pages and docs name; each
lives in a wing of ``experiments/`` (``clicktrain/``, ``prunetrain/``, ``sdgp/``,
``benchmarks/`` for the cross-method benches, ``gpu/``) and has a ``main(argv)`` function, which
gets the remaining arguments. ``python -m experiments.run --list`` lists them.

The multi-host flags of :mod:`jaxprune.multihost` (``--coordinator-address``,
``--num-processes``, ``--process-id``, ``--num-cpu-devices``) are accepted anywhere in the
command line, for every experiment: they are taken out, ``jax.distributed`` is started from
them (or from their environment variables) before the experiment imports anything that
touches JAX, and the rest goes to the experiment.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from jaxprune import multihost

# Command name -> module (under ``experiments.``). The names are those every page and doc
# quotes; the modules are named for what they are inside their wing.
COMMANDS: dict[str, str] = {
  # ClickTrain
  "clicktrain_table1": "clicktrain.table1",
  "aligned_bench": "clicktrain.aligned_bench",
  "pattern_conv_bench": "clicktrain.pattern_conv_bench",
  "clicktrain_overhead": "clicktrain.overhead",
  # PruneTrain
  "prunetrain_table1": "prunetrain.table1",
  "prunetrain_speed": "prunetrain.speed",
  "prunetrain_compile_bench": "prunetrain.compile_bench",
  "prunetrain_any_model": "prunetrain.any_model",
  "prunetrain_transformers": "prunetrain.transformers",
  # SDGP
  "sdgp_table1": "sdgp.table1",
  "sdgp_fig8": "sdgp.fig8",
  "sdgp_timemodel": "sdgp.timemodel",
  # Across the methods
  "quickstart": "benchmarks.quickstart",
  "step_bench": "benchmarks.step_bench",
  "allreduce_bench": "benchmarks.allreduce_bench",
  "cifar_baseline": "benchmarks.cifar_baseline",
  "model_params": "benchmarks.model_params",
  "fit_sizing": "benchmarks.fit_sizing",
  "fit_width": "benchmarks.fit_width",
  "bench_train_step": "benchmarks.train_step",
  "bench_conv_weight_grad": "benchmarks.conv_weight_grad",
  "bench_loader": "benchmarks.loader",
  "bench_decode": "benchmarks.decode",
  "bench_imagenet_loader": "benchmarks.imagenet_loader",
  "device_loader_bench": "benchmarks.device_loader",
  # The accelerator window
  "gpu_queue": "gpu.queue",
}


def available() -> list[str]:
  """The command names, sorted."""
  return sorted(COMMANDS)


def plain(text: str) -> str:
  """``text`` without its reStructuredText markup, for a terminal: ``:role:`~a.b``` becomes
  ``b`` (``a.b`` without the tilde), a double-backquoted literal its bare text."""
  text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"\1", text)
  text = re.sub(r":\w+:`([^`]+)`", r"\1", text)
  return text.replace("``", "")


def describe(name: str) -> str:
  """The one-line summary of command ``name``: its module's docstring's first line, read from
  the source (nothing is imported), without markup.

  Raises:
    ValueError: ``name`` is not a command.
  """
  if name not in COMMANDS:
    raise ValueError(f"unknown experiment {name!r}; available: {', '.join(available())}")
  path = Path(__file__).parent.joinpath(*COMMANDS[name].split(".")).with_suffix(".py")
  doc = ast.get_docstring(ast.parse(path.read_text())) or ""
  return plain(doc.splitlines()[0]) if doc else ""


def load(name: str):
  """Import the module of command ``name`` and return its ``main``.

  Raises:
    ValueError: ``name`` is not a command (the message lists them), or its module has no
      ``main``.
  """
  if name not in COMMANDS:
    names = ", ".join(available())
    raise ValueError(f"unknown experiment {name!r}; available: {names}")
  module = importlib.import_module(f"experiments.{COMMANDS[name]}")
  main = getattr(module, "main", None)
  if not callable(main):
    raise ValueError(f"experiment {name!r} has no main(argv) function")
  return main


def split_multihost(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
  """Separates the multi-host flags from an experiment's own arguments.

  Returns:
    ``(flags, rest)``: the :func:`jaxprune.multihost.add_arguments` flags and the other
    arguments, in order.
  """
  # No abbreviations: "--process" must not be read as --process-id by accident.
  parser = multihost.add_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
  return parser.parse_known_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  try:
    flags, argv = split_multihost(argv)
    multihost.initialize(flags)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  if not argv or argv[0] in ("-h", "--help"):
    print(plain(__doc__.strip()))
    print("\nexperiments:", ", ".join(available()))
    return 0 if argv else 2
  if argv[0] == "--list":
    width = max(map(len, available()))
    for name in available():
      print(f"{name:<{width}}  {describe(name)}")
    return 0
  try:
    experiment_main = load(argv[0])
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  result = experiment_main(argv[1:])
  return result if isinstance(result, int) else 0


if __name__ == "__main__":
  sys.exit(main())
