"""SDGP Fig. 8: sdgp-resnet9 CIFAR-10 accuracy over n:m settings (rescaled magnitude).

Same recipe and ``--budget`` presets as ``sdgp_table1`` (every cell trains with the same
budget and seed; a dense row is trained too for reference). Cells are laid out as in the
paper's figure: rows = sparsity ratio m/n, columns = group size m. The paper gives Fig. 8 as
a picture only (no numbers in its text); the page states its trend beside ours.

    python -m experiments.run sdgp_fig8 --budget cpu [--settings 2:4,4:8,...] [--resume] [--publish]

Writes ``fig8_<budget>.{md,json}`` and per-cell epoch logs (``logs/``) to ``runs/sdgp/``, or to
``experiments/results/sdgp/`` with ``--publish``; ``sdgp_timemodel`` reads the JSON for the
time-to-accuracy of Fig. 10.

``--resume`` keeps the cells already in the result file (when it was written with the same
budget and method) and trains only the missing ones, so a long sweep can run in parts.

Two cells are Table I rows: the dense reference and the 2:4 cell of the Table I methods. When
``table1_<budget>.json`` in the same folder was written under the same budget, those rows are
taken from it instead of being trained again (same budget, seed and code: the same run; the
page says which cells came from Table I); ``--no-table1`` trains them here.

``--dtype bf16`` trains in bfloat16 (parameters float32), writes ``fig8_<budget>_bf16.*`` and
takes cells from ``table1_<budget>_bf16.json`` only: results of one dtype never mix with or
replace the other's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.common import budgets, cli, pages, run_options
from experiments.common.machine import machine_description
from experiments.sdgp import table1 as sdgp_table1
from jaxprune import sdgp

SWEEP = (
  (1, 4),
  (2, 4),
  (1, 8),
  (2, 8),
  (4, 8),
  (2, 16),
  (4, 16),
  (8, 16),
  (4, 32),
  (8, 32),
  (16, 32),
)


def _parse_settings(text: str) -> list[tuple[int, int]]:
  settings = []
  for item in text.split(","):
    if not item:
      continue
    try:
      n, m = (int(v) for v in item.split(":"))
    except ValueError:
      raise ValueError(f"--settings: expected n:m pairs, got {item!r}") from None
    if not 1 <= n <= m <= sdgp.MAX_GROUP:
      raise ValueError(f"--settings: need 1 <= n <= m <= {sdgp.MAX_GROUP}, got {item!r}")
    settings.append((n, m))
  return settings


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="sdgp_fig8", description=__doc__.splitlines()[0])
  sdgp_table1.add_budget_arguments(parser, "sdgp_fig8")
  parser.add_argument(
    "--settings",
    default=",".join(f"{n}:{m}" for n, m in SWEEP),
    help="comma list of the n:m settings to train (default: the paper's Fig. 8 sweep)",
  )
  parser.add_argument(
    "--method",
    choices=sdgp.METHODS,
    default="rescaled_magnitude",
    help="how the n of every m data-gradient entries are kept (the paper's Fig. 8: rescaled)",
  )
  parser.add_argument("--no-dense", action="store_true", help="skip the dense reference row")
  parser.add_argument("--name", default=None, help="result file stem")
  parser.add_argument(
    "--no-table1",
    action="store_true",
    help="train the dense and 2:4 cells here instead of taking Table I's rows",
  )
  parser.add_argument(
    "--resume",
    action="store_true",
    help="keep the cells already in the result file, train only the rest",
  )
  args = parser.parse_args(argv)
  try:
    args.settings = _parse_settings(args.settings)
  except ValueError as error:
    parser.error(str(error))
  return run_options.table_args(args, "sdgp_fig8")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  budget = args.recipe
  suffix = cli.dtype_suffix(args)
  name = args.name or f"fig8_{args.budget}{suffix}"
  command = cli.command_line("sdgp_fig8", argv)
  folder = pages.output_dir("sdgp", args.publish, args.out)
  train_set, test_set = sdgp_table1.load_data(args, budget)
  cells = [("dense", 1, 1)] if not args.no_dense else []
  cells += [(args.method, n, m) for n, m in args.settings]
  results = _previous_cells(folder / name, budget, args.method, args.dtype) if args.resume else []
  done = {(r["method"], r["n"], r["m"]) for r in results}
  if not args.no_table1:
    for cell in table1_cells(folder / f"table1_{args.budget}{suffix}", budget, cells, args.dtype):
      if (cell["method"], cell["n"], cell["m"]) not in done:
        results.append(cell)
        done.add((cell["method"], cell["n"], cell["m"]))
  planned = len(done | set(cells))
  for method, n, m in cells:
    if (method, n, m) in done:
      continue
    data = (train_set, test_set)
    record = sdgp_table1.train_logged(folder, name, method, n, m, budget, data, args, command)
    if record is None:  # stopped at --max-seconds: the command ends here
      return {"budget": budget, "cells": results, "stopped": f"{method} {n}:{m}"}
    results.append(record)
    _write(
      folder / name,
      pages.joined_commands(results),
      args.budget,
      budget,
      args.method,
      results,
      planned,
      args.dtype,
    )
  return {"budget": budget, "cells": results}


def table1_cells(
  table1_stem: Path,
  budget: Mapping[str, Any],
  cells: Sequence[tuple[str, int, int]],
  dtype: str = "fp32",
) -> list[dict[str, Any]]:
  """The cells of ``cells`` that Table I's result file (``table1_stem.json``) already holds,
  trained under the same ``budget`` and ``dtype``: its dense row as the dense reference, its
  2:4 rows as the 2:4 cell of their method. Each is marked ``"from": "table1"``; none when the
  file is missing or was written under another budget or dtype."""
  table1, same_budget = pages.saved_result(table1_stem, budget)
  # A file written before --dtype existed holds fp32 rows.
  if not same_budget or table1.get("dtype", "fp32") != dtype:
    return []
  found = []
  for row in table1.get("rows", []):
    key = ("dense", 1, 1) if row["method"] == "dense" else (row["method"], row["n"], row["m"])
    if key in cells:
      cell = {**row, "n": key[1], "m": key[2], "from": "table1"}
      cell.setdefault("command", table1.get("command", ""))
      found.append(cell)
  return found


def _previous_cells(
  stem: Path, budget: Mapping[str, Any], method: str, dtype: str = "fp32"
) -> list[dict[str, Any]]:
  """Cells of an earlier run with the same budget, dtype and method (``--resume``), else none.

  Raises:
    ValueError: ``stem.json`` was written under another budget or dtype.
  """
  previous, same_budget = pages.saved_result(stem, budget)
  if previous is None:
    return []
  if not same_budget:
    raise ValueError(
      f"--resume: {stem.name}.json was written with budget {previous.get('budget')}, not {budget}"
    )
  if previous.get("dtype", "fp32") != dtype:
    raise ValueError(
      f"--resume: {stem.name}.json was written at dtype {previous.get('dtype', 'fp32')}, "
      f"not {dtype}"
    )
  cells = [c for c in previous["cells"] if c["method"] in ("dense", method)]
  for cell in cells:
    # Runs before --resume existed record the command once, at the top of the file.
    cell.setdefault("command", previous["command"])
  return cells


def _write(
  stem: Path,
  command: str,
  budget_name: str,
  budget: Mapping[str, Any],
  method: str,
  results: list[dict[str, Any]],
  planned: int,
  dtype: str = "fp32",
) -> None:
  date = pages.utc_now()
  saved = {
    "command": command,
    "date": date,
    "budget": budgets.as_saved(budget),
    **cli.dtype_config(dtype),
  }
  stem.with_suffix(".json").write_text(json.dumps({**saved, "cells": results}, indent=1))
  sparse = {(r["n"], r["m"]): r for r in results if r["method"] != "dense"}
  dense = [r for r in results if r["method"] == "dense"]
  group_sizes = sorted({m for _, m in sparse} | {m for _, m in SWEEP})
  ratios = sorted({m // n for n, m in sparse} | {m // n for n, m in SWEEP})
  lines = [
    f"# SDGP Fig. 8 — CIFAR-10 sdgp-resnet9 accuracy by n:m ({method})",
    "",
    f"- Status: {len(results)} of {planned} runs done",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()}",
    (
      f"- Budget: `{budget_name}` ({budgets.describe_budget(budget)}), peak lr "
      f"{budget['peak_lr']:g} at epoch {budget['peak_epoch']:g}; test accuracy with flip TTA; "
      "recipe otherwise as the paper's (see `sdgp_table1`); every cell uses it."
    ),
    (
      "- Paper Fig. 8 (a picture; its text gives no numbers) reports these cells at 150 epochs "
      "and full width. Its trend, to compare ours with: accuracy falls as m/n grows and, at a "
      "fixed ratio, rises with group size m."
    ),
    *(f"- {note}" for note in cli.dtype_notes(dtype)),
  ]
  if dense:
    lines.append(f"- Dense reference (same budget): {100 * dense[0]['test_acc']:.2f}%")
  reused = [r for r in results if r.get("from") == "table1"]
  if reused:
    names = ", ".join("dense" if r["method"] == "dense" else f"{r['n']}:{r['m']}" for r in reused)
    lines.append(
      f"- Taken from Table I (same budget, seed and code, so the same run): {names}; "
      "`--no-table1` trains them here."
    )
  lines += [
    "",
    "| m/n \\ m | " + " | ".join(f"m={m}" for m in group_sizes) + " |",
    "|---|" + "---:|" * len(group_sizes),
  ]
  for ratio in ratios:
    cells = []
    for m in group_sizes:
      n = m // ratio
      if m % ratio or n < 1:
        cells.append("N/A")
      elif (n, m) in sparse:
        cells.append(f"{100 * sparse[(n, m)]['test_acc']:.2f}%")
      else:
        cells.append("not run")
    lines.append(f"| {ratio} | " + " | ".join(cells) + " |")
  logs = [f"[{r['method']} {r['n']}:{r['m']}]({r['log']})" for r in results if "log" in r]
  if logs:
    lines += ["", "Per-epoch logs: " + ", ".join(logs)]
  stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
