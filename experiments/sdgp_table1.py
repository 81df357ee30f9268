"""SDGP Table I: sdgp-resnet9 on CIFAR-10, dense vs random / magnitude / rescaled / MVUE 2:4.

Recipe (the ffcv ResNet-9 recipe SDGP ran): batch 512, 150 epochs, SGD momentum 0.9,
triangular lr peaking at 0.5 at epoch 2, weight decay 5e-4 on all params, label smoothing
0.1, flip + translate(2) + cutout(4), flip test-time augmentation. Every conv with more than
3 input channels gets SDGP (the registered ``sdgp`` method: ``jaxprune.sdgp.convert_model``);
the stem and the head stay.

``--budget cpu`` is a reduced run for a shared 2-core CPU: ResNet-9 at 1/8 width (convs 16, 32,
[32, 32], 64, [64, 64], 32), an 8k-image class-balanced training subset, 4 epochs, batch 128 with the peak lr scaled linearly (0.5 · 128/512) and the
peak at the recipe's fraction of training (2/150) but no earlier than epoch 0.5, test accuracy
on a fixed class-balanced 2k-image test subset after the last epoch. Every row uses the same budget and seed, so the rows compare;
the absolute numbers are far from the paper's 150-epoch ones.

    python -m experiments.run sdgp_table1 [--budget full|cpu] [--rows dense,magnitude,...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from experiments._machine import machine_description
from jaxprune import data, methods, models, sdgp, train

RESULTS = Path(__file__).resolve().parent / "results"

# SDGP Table I, CIFAR-10 ResNet-9 top-1 (%); MVUE is not in the paper.
PAPER_TABLE1 = {"dense": 95.3, "random": 94.5, "magnitude": 95.2, "rescaled_magnitude": 95.2}
ROWS = ("dense", "random", "magnitude", "rescaled_magnitude", "mvue")

BUDGETS = {
  "full": dict(width=1.0, train_subset=None, test_subset=None, epochs=150, batch_size=512),
  "cpu": dict(width=0.125, train_subset=5_000, test_subset=2_000, epochs=3, batch_size=64),
}
PAPER_BATCH, PAPER_PEAK_LR, PAPER_PEAK_EPOCH, PAPER_EPOCHS = 512, 0.5, 2.0, 150


def add_budget_arguments(parser: argparse.ArgumentParser) -> None:
  """Arguments shared by the SDGP training experiments (Table I, Fig. 8)."""
  parser.add_argument("--budget", choices=sorted(BUDGETS), default="cpu")
  parser.add_argument("--width", type=float, default=None, help="width multiplier override")
  parser.add_argument(
    "--train-subset",
    type=int,
    default=None,
    help="class-balanced training subset size override (0 = all)",
  )
  parser.add_argument(
    "--test-subset",
    type=int,
    default=None,
    help="class-balanced test subset size override (0 = all)",
  )
  parser.add_argument("--epochs", type=int, default=None)
  parser.add_argument("--batch-size", type=int, default=None)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")
  parser.add_argument("--backend", choices=sdgp.BACKENDS, default="auto")
  parser.add_argument("--progress", action="store_true")


def resolve_budget(args: argparse.Namespace) -> dict[str, Any]:
  budget = dict(BUDGETS[args.budget])
  for field in ("width", "train_subset", "test_subset", "epochs", "batch_size"):
    value = getattr(args, field)
    if value is not None:
      budget[field] = (value or None) if field.endswith("subset") else value
  # Linear lr scaling with batch; the peak at the recipe's fraction of training (epoch 2 of
  # 150), but no earlier than half an epoch.
  budget["peak_lr"] = PAPER_PEAK_LR * budget["batch_size"] / PAPER_BATCH
  budget["peak_epoch"] = min(
    PAPER_PEAK_EPOCH, max(0.5, budget["epochs"] * PAPER_PEAK_EPOCH / PAPER_EPOCHS)
  )
  return budget


def load_data(args: argparse.Namespace, budget: dict[str, Any]):
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


def train_row(
  method: str, n: int, m: int, budget: dict[str, Any], train_set, test_set, args: argparse.Namespace
) -> dict[str, Any]:
  """Trains one row (``method="dense"`` = no SDGP) and returns its result record."""
  model = models.create(
    "sdgp-resnet9",
    num_classes=train_set.num_classes,
    rngs=nnx.Rngs(args.seed),
    width_multiplier=budget["width"],
  )
  chosen = (
    methods.get("dense")
    if method == "dense"
    else methods.get("sdgp", n=n, m=m, method=method, seed=args.seed, backend=args.backend)
  )
  model = chosen.convert(model)
  train_loader = data.Loader(
    train_set, budget["batch_size"], shuffle=True, seed=args.seed, augment="sdgp", drop_last=True
  )
  test_loader = data.Loader(test_set, 500, shuffle=False, drop_last=False)
  schedule = train.triangular_schedule(
    budget["peak_lr"], len(train_loader), budget["peak_epoch"], budget["epochs"]
  )
  run = methods.Run.from_loader(train_loader, epochs=budget["epochs"])
  tx = chosen.make_tx(train.sgd(schedule, momentum=0.9, weight_decay=5e-4), run)
  label = method if method == "dense" else f"{method} {n}:{m}"
  trainer = train.Trainer(
    model,
    tx,
    label_smoothing=0.1,
    flip_tta=True,
    callbacks=[_EpochPrinter(label)],
    progress=True if args.progress else False,
  )
  start = time.perf_counter()
  trainer.fit(train_loader, None, epochs=budget["epochs"], resume=False)
  train_time = time.perf_counter() - start
  evaluation = trainer.evaluate(test_loader)
  history = trainer.history
  return {
    "method": method,
    "n": n,
    "m": m,
    "test_acc": evaluation["test_acc"],
    "final_train_loss": history[-1]["train_loss"],
    "train_losses": [r["train_loss"] for r in history],
    "train_time_s": train_time,
  }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="sdgp_table1", description=__doc__.splitlines()[0])
  add_budget_arguments(parser)
  parser.add_argument(
    "--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}"
  )
  parser.add_argument("--name", default=None, help="result file stem")
  args = parser.parse_args(argv)
  rows = [r for r in args.rows.split(",") if r]
  unknown = sorted(set(rows) - set(ROWS))
  if unknown:
    parser.error(f"--rows: unknown {unknown}; choose from {ROWS}")
  args.rows = rows
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  budget = resolve_budget(args)
  name = args.name or f"sdgp_table1_{args.budget}"
  command = "python -m experiments.run sdgp_table1 " + shlex.join(
    list(argv) if argv is not None else sys.argv[1:]
  )
  RESULTS.mkdir(parents=True, exist_ok=True)
  train_set, test_set = load_data(args, budget)
  results: list[dict[str, Any]] = []
  for method in args.rows:
    t0 = time.perf_counter()
    record = train_row(method, 2, 4, budget, train_set, test_set, args)
    results.append(record)
    print(
      f"{method}: test acc {100 * record['test_acc']:.2f}% ({time.perf_counter() - t0:.0f} s)",
      flush=True,
    )
    _write(RESULTS / name, command, budget, results, len(args.rows))
  return {"budget": budget, "rows": results}


def accuracy_standard_error(results: list[dict[str, Any]], test_images: int) -> float:
  """Binomial standard error of a test accuracy near the rows' mean (in %)."""
  p = float(np.mean([r["test_acc"] for r in results]))
  return 100 * float(np.sqrt(p * (1 - p) / test_images))


def _write(
  stem: Path,
  command: str,
  budget: dict[str, Any],
  results: list[dict[str, Any]],
  planned: int,
  date: str | None = None,
) -> None:
  date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  stem.with_suffix(".json").write_text(
    json.dumps({"command": command, "date": date, "budget": budget, "rows": results}, indent=1)
  )
  labels = {
    "dense": "Dense",
    "random": "Rnd. 2:4",
    "magnitude": "Mag. 2:4",
    "rescaled_magnitude": "Res. Mag. 2:4",
    "mvue": "MVUE 2:4 (not in paper)",
  }
  subset = budget["train_subset"] or 50_000
  lines = [
    "# SDGP Table I — CIFAR-10, sdgp-resnet9, 2:4 data-gradient pruning",
    "",
    f"- Status: {len(results)} of {planned} rows done",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()}",
    f"- Budget: width ×{budget['width']}, {subset} training images, {budget['epochs']} epochs, "
    f"batch {budget['batch_size']}, triangular lr peak {budget['peak_lr']:g} at epoch "
    f"{budget['peak_epoch']:g}, SGD momentum 0.9, wd 5e-4, label smoothing 0.1, "
    "flip + translate(2) + cutout(4), flip TTA; same budget and seed for every row.",
    "- Data: the re-encoded JPEG CIFAR-10 (quality ≈75); test accuracy (flip TTA) after "
    f"the last epoch on {budget['test_subset'] or 10_000} test images.",
    "- Paper: 150 epochs at full width (2×-wide ResNet-9, 9.09 M params) on A100s.",
    f"- Noise: one seed; the binomial standard error of each accuracy is ≈"
    f"{accuracy_standard_error(results, budget['test_subset'] or 10_000):.1f} points, so "
    "differences of a point or two between rows are within noise. Train times follow the "
    "shared machine's load, not the method.",
    "",
    "| method | test acc (this run) | paper Table I | final train loss | train time |",
    "|---|---:|---:|---:|---:|",
  ]
  for r in results:
    paper = PAPER_TABLE1.get(r["method"])
    lines.append(
      f"| {labels.get(r['method'], r['method'])} | {100 * r['test_acc']:.2f}% | "
      f"{'—' if paper is None else f'{paper}%'} | {r['final_train_loss']:.4f} | "
      f"{r['train_time_s'] / 60:.1f} min |"
    )
  stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
