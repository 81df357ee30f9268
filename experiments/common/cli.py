"""The command-line flags the experiments share, and the command a page states.

parser = argparse.ArgumentParser()
add_table_arguments(parser, "sdgp_table1")   # --budget, --publish, --out, --seed, --root
add_dtype_argument(parser)                   # --dtype {fp32,bf16}
args = parser.parse_args(["--budget", "cpu"])
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from experiments.common import budgets


def add_publish_argument(parser: argparse.ArgumentParser, where: str) -> None:
  """``--publish``: every experiment writes to the scratch ``runs/<where>`` unless asked to
  publish to ``experiments/results/<where>``."""
  parser.add_argument(
    "--publish",
    action="store_true",
    help=f"write to experiments/results/{where} (default: runs/{where}, git-ignored)",
  )


def fill_defaults(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
  """Sets each argument still ``None`` (not given on the command line) to its default: a
  size preset such as ``--small`` fills what was left out and never overrides a flag given."""
  for name, value in defaults.items():
    if getattr(args, name) is None:
      setattr(args, name, value)


def add_output_arguments(parser: argparse.ArgumentParser, where: str) -> None:
  """``--publish`` (:func:`add_publish_argument`) and ``--out``, a folder overriding both."""
  add_publish_argument(parser, where)
  parser.add_argument("--out", default=None, help="write to this folder instead")


def add_resume_argument(parser: argparse.ArgumentParser) -> None:
  """``--resume``: continue each training of the command from its latest epoch checkpoint.

  Runs that take longer than one sitting (a ResNet-50 or VGG-13 row on 2 CPU cores, a paper
  budget on a GPU with a time limit per command) are run in parts: every table run
  checkpoints after each epoch (:func:`checkpoint_dir`), and the same command with
  ``--resume`` goes on from there, exactly as if it had not stopped.
  """
  parser.add_argument(
    "--resume",
    action="store_true",
    help="continue each run from its latest epoch checkpoint (runs/checkpoints/, written "
    "after every epoch); without it a run starts afresh and replaces them",
  )


# ``--dtype``: the compute dtype of the models a command trains (``models.create(dtype=...)``);
# parameters, BatchNorm statistics, optimizer state and logits stay float32 whatever it is.
DTYPES: Mapping[str, str] = MappingProxyType({"fp32": "float32", "bf16": "bfloat16"})


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
  """``--dtype {fp32,bf16}`` (default fp32, as every published run): the models' compute dtype.

  A run at another dtype than fp32 keeps its results apart (:func:`dtype_suffix` in its file
  names, :func:`dtype_config` in the configuration a resume is checked against), so it never
  replaces an fp32 result.
  """
  parser.add_argument(
    "--dtype",
    choices=list(DTYPES),
    default="fp32",
    help="compute dtype of the models (parameters, BatchNorm statistics and optimizer state "
    "stay float32); a bf16 run's files carry _bf16 in their names",
  )


def _dtype_name(args: Any) -> str:
  """``args.dtype`` (a namespace without one: ``"fp32"``) or the name itself, checked."""
  name = args if isinstance(args, str) else getattr(args, "dtype", "fp32")
  if name not in DTYPES:
    raise ValueError(f"dtype: unknown {name!r}; choose from {list(DTYPES)}")
  return name


def compute_dtype(args: Any) -> Any:
  """The ``dtype`` for ``models.create`` of a run with ``args.dtype`` (or a name of
  :data:`DTYPES`): ``None`` for fp32 (the models' float32 default: the same model as before
  the flag), else the ``jnp.dtype``.

  Raises:
    ValueError: a name that is not a key of :data:`DTYPES`.
  """
  name = _dtype_name(args)
  if name == "fp32":
    return None
  import jax.numpy as jnp  # here: this module stays importable before JAX is set up

  return jnp.dtype(DTYPES[name])


def dtype_suffix(args: Any) -> str:
  """``""`` for fp32 (the published names stay), ``"_<dtype>"`` (``"_bf16"``) otherwise: the
  marker in a run's file stems and page names."""
  name = _dtype_name(args)
  return "" if name == "fp32" else f"_{name}"


def dtype_config(args: Any) -> dict[str, str]:
  """The dtype entry of a run's saved configuration: ``{}`` for fp32 (configurations written
  before the flag, whose checkpoints still resume, are fp32 runs), ``{"dtype": "bf16"}``
  otherwise, so a resume or a reuse across dtypes is refused."""
  name = _dtype_name(args)
  return {} if name == "fp32" else {"dtype": name}


def dtype_notes(args: Any) -> list[str]:
  """The line a results page adds for a run at another dtype than fp32 (none for fp32)."""
  name = _dtype_name(args)
  if name == "fp32":
    return []
  note = (
    f"Compute dtype: {name} ({DTYPES[name]} activations and convolutions; parameters, "
    "BatchNorm statistics, optimizer state and logits float32)."
  )
  return [note]


def add_table_arguments(parser: argparse.ArgumentParser, table: str) -> None:
  """``--budget``, ``--publish``, ``--out``, ``--seed`` and ``--root``: the arguments every
  table command takes (flags that every experiment needs, such as multi-host start-up, belong
  here too)."""
  parser.add_argument(
    "--budget",
    choices=sorted(budgets.BUDGETS[table]),
    default="cpu",
    help="named recipe shared by every row: paper (the paper's, for a GPU) or cpu (reduced)",
  )
  add_output_arguments(parser, budgets.PAPER_OF[table] + "/")
  parser.add_argument(
    "--seed", type=int, default=0, help="seed of the data subset, the models and the data order"
  )
  parser.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")


def command_line(name: str, argv: Sequence[str] | None) -> str:
  """The command that reproduces this run, as the page states it."""
  args = list(argv) if argv is not None else sys.argv[1:]
  return f"python -m experiments.run {name} {shlex.join(args)}".rstrip()
