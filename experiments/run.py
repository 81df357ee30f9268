"""Run an experiment module: ``python -m experiments.run NAME [args...]``.

``NAME`` is a module of the ``experiments`` package (``experiments/NAME.py``) with a
``main(argv)`` function; the remaining arguments are passed to it.
``python -m experiments.run --list`` lists the runnable experiments.

The multi-host flags of :mod:`jaxprune.multihost` (``--coordinator-address``,
``--num-processes``, ``--process-id``, ``--num-cpu-devices``) are accepted anywhere in the
command line, for every experiment: they are taken out, ``jax.distributed`` is started from
them (or from their environment variables) before the experiment imports anything that
touches JAX, and the rest goes to the experiment.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import experiments
from jaxprune import multihost

_NOT_EXPERIMENTS = {"run", "__init__", "__main__"}


def available() -> list[str]:
  """Names of the experiment modules that define ``main``, sorted."""
  names = []
  for info in pkgutil.iter_modules(experiments.__path__):
    if info.ispkg or info.name.startswith("_") or info.name in _NOT_EXPERIMENTS:
      continue
    names.append(info.name)
  return sorted(names)


def load(name: str):
  """Import ``experiments.NAME`` and return its ``main``.

  Raises:
    ValueError: ``name`` is not an experiment module (the message lists them), or the
      module has no ``main``.
  """
  names = available()
  if name not in names:
    raise ValueError(f"unknown experiment {name!r}; available: {', '.join(names) or '(none)'}")
  module = importlib.import_module(f"experiments.{name}")
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
    print(__doc__.strip())
    print("\nexperiments:", ", ".join(available()))
    return 0 if argv else 2
  if argv[0] == "--list":
    for name in available():
      print(name)
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
