"""Where results go and the results page.

Runs write to ``runs/<paper>/`` (git-ignored) unless ``--publish`` is given, which writes to
``experiments/results/<paper>/``, the pages the repository links. Names follow one scheme:
pages ``<table>_<budget>[_<row>].md`` (JSON beside them), per-epoch logs
``logs/<table>_<budget>_<row>_<method>.jsonl``, and runs that are not rows of a table (probes)
under ``probes/`` (:func:`probes_dir`). A run with ``--dtype`` other than fp32
(:func:`experiments.common.cli.add_dtype_argument`) marks its budget:
``table1_cpu_bf16_vgg11_dense.json``.

    out = output_dir("sdgp", publish=args.publish, out=args.out)
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from experiments.common import budgets

EXPERIMENTS = Path(__file__).resolve().parent.parent


RESULTS = EXPERIMENTS / "results"


SCRATCH = EXPERIMENTS.parent / "runs"


def output_dir(
  paper: str | None, publish: bool = False, out: str | os.PathLike | None = None
) -> Path:
  """The folder a run writes its page, JSON and logs to (created).

  Args:
    paper: one of :data:`budgets.PAPERS`, or None for the top of the folder (the quickstart's page).
    publish: write to ``experiments/results/<paper>/`` instead of the scratch ``runs/<paper>/``.
    out: an explicit folder, overriding both.

  Returns:
    The folder, created if missing.

  Raises:
    ValueError: ``paper`` is not one of :data:`budgets.PAPERS`.
  """
  if paper is not None and paper not in budgets.PAPERS:
    raise ValueError(f"paper: unknown {paper!r}; choose from {budgets.PAPERS}")
  base = RESULTS if publish else SCRATCH
  folder = Path(out) if out is not None else base / (paper or "")
  folder.mkdir(parents=True, exist_ok=True)
  return folder


def shared_dir(publish: bool = False, out: str | os.PathLike | None = None) -> Path:
  """Where the runs several tables share are saved (:class:`experiments.common.rows.SharedRun`):
  ``experiments/results/shared/`` with ``publish``, ``runs/shared/`` without, ``<out>/shared/``
  for a command with ``--out``. Not created here (the first run saved creates it)."""
  if out is not None:
    return Path(out) / "shared"
  return (RESULTS if publish else SCRATCH) / "shared"


def probes_dir(folder: str | os.PathLike) -> Path:
  """``<folder>/probes/`` (created): where a run that is not a row of its table writes (a probe,
  a measurement beside the table), so that a paper's folder holds its tables' pages only."""
  probes = Path(folder) / "probes"
  probes.mkdir(parents=True, exist_ok=True)
  return probes


def write_result(stem: Path, result: Mapping[str, Any], page: str) -> None:
  """A benchmark's saved record: ``<stem>.json`` (the result) and ``<stem>.md`` (its page),
  rewritten whole each time (benchmarks save after every row, so a cut-short run keeps its
  rows)."""
  stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
  stem.with_suffix(".md").write_text(page)


def utc_now() -> str:
  """The date and time a page states, in UTC."""
  return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")


def saved_result(stem: Path, budget: Mapping[str, Any]) -> tuple[dict[str, Any] | None, bool]:
  """What an earlier run wrote to ``stem.json`` (``None`` when nothing) and whether it ran under
  ``budget`` (compared with :func:`budgets.as_saved`)."""
  path = Path(stem).with_suffix(".json")
  if not path.exists():
    return None, False
  saved = json.loads(path.read_text())
  return saved, saved.get("budget") == budgets.as_saved(budget)


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
    machine: where it ran (``experiments.common.machine.machine_description()``).
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
    f"- Budget: `{budget_name}` ({budgets.describe_budget(budget)}); every row uses it. "
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


# When a dense run fits its data (the `fit` budget's test, budgets.py): it classifies at least
# this share of its training images, and its test accuracy rises by at most this much over the
# run's last quarter.
FIT_TRAIN_ACC = 0.97
FIT_PLATEAU_GAIN = 0.005


def fits(run: Mapping[str, Any]) -> bool | None:
  """Whether ``run`` (a row's record) fit its data (:data:`FIT_TRAIN_ACC`,
  :data:`FIT_PLATEAU_GAIN`); None for a run saved without the figures."""
  train_acc, gain = run.get("train_acc"), run.get("test_gain_last_quarter")
  if train_acc is None or gain is None:
    return None
  return train_acc >= FIT_TRAIN_ACC and gain <= FIT_PLATEAU_GAIN


def fit_section(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
  """The lines of a page's "does each run fit its data" table: for each ``(label, record)``,
  the accuracy on its own training images (eval mode) and the test accuracy's gain over the
  last quarter of the run, against the `fit` budget's test. Empty when no run has the figures
  (runs saved before they were recorded)."""
  shown = [(label, run) for label, run in runs if "train_acc" in run]
  if not shown:
    return []

  def cell(value: float | None, sign: str = "") -> str:
    return "—" if value is None else f"{100 * value:{sign}.2f}"

  lines = [
    "## Does each run fit its data",
    "",
    (
      f"A run fits when it classifies at least {100 * FIT_TRAIN_ACC:.0f}% of the training "
      "images it trained on (eval mode: running BatchNorm statistics, no dropout, no training "
      f"augmentation) and its test accuracy rises by at most {100 * FIT_PLATEAU_GAIN:.1f} "
      "points over the last quarter of its epochs, the final LR's phase, from the quarter's "
      "first evaluation to its last (a plateau, not a run cut short)."
    ),
    "",
    "| run | train acc (%) | test gain, last quarter (points) | fits |",
    "|---|---:|---:|---|",
  ]
  for label, run in shown:
    verdict = {True: "yes", False: "no", None: "—"}[fits(run)]
    gain = cell(run.get("test_gain_last_quarter"), "+")
    lines.append(f"| {label} | {cell(run['train_acc'])} | {gain} | {verdict} |")
  return [*lines, ""]
