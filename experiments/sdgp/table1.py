"""SDGP Table I: sdgp-resnet9 on CIFAR-10, dense vs random / magnitude / rescaled / MVUE 2:4.

Recipe (the ffcv ResNet-9 recipe SDGP ran): batch 512, 150 epochs, SGD momentum 0.9,
triangular lr peaking at 0.5 at epoch 2, weight decay 5e-4 on all params, label smoothing
0.1, flip + translate(2) + cutout(4), flip test-time augmentation. Every conv with more than
3 input channels gets SDGP (the registered ``sdgp`` method: ``jaxprune.sdgp.convert_model``);
the stem and the head stay.

``--budget paper`` is that recipe; ``--budget cpu`` (the default) the reduced one every row
shares (``experiments/common/budgets.py``): ResNet-9 at 1/8 width (convs 16, 32, [32, 32], 64,
[64, 64], 32) on the full training set, 10 epochs at batch 128 with the peak lr scaled
linearly (0.5 · 128/512) and the peak at the recipe's fraction of training (2/150) but no
earlier than epoch 0.5. Every row uses the same budget and seed, so the rows compare; the test
accuracy (flip TTA) is logged after every epoch, which Fig. 10's time-to-accuracy reads.

    python -m experiments.run sdgp_table1 --budget cpu [--rows dense,magnitude,...] [--publish]

Writes ``table1_<budget>.{md,json}`` and per-row epoch logs (``logs/``) to ``runs/sdgp/``, or to
``experiments/results/sdgp/`` with ``--publish``. Rows run separately (``--rows dense``, then
``--rows random``, ...) share the page: the rows already in the folder's JSON for the same
budget are kept (each with its own command and date), a row run again replaces its old result.
``--dtype bf16`` trains in bfloat16 (parameters float32) and writes ``table1_<budget>_bf16.*``,
apart from the fp32 page.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from experiments.common import budgets, cli, pages, rows, run_options
from jaxprune import data, methods, models, sdgp, train

# SDGP Table I, CIFAR-10 ResNet-9 top-1 (%); MVUE is not in the paper.
PAPER_TABLE1 = {"dense": 95.3, "random": 94.5, "magnitude": 95.2, "rescaled_magnitude": 95.2}
ROWS = ("dense", "random", "magnitude", "rescaled_magnitude", "mvue")
MODEL = "sdgp-resnet9"


def add_budget_arguments(parser: argparse.ArgumentParser, table: str) -> None:
  """Arguments shared by the SDGP training experiments (Table I, Fig. 8)."""
  cli.add_table_arguments(parser, table)
  cli.add_dtype_argument(parser)
  parser.add_argument(
    "--backend",
    choices=sdgp.BACKENDS,
    default="auto",
    help="N:M pruning of the data gradient: the Pallas kernel, the pure-JAX reference, or auto "
    "(the one measured faster on the device)",
  )
  parser.add_argument("--progress", action="store_true", help="show a progress bar per epoch")
  run_options.add_arguments(parser)


def load_data(args: argparse.Namespace, budget: Mapping[str, Any]):
  """The training and test sets of ``budget`` (subsets drawn with ``args.seed``)."""
  train_set = data.load("cifar10", root=args.root, split="train").balanced_subset(
    budget["train_subset"], args.seed
  )
  test_set = data.load("cifar10", root=args.root, split="test").balanced_subset(
    budget["test_subset"], args.seed
  )
  return train_set, test_set


class _EpochPrinter(train.Callback):
  """Prints each epoch's train loss (long CPU runs in the background stay observable)."""

  def __init__(self, label: str):
    self.label = label

  def after_epoch(self, trainer: train.Trainer, record: dict[str, Any]) -> None:
    print(
      f"  {self.label} epoch {record['epoch']}: train loss {record['train_loss']:.4f} "
      f"({record['wall_time_s']:.0f} s)",
      flush=True,
    )


def row_method(
  method: str, n: int, m: int, budget: Mapping[str, Any], seed: int, backend: str
) -> methods.Method:
  """The method of one row under ``budget["init"]``: ``"released"`` is the authors' recipe
  (:func:`jaxprune.sdgp.paper_method`: every converted conv re-initialised, the dense row a
  4:4 conversion), ``"model"`` the library default (kernels kept, dense row unconverted)."""
  init = budget.get("init", "model")
  if init == "released":
    return sdgp.paper_method(method, dataset="cifar10", n=n, m=m, seed=seed, backend=backend)
  if init != "model":
    raise ValueError(f"budget['init'] must be 'released' or 'model', got {init!r}")
  if method == "dense":
    return methods.get("dense")
  return methods.get("sdgp", n=n, m=m, method=method, seed=seed, backend=backend)


def train_row(
  method: str,
  n: int,
  m: int,
  budget: Mapping[str, Any],
  train_set,
  test_set,
  args: argparse.Namespace,
  log_path: Path | None = None,
) -> dict[str, Any] | None:
  """Trains one row (``method="dense"`` = no SDGP) and returns its result record, with the
  per-epoch history (test accuracy after every epoch, or every ``--eval-every``); ``log_path``
  gets it as JSON lines. The model computes in ``args.dtype``
  (:func:`experiments.cli.compute_dtype`). ``None``: the row stopped at ``--max-seconds``
  (SDGP's rows keep no checkpoint, so a stopped row is lost)."""
  label = method if method == "dense" else f"{method} {n}:{m}"
  spec = rows.RowSpec(
    label=label,
    model=lambda: models.create(
      MODEL,
      num_classes=train_set.num_classes,
      rngs=nnx.Rngs(args.seed),
      width_multiplier=budget["width"],
      dtype=cli.compute_dtype(args),
    ),
    method=row_method(method, n, m, budget, args.seed, args.backend),
    optimizer=lambda steps: train.sgd(
      train.triangular_schedule(budget["peak_lr"], steps, budget["peak_epoch"], budget["epochs"]),
      momentum=0.9,
      weight_decay=5e-4,
    ),
    train_set=train_set,
    test_set=test_set,
    batch_size=budget["batch_size"],
    augment="sdgp",
    epochs=budget["epochs"],
    seed=args.seed,
    result=lambda row: _record(method, n, m, row.trainer.history),
    callbacks=lambda test_loader, run: [_EpochPrinter(label)],
    trainer_options={"label_smoothing": 0.1, "flip_tta": True, "progress": bool(args.progress)},
    log_path=log_path,
  )
  return rows.run_row(spec, args.options)


def _record(method: str, n: int, m: int, history: list[dict[str, Any]]) -> dict[str, Any]:
  """A finished row's record: its accuracy, loss and training time, and the per-epoch
  history's figures."""
  return {
    "method": method,
    "n": n,
    "m": m,
    "test_acc": history[-1]["test_acc"],
    "final_train_loss": history[-1]["train_loss"],
    "train_time_s": sum(r["epoch_time_s"] for r in history),
    "history": [
      {
        k: r[k]
        for k in ("epoch", "train_loss", "test_acc", "epoch_time_s", "steps", "eval_time_s")
        if k in r
      }
      for r in history
    ],
  }


def train_logged(
  folder: Path,
  stem: str,
  method: str,
  n: int,
  m: int,
  budget: Mapping[str, Any],
  data: tuple[Any, Any],
  args: argparse.Namespace,
  command: str,
) -> dict[str, Any] | None:
  """:func:`train_row` with its per-epoch log at ``folder/``:func:`log_name`; the record names
  its log and ``command``, and its accuracy and seconds are printed. ``None``: stopped at
  ``--max-seconds``."""
  start = time.perf_counter()
  log = log_name(stem, method, n, m)
  (folder / log).parent.mkdir(parents=True, exist_ok=True)
  record = train_row(method, n, m, budget, *data, args, folder / log)
  if record is not None:
    record["log"], record["command"] = log, command
    seconds = time.perf_counter() - start
    print(
      f"{method} {n}:{m}: test acc {100 * record['test_acc']:.2f}% ({seconds:.0f} s)", flush=True
    )
  return record


def log_name(stem: str, method: str, n: int, m: int) -> str:
  """The per-epoch log of one row or cell, relative to the page's folder:
  ``logs/<stem>_<model>_<method>[_<n>-<m>].jsonl`` (every row trains :data:`MODEL`)."""
  label = method if method == "dense" else f"{method}_{n}-{m}"
  return f"logs/{stem}_{MODEL.removeprefix('sdgp-')}_{label}.jsonl"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="sdgp_table1", description=__doc__.splitlines()[0])
  add_budget_arguments(parser, "sdgp_table1")
  parser.add_argument(
    "--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}"
  )
  parser.add_argument("--name", default=None, help="result file stem")
  args = parser.parse_args(argv)
  chosen = [r for r in args.rows.split(",") if r]
  unknown = sorted(set(chosen) - set(ROWS))
  if unknown:
    parser.error(f"--rows: unknown {unknown}; choose from {ROWS}")
  args.rows = chosen
  return run_options.table_args(args, "sdgp_table1")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  budget = args.recipe
  name = args.name or f"table1_{args.budget}{cli.dtype_suffix(args)}"
  command = cli.command_line("sdgp_table1", argv)
  folder = pages.output_dir("sdgp", args.publish, args.out)
  train_set, test_set = load_data(args, budget)
  # Warn once, before training, if the page holds rows of other budget settings.
  results = saved_rows(folder / name, args.budget, budget, exclude=args.rows, dtype=args.dtype)
  trained: list[dict[str, Any]] = []
  for method in args.rows:
    record = train_logged(folder, name, method, 2, 4, budget, (train_set, test_set), args, command)
    if record is None:  # stopped at --max-seconds: the command ends here
      return {"budget": budget, "rows": results, "stopped": method}
    trained.append(record)
    # Read the page again before writing: another invocation (``--rows random`` beside
    # ``--rows magnitude``) may have added its row since this one started.
    others = saved_rows(
      folder / name,
      args.budget,
      budget,
      exclude=[r["method"] for r in trained],
      warn=False,
      dtype=args.dtype,
    )
    results = sorted([*others, *trained], key=lambda r: ROWS.index(r["method"]))
    # The rows of one page may come from several invocations: the page names each command.
    _write(
      folder / name,
      pages.joined_commands(results),
      args.budget,
      budget,
      results,
      len(ROWS),
      dtype=args.dtype,
    )
  return {"budget": budget, "rows": results}


def merge_rows(stem: Path, returned: dict[str, Any]) -> Path:
  """Merges the rows of a page JSON written elsewhere (``returned``, e.g. trained on an
  accelerator) into ``stem.json`` and rewrites the page; a returned row replaces a saved row
  of the same method. Returns the page.

  Raises:
    ValueError: ``returned`` was written under another budget or dtype than ``stem.json``.
  """
  budget_name, budget = returned["budget_name"], returned["budget"]
  dtype = returned.get("dtype", "fp32")
  returned_rows = returned["rows"]
  saved, same = pages.saved_result(stem, budget)
  if saved is not None and not (same and saved.get("dtype", "fp32") == dtype):
    raise ValueError(f"returned: {stem}.json holds rows of another budget or dtype; not merged")
  exclude = [r["method"] for r in returned_rows]
  others = saved_rows(stem, budget_name, budget, exclude=exclude, dtype=dtype)
  results = sorted([*others, *returned_rows], key=lambda r: ROWS.index(r["method"]))
  date = max((r["date"] for r in results if "date" in r), default=None)
  _write(
    stem,
    pages.joined_commands(results),
    budget_name,
    budget,
    results,
    len(ROWS),
    date=date,
    dtype=dtype,
  )
  return stem.with_suffix(".md")


def saved_rows(
  stem: Path,
  budget_name: str,
  budget: Mapping[str, Any],
  exclude: Sequence[str] = (),
  *,
  warn: bool = True,
  dtype: str = "fp32",
) -> list[dict[str, Any]]:
  """The rows already written to ``stem.json`` under the same budget and ``dtype``, but those
  in ``exclude`` (to be run again). A JSON written under other settings of the budget or
  another dtype is not mixed in: its rows would not compare (the call warns, unless ``warn``
  is false, and starts the page afresh)."""
  saved, same_budget = pages.saved_result(stem, budget)
  if saved is None:
    return []
  # A page written before --dtype existed holds fp32 rows.
  same_dtype = saved.get("dtype", "fp32") == dtype
  if not (same_budget and same_dtype and saved.get("budget_name") == budget_name):
    if warn:
      warnings.warn(
        f"{stem}.json: written under other budget settings or dtype; its rows are replaced, "
        "not gathered",
        RuntimeWarning,
        stacklevel=2,
      )
    return []
  return [r for r in saved.get("rows", []) if r.get("method") not in exclude]


def accuracy_standard_error(results: list[dict[str, Any]], test_images: int) -> float:
  """Binomial standard error of a test accuracy near the rows' mean (in %)."""
  p = float(np.mean([r["test_acc"] for r in results]))
  return 100 * float(np.sqrt(p * (1 - p) / test_images))


LABELS = {
  "dense": "Dense",
  "random": "Rnd. 2:4",
  "magnitude": "Mag. 2:4",
  "rescaled_magnitude": "Res. Mag. 2:4",
  "mvue": "MVUE 2:4 (not in paper)",
}


def _write(
  stem: Path,
  command: str,
  budget_name: str,
  budget: Mapping[str, Any],
  results: list[dict[str, Any]],
  planned: int,
  date: str | None = None,
  dtype: str = "fp32",
) -> None:
  date = date or pages.utc_now()
  stem.with_suffix(".json").write_text(
    json.dumps(
      {
        "command": command,
        "date": date,
        "budget_name": budget_name,
        "budget": budgets.as_saved(budget),
        **cli.dtype_config(dtype),
        "rows": results,
      },
      indent=1,
    )
  )
  test_images = budget["test_subset"] or 10_000
  page = pages.results_page(
    "SDGP Table I — CIFAR-10, sdgp-resnet9, 2:4 data-gradient pruning",
    command=command,
    budget_name=budget_name,
    budget=budget,
    machine=run_options.page_provenance(results)["machine"],
    date=date,
    columns=["top-1 test acc (%)", "final train loss", "train time (min)"],
    rows=[
      (
        LABELS.get(r["method"], r["method"]),
        [PAPER_TABLE1.get(r["method"]), None, None],
        [
          f"{100 * r['test_acc']:.2f}",
          f"{r['final_train_loss']:.4f}",
          f"{r['train_time_s'] / 60:.1f}",
        ],
      )
      for r in results
    ],
    logs={LABELS.get(r["method"], r["method"]): r["log"] for r in results if "log" in r},
    notes=[
      f"Status: {len(results)} of {planned} rows done",
      (
        "Recipe: triangular lr (peak "
        f"{budget['peak_lr']:g} at epoch {budget['peak_epoch']:g}), SGD momentum 0.9, wd 5e-4, "
        "label smoothing 0.1, flip + translate(2) + cutout(4), flip TTA; same seed for every row."
      ),
      (
        "Data: the re-encoded JPEG CIFAR-10 (quality ≈75); test accuracy (flip TTA) after the "
        f"last epoch on {test_images:,} test images."
      ),
      "Paper: 150 epochs at full width (ResNet-9, 9.09 M params) on A100s; MVUE is not in it.",
      (
        "Noise: one seed; the binomial standard error of each accuracy is ≈"
        f"{accuracy_standard_error(results, test_images):.1f} points. Train times follow the "
        "shared machine's load, not the method."
      ),
      *cli.dtype_notes(dtype),
    ],
  )
  fit = pages.fit_section([(LABELS.get(r["method"], r["method"]), r) for r in results])
  stem.with_suffix(".md").write_text("\n".join([page, *fit]))


if __name__ == "__main__":
  main()
