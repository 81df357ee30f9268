"""The `fit` budget's width sweep: does pruning cost less where the network has more to spare?

One model, ClickTrain's VGG-11, at several widths of the `fit` budget: dense, ClickTrain's
fine-grained mode, its aligned mode at G = 8 and PruneTrain (ClickTrain Table 1's PruneTrain
row), each method's accuracy change against the dense run of the same width, with its
compression (conv weights) and inference FLOPs. The runs are the table commands' own: the
budget's width is the tables' rows, other widths their ``--width`` runs:

    python -m experiments.run clicktrain_table1 --budget fit --rows vgg11 [--width 0.25] --publish
    python -m experiments.run clicktrain_table1 --budget fit --rows vgg11 --methods clicktrain \\
        --filter-groups 8 [--width 0.25] --publish
    python -m experiments.run prunetrain_table1 --budget fit --family clicktrain --rows vgg11 \\
        [--width 0.25] --publish
    python -m experiments.run fit_width --publish      # this page and its figure

Writes ``fit_width.md`` and ``fit_width.png`` to ``experiments/results/`` from the runs published
in its ``clicktrain/`` and ``prunetrain/`` folders (without ``--publish``: ``runs/``, from the
scratch runs there; ``--out`` puts the page elsewhere).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from experiments.common import budgets, cli, pages

ROW = "vgg11"
MODEL = f"clicktrain-{ROW}"
# The sweep's methods, as the page and the figure label them.
METHODS = ("ClickTrain fine-grained", "ClickTrain aligned G=8", "PruneTrain")


def _clicktrain_stem(width: float | None, method: str) -> str:
  tag = "fit" if width is None else f"fit_w{width:g}"
  return f"clicktrain/table1_{tag}_{ROW}_{method}.json"


def _prunetrain_stem(width: float | None) -> str:
  if width is None:
    return f"prunetrain/table1_fit_{MODEL}.json"
  return f"prunetrain/probes/table1_fit_{MODEL}_w{width:g}.json"


def _load(path: Path) -> dict[str, Any] | None:
  return json.loads(path.read_text()) if path.exists() else None


def sweep(folder: Path, widths: Sequence[float]) -> list[dict[str, Any]]:
  """One entry per width of ``widths`` that has a dense run in ``folder`` (a results folder):
  the width, the dense run's accuracy and fit figures, and per method of :data:`METHODS` that
  ran there its accuracy, Δ against dense (points), compression and inference FLOPs ratio."""
  fit_width = budgets.row_width(budgets.get_budget("clicktrain_table1", "fit").width, MODEL)
  out = []
  for width in widths:
    key = None if width == fit_width else width
    dense = _load(folder / _clicktrain_stem(key, "dense"))
    pt_row = _load(folder / _prunetrain_stem(key))
    if dense is None and pt_row is not None:
      dense = pt_row["runs"].get("dense")
    if dense is None:
      continue
    runs = {
      METHODS[0]: _load(folder / _clicktrain_stem(key, "clicktrain")),
      METHODS[1]: _load(folder / _clicktrain_stem(key, "aligned-g8")),
      METHODS[2]: pt_row["runs"].get("prunetrain") if pt_row else None,
    }
    entry = {"width": width, "dense": dense, "methods": {}}
    for label, run in runs.items():
      if run is None:
        continue
      entry["methods"][label] = {
        "test_acc": run["test_acc"],
        "delta": 100 * (run["test_acc"] - dense["test_acc"]),
        # ClickTrain: conv weights; PruneTrain: the final model's inference FLOPs and params
        "compression": run.get("compression") or 1 / run["params_ratio"],
        "train_acc": run.get("train_acc"),
      }
    out.append(entry)
  return out


def _figure(entries: list[dict[str, Any]], path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 3.2))
  for label in METHODS:
    points = [(e["width"], e["methods"][label]["delta"]) for e in entries if label in e["methods"]]
    if points:
      ax.plot(*zip(*points), marker="o", label=label)
  ax.axhline(0, color="grey", lw=0.8)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("width multiplier of ClickTrain's VGG-11")
  ax.set_ylabel("Δ test accuracy vs dense (points)")
  ax.set_title("fit budget: the cost of pruning against width", fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def page(entries: list[dict[str, Any]], command: str, figure: str | None) -> str:
  """The sweep's page: per width the dense run and each method's Δ, compression and fit."""
  lines = [
    "# The `fit` budget's width sweep: ClickTrain's VGG-11",
    "",
    f"- Command: `{command}` (from the runs of the commands in its module docstring)",
    (
      f"- Budget: `fit` ({budgets.describe_budget(budgets.get_budget('clicktrain_table1', 'fit'))}"
      "), every run at the width in its row; the methods keep their papers' hyper-parameters."
    ),
    f"- Date: {pages.utc_now()}",
    "",
    (
      "| width | dense test acc (%) | dense train acc (%) | method | test acc (%) | Δ (points) | "
      "compression | train acc (%) |"
    ),
    "|---:|---:|---:|---|---:|---:|---:|---:|",
  ]
  for e in entries:
    dense = e["dense"]
    dense_train = "—" if dense.get("train_acc") is None else f"{100 * dense['train_acc']:.2f}"
    head = f"| ×{e['width']:g} | {100 * dense['test_acc']:.2f} | {dense_train} |"
    if not e["methods"]:
      lines.append(f"{head} — | — | — | — | — |")
    for label, m in e["methods"].items():
      train_acc = "—" if m["train_acc"] is None else f"{100 * m['train_acc']:.2f}"
      lines.append(
        f"{head} {label} | {100 * m['test_acc']:.2f} | {m['delta']:+.2f} | "
        f"{m['compression']:.2f}x | {train_acc} |"
      )
  if figure:
    lines += ["", f"![Δ accuracy against width]({figure})"]
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(prog="fit_width", description=__doc__.splitlines()[0])
  parser.add_argument(
    "--widths", default="0.25,0.5,1", help="comma list of the widths to gather (default 0.25,0.5,1)"
  )
  cli.add_output_arguments(parser, "")
  args = parser.parse_args(argv)
  widths = [float(w) for w in args.widths.split(",") if w]
  # The runs are gathered where the table commands wrote them: published, or the scratch runs/.
  results = pages.RESULTS if args.publish else pages.SCRATCH
  folder = pages.output_dir(None, args.publish, args.out)
  entries = sweep(results, widths)
  figure = None
  if any(e["methods"] for e in entries):
    _figure(entries, folder / "fit_width.png")
    figure = "fit_width.png"
  text = page(entries, cli.command_line("fit_width", argv), figure)
  (folder / "fit_width.md").write_text(text)
  return {"entries": entries, "page": str(folder / "fit_width.md")}
