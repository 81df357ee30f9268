"""What every paper-table command shares: named budgets, where results go, the results page.

A *budget* is one named recipe for a whole table: ``paper`` is the paper's recipe exactly (for a
GPU), ``cpu`` one reduced recipe that every row of that table shares: reduced width over the
full training set, sized from FLOPs so that a run takes about an hour on 2 CPU cores and a
dense row gets near 80% on CIFAR-10 (the dense PruneTrain ResNet-20, 82 MFLOPs per image,
reached 81.4% in 10 epochs and 68 minutes on such a machine,
``results/benchmarks/cifar10_resnet20_dense.md``).

Runs write to ``runs/<paper>/`` (git-ignored) unless ``--publish`` is given, which writes to
``experiments/results/<paper>/``, the pages the repository links. Names follow one scheme:
pages ``<table>_<budget>[_<row>].md`` (JSON beside them), per-epoch logs
``logs/<table>_<budget>_<row>_<method>.jsonl``, and runs that are not rows of a table (probes)
under ``probes/`` (:func:`probes_dir`). A run with ``--dtype`` other than fp32
(:func:`add_dtype_argument`) marks its budget: ``table1_cpu_bf16_vgg11_dense.json``.

    parser = argparse.ArgumentParser()
    add_table_arguments(parser, "sdgp_table1")
    args = parser.parse_args(["--budget", "cpu"])
    budget = get_budget("sdgp_table1", args.budget)
    out = output_dir("sdgp", publish=args.publish, out=args.out)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from jaxprune import methods

EXPERIMENTS = Path(__file__).resolve().parent
RESULTS = EXPERIMENTS / "results"
SCRATCH = EXPERIMENTS.parent / "runs"
# The results folders: one per paper of the library's list, and the benchmarks'.
PAPERS = (*(paper.results for paper in methods.PAPERS), "benchmarks")

# The SDGP training recipe (the ffcv ResNet-9 recipe SDGP ran): the cpu budget keeps its shape,
# scales the peak lr linearly with the batch and puts the peak at the recipe's fraction of the
# run, no earlier than half an epoch. "init": "released" is the authors' converter: every conv
# re-initialised (Kaiming-uniform) and the dense row converted as 4:4 (sdgp.paper_method);
# "model" keeps the model's own init and leaves the dense row unconverted.
_SDGP_PAPER = {
  "width": 1.0,
  "train_subset": None,
  "test_subset": None,
  "epochs": 150,
  "batch_size": 512,
  "init": "released",
}
_SDGP_CPU = {
  "width": 0.125,
  "train_subset": None,
  "test_subset": None,
  "epochs": 10,
  "batch_size": 128,
  "init": "released",
}


def _sdgp_schedule(budget: dict[str, Any]) -> dict[str, Any]:
  budget["peak_lr"] = 0.5 * budget["batch_size"] / 512
  budget["peak_epoch"] = min(2.0, max(0.5, budget["epochs"] * 2.0 / 150))
  return budget


# Table -> budget name -> settings. Every row of a table trains with these (the rows differ only
# in model and method), so the rows of one page compare. A table is named
# "<paper>_<figure>", the paper by its package name in jaxprune.methods.PAPERS (PAPER_OF).
BUDGETS: Mapping[str, Mapping[str, Mapping[str, Any]]] = {
  # ClickTrain §6.1: 190 epochs, batch 128, SGD 0.9, lr 0.1 (×0.1 at 50% / 75%: the paper does
  # not state its schedule), wd 5e-4; pool / finalization 5 epochs each, hard prune at the
  # row's epoch of Table 1.
  "clicktrain_table1": {
    "paper": {
      "width": 1.0,
      "train_subset": None,
      "test_subset": None,
      "epochs": 190,
      "batch_size": 128,
      "lr": 0.1,
      "milestones": (0.5, 0.75),
      "pool_epochs": 5,
      "finalize_epochs": 5,
      "hard_prune_fraction": None,
      "linear_init_std": None,
    },
    # The width is set per model family so that every dense row costs 20-41 MFLOPs per image
    # and a run takes under an hour on 2 cores (measured: a 390-step epoch takes 2.2 min for
    # VGG-11 ×1/4, 3.2 min for VGG-13 ×1/4, 4.0 min for ResNet-32 ×1/8). At ×1/8 VGG-11 has 5
    # MFLOPs and its dense row stopped at 66.8%. The stages are squeezed into the run (one
    # epoch each of warm-up, pool generation and finalization; hard prune at 60%). The VGG
    # classifier's N(0, 0.01) init stays at chance for hundreds of steps at reduced width, so
    # it is N(0, 0.05) for every row of both methods.
    "cpu": {
      "width": MappingProxyType({"resnet": 0.125, "vgg": 0.25}),
      "train_subset": None,
      "test_subset": None,
      "epochs": 12,
      "batch_size": 128,
      "lr": 0.1,
      "milestones": (0.5, 0.75),
      "pool_epochs": 1,
      "finalize_epochs": 1,
      "hard_prune_fraction": 0.6,
      "linear_init_std": 0.05,
    },
  },
  # PruneTrain §5 and the authors' scripts: 182 epochs, lr 0.1 ×0.1 at epochs 91 / 136, penalty
  # ratio 0.2, threshold 1e-4, reconfiguration every 10 epochs, dynamic mini-batch.
  "prunetrain_table1": {
    "paper": {
      "width": 1.0,
      "train_subset": None,
      "test_subset": None,
      "epochs": 182,
      "batch_size": 128,
      "lr": 0.1,
      "milestones": (0.5, 0.75),
      "interval": 10,
      "penalty_ratio": 0.2,
      "threshold": 1e-4,
    },
    # Half width, full data, 10 epochs (3 900 steps). With SGD the group lasso shrinks a group
    # by about lr·λ/(1−momentum) per step; the paper's ratio 0.2 needs ~10⁴ steps to kill a
    # channel, so the ratio is raised to 0.55 (λ ∝ r/(1−r): 4.9× the paper's) and the threshold
    # to 1e-2 (groups jitter around zero with amplitude ~lr·λ). Ratio 0.6 (λ 6×) ended at 13%
    # of the inference FLOPs against the paper's 34% (results/prunetrain/index.md).
    "cpu": {
      "width": 0.5,
      "train_subset": None,
      "test_subset": None,
      "epochs": 10,
      "batch_size": 128,
      "lr": 0.1,
      "milestones": (0.5, 0.75),
      "interval": 1,
      "penalty_ratio": 0.55,
      "threshold": 1e-2,
    },
  },
  "sdgp_table1": {
    "paper": _sdgp_schedule(dict(_SDGP_PAPER)),
    "cpu": _sdgp_schedule(dict(_SDGP_CPU)),
  },
  # Fig. 8 trains each n:m cell with Table I's recipe.
  "sdgp_fig8": {
    "paper": _sdgp_schedule(dict(_SDGP_PAPER)),
    "cpu": _sdgp_schedule(dict(_SDGP_CPU)),
  },
  # Fig. 10: the time model at the training budget's width, and the target accuracy of the
  # time-to-accuracy table (the paper's 94.5%; for the cpu budget a level its dense row passes).
  "sdgp_timemodel": {
    "paper": {"width": 1.0, "batch_size": 512, "target_acc": 0.945},
    "cpu": {"width": 0.125, "batch_size": 32, "target_acc": 0.75},
  },
}


def _results_of(table: str) -> str:
  """The results folder of ``table``: its paper's, named by the table's first word."""
  by_package = {paper.name: paper.results for paper in methods.PAPERS}
  paper = table.partition("_")[0]
  if paper not in by_package:
    raise ValueError(f"table {table!r} does not start with a paper of {sorted(by_package)}")
  return by_package[paper]


# Which results folder each table command writes to.
PAPER_OF = {table: _results_of(table) for table in BUDGETS}


def get_budget(table: str, name: str) -> Mapping[str, Any]:
  """The settings of budget ``name`` for ``table`` (read-only).

  Args:
    table: a key of :data:`BUDGETS` (``"sdgp_table1"``, ...).
    name: ``"paper"`` or ``"cpu"``.

  Returns:
    A read-only mapping of the budget's settings.

  Raises:
    ValueError: ``table`` or ``name`` is unknown (the message names it and lists the choices).
  """
  if table not in BUDGETS:
    raise ValueError(f"table: unknown table {table!r}; choose from {sorted(BUDGETS)}")
  if name not in BUDGETS[table]:
    raise ValueError(
      f"budget: unknown budget {name!r} for {table}; choose from {sorted(BUDGETS[table])}"
    )
  return MappingProxyType(dict(BUDGETS[table][name]))


def row_width(width: float | Mapping[str, float], row: str) -> float:
  """The width multiplier a budget gives ``row``.

  Args:
    width: a budget's ``width``: one multiplier for every row, or a mapping from model family
      (the prefix of the row's name: ``"vgg"`` for ``"vgg11"``) to its multiplier.
    row: the row's model name.

  Returns:
    The multiplier.

  Raises:
    ValueError: ``width`` is a mapping with no family that ``row`` starts with.
  """
  if not isinstance(width, Mapping):
    return float(width)
  for family, multiplier in width.items():
    if row.startswith(family):
      return float(multiplier)
  raise ValueError(f"row: {row!r} is of no model family of the budget's width {dict(width)}")


def _describe_width(width: float | Mapping[str, float]) -> str:
  if isinstance(width, Mapping):
    return " / ".join(f"{family} ×{multiplier:g}" for family, multiplier in width.items())
  return f"×{width:g}"


def describe_budget(budget: Mapping[str, Any]) -> str:
  """One line naming the data, width and schedule of a budget (for the results page)."""
  train_images = budget.get("train_subset") or 50_000
  test_images = budget.get("test_subset") or 10_000
  parts = [f"width {_describe_width(budget['width'])}"]
  if "epochs" in budget:
    parts.append(f"{train_images:,} training / {test_images:,} test images")
    parts.append(f"{budget['epochs']} epochs at batch {budget['batch_size']}")
  else:
    parts.append(f"batch {budget['batch_size']}")
  return ", ".join(parts)


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


def checkpoint_dir(paper: str, stem: str, out: str | os.PathLike | None = None) -> Path:
  """Where a table run writes its epoch checkpoints: ``runs/checkpoints/<paper>/<stem>``
  (scratch, also for a ``--publish`` run, so they never land beside the results), or
  ``<out>/checkpoints/<stem>`` for a run with ``--out``."""
  if paper not in PAPERS:
    raise ValueError(f"paper: unknown {paper!r}; choose from {PAPERS}")
  base = Path(out) / "checkpoints" if out is not None else SCRATCH / "checkpoints" / paper
  return base / stem


def start_or_resume(trainer: Any, train_loader: Any, resume: bool) -> bool:
  """Before a table run's first ``fit``: with ``resume``, restore the trainer's latest
  checkpoint. Returns whether one was restored.

  The run's ``fit`` calls then pass ``resume=False, overwrite=True``: a restored run goes on
  writing its own checkpoints, a fresh one first deletes what an earlier run left there.
  """
  if not resume:
    return False
  restored = trainer.restore_checkpoint(train_loader)
  where = trainer.store.directory if trainer.store is not None else None
  if restored:
    print(f"resumed at epoch {trainer.epoch} from {where}", flush=True)
  else:
    print(f"--resume: no checkpoint in {where}; starting afresh", flush=True)
  return restored


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
    choices=sorted(BUDGETS[table]),
    default="cpu",
    help="named recipe shared by every row: paper (the paper's, for a GPU) or cpu (reduced)",
  )
  add_output_arguments(parser, PAPER_OF[table] + "/")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")


def output_dir(
  paper: str | None, publish: bool = False, out: str | os.PathLike | None = None
) -> Path:
  """The folder a run writes its page, JSON and logs to (created).

  Args:
    paper: one of :data:`PAPERS`, or None for the top of the folder (the quickstart's page).
    publish: write to ``experiments/results/<paper>/`` instead of the scratch ``runs/<paper>/``.
    out: an explicit folder, overriding both.

  Returns:
    The folder, created if missing.

  Raises:
    ValueError: ``paper`` is not one of :data:`PAPERS`.
  """
  if paper is not None and paper not in PAPERS:
    raise ValueError(f"paper: unknown {paper!r}; choose from {PAPERS}")
  base = RESULTS if publish else SCRATCH
  folder = Path(out) if out is not None else base / (paper or "")
  folder.mkdir(parents=True, exist_ok=True)
  return folder


def probes_dir(folder: str | os.PathLike) -> Path:
  """``<folder>/probes/`` (created): where a run that is not a row of its table writes (a probe,
  a measurement beside the table), so that a paper's folder holds its tables' pages only."""
  probes = Path(folder) / "probes"
  probes.mkdir(parents=True, exist_ok=True)
  return probes


def command_line(name: str, argv: Sequence[str] | None) -> str:
  """The command that reproduces this run, as the page states it."""
  args = list(argv) if argv is not None else sys.argv[1:]
  return f"python -m experiments.run {name} {shlex.join(args)}".rstrip()


def write_result(stem: Path, result: Mapping[str, Any], page: str) -> None:
  """A benchmark's saved record: ``<stem>.json`` (the result) and ``<stem>.md`` (its page),
  rewritten whole each time (benchmarks save after every row, so a cut-short run keeps its
  rows)."""
  stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
  stem.with_suffix(".md").write_text(page)


def utc_now() -> str:
  """The date and time a page states, in UTC."""
  return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def as_saved(budget: Mapping[str, Any]) -> dict[str, Any]:
  """``budget`` in the form a result's JSON holds it (tuples become lists, read-only mappings
  such as a per-family ``width`` plain dicts), for comparing a preset with what an earlier run
  saved."""
  return json.loads(json.dumps(dict(budget), default=_plain_mapping))


def _plain_mapping(value: Any) -> dict[str, Any]:
  if isinstance(value, Mapping):
    return dict(value)
  raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def saved_result(stem: Path, budget: Mapping[str, Any]) -> tuple[dict[str, Any] | None, bool]:
  """What an earlier run wrote to ``stem.json`` (``None`` when nothing) and whether it ran under
  ``budget`` (compared with :func:`as_saved`)."""
  path = Path(stem).with_suffix(".json")
  if not path.exists():
    return None, False
  saved = json.loads(path.read_text())
  return saved, saved.get("budget") == as_saved(budget)


def joined_commands(records: Sequence[Mapping[str, Any]], default: str | None = None) -> str:
  """The distinct ``command`` of ``records`` in order, joined by `` ; ``: the line a page shows
  when its rows were gathered from several invocations. With ``default`` (the current
  invocation's command), a record saved without a command is credited to it, and no records
  give ``default``; without it every record must have one."""
  commands = (r["command"] if default is None else r.get("command", default) for r in records)
  return " ; ".join(dict.fromkeys(commands)) or (default or "")


def _cell(value: Any) -> str:
  if value is None:
    return "—"
  return str(value)


def results_page(
  title: str,
  *,
  command: str,
  budget_name: str,
  budget: Mapping[str, Any],
  machine: str,
  columns: Sequence[str],
  rows: Sequence[tuple[str, Sequence[Any], Sequence[Any]]],
  logs: Mapping[str, str] = MappingProxyType({}),
  notes: Sequence[str] = (),
  date: str | None = None,
) -> str:
  """A results page: the paper's numbers beside ours, the budget stated, the raw logs linked.

  Args:
    title: the page's heading.
    command: the command that wrote the page.
    budget_name: ``"paper"`` or ``"cpu"``.
    budget: the budget's settings (:func:`get_budget`).
    machine: where it ran (``experiments._machine.machine_description()``).
    columns: the compared quantities; the table gets a "paper" and an "ours" column for each.
    rows: ``(label, paper values, our values)``, one value per column (None: not available).
    logs: row label -> relative link of that row's per-epoch log.
    notes: further bullet points (what differs from the paper, caveats).
    date: defaults to now (UTC).

  Returns:
    The page as Markdown.

  Raises:
    ValueError: a row does not have one paper and one measured value per column.
  """
  for label, paper, ours in rows:
    if len(paper) != len(columns) or len(ours) != len(columns):
      raise ValueError(
        f"rows: {label!r} has {len(paper)} paper / {len(ours)} measured values for "
        f"{len(columns)} columns"
      )
  head = ["row"]
  for column in columns:
    head += [f"{column} (paper)", f"{column} (ours)"]
  if logs:
    head.append("per-epoch log")
  lines = [
    f"# {title}",
    "",
    f"- Command: `{command}`",
    f"- Budget: `{budget_name}` ({describe_budget(budget)}); every row uses it. "
    + ", ".join(f"{k}={dict(v) if isinstance(v, Mapping) else v}" for k, v in budget.items()),
    f"- Date: {date or utc_now()}",
    f"- Machine: {machine}",
    *(f"- {note}" for note in notes),
    "",
    "| " + " | ".join(head) + " |",
    "|---|" + "---:|" * (len(head) - 1),
  ]
  for label, paper, ours in rows:
    cells = [label]
    for p, o in zip(paper, ours):
      cells += [_cell(p), _cell(o)]
    if logs:
      cells.append(f"[{Path(logs[label]).name}]({logs[label]})" if label in logs else "—")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
