"""Quickstart: train on scikit-learn's 8x8 digits and print a results table.

Runs in a few minutes on 2 CPU cores (five methods x 15 epochs), with no data to
download (the digits ship inside scikit-learn). Every row is a registered
:mod:`jaxprune.methods` method with a configuration sized for this run, trained with the same
data, model, optimizer and budget, so pruning methods can be compared with the dense
baseline:

    python -m experiments.run quickstart [--epochs 15] [--methods dense] [--seeds 0,1,2] [--publish]

It writes the table to ``runs/quickstart.md`` (with the command, date and machine; JSON beside
it), or to ``experiments/results/quickstart.md``, the page the README quotes, with
``--publish``. ``--dtype bf16`` trains the models in bfloat16 (parameters float32) and writes
``quickstart_bf16.md`` instead.

Floating-point summation order differs between machines (and XLA builds), so the same command
moves every number a little elsewhere; ``--seeds 0,1,2`` trains each row once per seed (data
order and initialisation) and adds each row's min–max over the seeds, the range a reader's own
number can be compared with. The table's other columns are the first seed's run.

The rows are those of :data:`jaxprune.quickstart.METHODS`, the short-run settings the
notebooks share; the default rows are its first five, the others (``clicktrain-one-shot`` and
the compositions) run when named in ``--methods``. Adding a row is one entry in ``METHODS``:
a registered method name and its config as a function of the epoch count::

    METHODS["sdgp magnitude 1:4"] = ("sdgp", lambda epochs: {"n": 1, "m": 4, "method": "magnitude"})

Each row then trains as any script would use a method::

    method = jaxprune.methods.get(name, **config)
    run = jaxprune.methods.Run.from_loader(train_loader, epochs=epochs)
    model = method.convert(model)
    trainer = train.Trainer(model, method.make_tx(inner, run), callbacks=method.callbacks(run))
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from jaxprune import data, flops, methods, models, train
from jaxprune.quickstart import METHODS, dense_tx, departures

DEFAULT_METHODS = ("dense", "sdgp rescaled 2:4", "sdgp mvue 2:4", "prunetrain", "clicktrain")


def build_model(num_classes: int, seed: int, dtype: Any = None) -> nnx.Module:
  """PruneTrain's ResNet-20 at half width (8-16-32 channels) for 8x8 grey images, computing in
  ``dtype`` (``None``: float32)."""
  return models.create(
    "prunetrain-resnet20",
    num_classes=num_classes,
    rngs=nnx.Rngs(seed),
    width_multiplier=0.5,
    in_channels=1,
    dtype=dtype,
  )


def _conv_weights(model: nnx.Module) -> tuple[int, float]:
  """(conv kernel weights, compression ratio of the model's own conv kernels)."""
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  total = sum(int(p.size) for p in jax.tree.leaves(params) if p.ndim == 4)
  return total, flops.compression_ratio(params)


def run_method(name: str, args: argparse.Namespace) -> dict[str, Any]:
  """Trains the row ``name`` of ``METHODS`` with seed ``args.seed`` and returns its result
  record."""
  registered, config = METHODS[name]
  method = methods.get(registered, **config(args.epochs))
  train_set = data.load("digits", split="train")
  test_set = data.load("digits", split="test")
  train_loader = data.Loader(
    train_set, args.batch_size, shuffle=True, seed=args.seed, augment=None, drop_last=True
  )
  test_loader = data.Loader(test_set, 256, shuffle=False, drop_last=False)
  run = methods.Run.from_loader(train_loader, epochs=args.epochs)
  model = build_model(train_set.num_classes, args.seed, cli.compute_dtype(args))
  dense_total, _ = _conv_weights(model)
  model = method.convert(model)
  inner = dense_tx(args.lr, args.weight_decay, run.steps_per_epoch, run.epochs)
  trainer = train.Trainer(
    model,
    method.make_tx(inner, run),
    label_smoothing=args.label_smoothing,
    callbacks=method.callbacks(run),
    progress=args.progress,
  )
  start = time.perf_counter()
  history = trainer.fit(train_loader, test_loader, epochs=args.epochs)
  train_time = time.perf_counter() - start
  total, own_ratio = _conv_weights(trainer.model)
  # Relative to the dense model's conv weights, so a reconfigured (smaller) model counts
  # its removed channels as pruned too.
  compression = dense_total / (total / own_ratio) if own_ratio != float("inf") else float("inf")
  last = history[-1]
  return {
    "method": name,
    "test_acc": last["test_acc"],
    "test_loss": last["test_loss"],
    "train_acc": last["train_acc"],
    "compression": compression,
    "train_time_s": train_time,
    "epochs": args.epochs,
    "seed": args.seed,
    **cli.dtype_config(args),
  }


def _spread(values: Sequence[float]) -> str:
  return f"{min(values):.2f}–{max(values):.2f}"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  """The results table: one line per method, the first seed's run; with several seeds, each
  method's min–max over them too."""
  by_method: dict[str, list[dict[str, Any]]] = {}
  for r in rows:
    by_method.setdefault(r["method"], []).append(r)
  seeds = max(len(runs) for runs in by_method.values())
  head = "| method | test acc | compression | train time (s) |"
  rule = "|---|---:|---:|---:|"
  if seeds > 1:
    head += f" test acc, {seeds} seeds | compression, {seeds} seeds |"
    rule += "---:|---:|"
  lines = [head, rule]
  for name, runs in by_method.items():
    r = runs[0]
    line = (
      f"| {name} | {100 * r['test_acc']:.2f}% | {r['compression']:.2f}x | {r['train_time_s']:.1f} |"
    )
    if seeds > 1:
      accs = _spread([100 * x["test_acc"] for x in runs])
      line += f" {accs}% | {_spread([x['compression'] for x in runs])}x |"
    lines.append(line)
  return "\n".join(lines)


def _seeds(text: str | None, seed: int) -> list[int]:
  if text is None:
    return [seed]
  try:
    seeds = [int(s) for s in text.split(",")]
  except ValueError:
    raise ValueError(f"--seeds must be comma-separated ints, got {text!r}") from None
  if len(set(seeds)) != len(seeds):
    raise ValueError(f"--seeds must not repeat a seed, got {text!r}")
  return seeds


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="quickstart", description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=15, help="epochs of every method's run")
  parser.add_argument("--batch-size", type=int, default=64, help="training batch size")
  parser.add_argument(
    "--lr", type=float, default=0.1, help="peak learning rate of the triangular schedule"
  )
  parser.add_argument(
    "--weight-decay", type=float, default=5e-4, help="SGD's coupled weight decay (all params)"
  )
  parser.add_argument(
    "--label-smoothing", type=float, default=0.0, help="label smoothing of the cross-entropy"
  )
  parser.add_argument(
    "--seed", type=int, default=0, help="seed of the model's initialisation and the data order"
  )
  parser.add_argument(
    "--seeds",
    default=None,
    help="comma-separated seeds (overrides --seed): each row once per seed, with its min–max",
  )
  parser.add_argument(
    "--methods",
    default=",".join(DEFAULT_METHODS),
    help=f"comma-separated subset of: {', '.join(METHODS)}",
  )
  cli.add_output_arguments(parser, "quickstart.md")
  cli.add_dtype_argument(parser)
  parser.add_argument("--progress", action="store_true", help="show per-epoch progress bars")
  args = parser.parse_args(argv)
  if args.epochs < 1:
    parser.error("--epochs must be at least 1")
  unknown = [m for m in args.methods.split(",") if m not in METHODS]
  if unknown:
    parser.error(f"unknown method(s) {unknown}; available: {', '.join(METHODS)}")
  try:
    args.seed_list = _seeds(args.seeds, args.seed)
  except ValueError as err:
    parser.error(str(err))
  return args


_NOTE = (
  "compression = dense conv weights / nonzero conv weights of the final model; SDGP prunes "
  "data gradients, not weights, so its model stays dense."
)


def _seed_words(seeds: Sequence[int]) -> str:
  if len(seeds) == 1:
    return f"seed {seeds[0]}"
  return f"seeds {', '.join(map(str, seeds))} (min–max columns; the others: seed {seeds[0]})"


def write_page(
  folder: Path, rows: Sequence[dict[str, Any]], command: str, args: argparse.Namespace
) -> Path:
  """Writes ``quickstart.md`` (the table, the command, date and machine) and
  ``quickstart.json`` to ``folder`` (``quickstart_bf16.*`` for ``--dtype bf16``); returns the
  page's path."""
  page = folder / f"quickstart{cli.dtype_suffix(args)}.md"
  lines = [
    "# Quickstart: the methods on scikit-learn's digits",
    "",
    f"- Command: `{command}`",
    f"- Date: {pages.utc_now()}",
    f"- Machine: {machine_description()}",
    (
      f"- Recipe: PruneTrain's ResNet-20 at half width on the 8x8 digits, {args.epochs} epochs, "
      f"batch {args.batch_size}, SGD momentum 0.9, triangular lr peak {args.lr}, weight decay "
      f"{args.weight_decay}, {_seed_words(args.seed_list)}; the same for every row."
    ),
    *(f"- {note}" for note in cli.dtype_notes(args)),
    *(f"- Not the papers' settings: {note}" for note in departures(args.epochs)),
    "",
    format_table(rows),
    "",
    _NOTE,
  ]
  page.write_text("\n".join(lines) + "\n")
  page.with_suffix(".json").write_text(json.dumps(list(rows), indent=2) + "\n")
  return page


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = _parse(argv)
  command = cli.command_line("quickstart", argv)
  rows = []
  for name in args.methods.split(","):
    for seed in args.seed_list:
      rows.append(run_method(name, argparse.Namespace(**{**vars(args), "seed": seed})))
      print(
        f"{name} (seed {seed}): test acc {100 * rows[-1]['test_acc']:.2f}% "
        f"({rows[-1]['train_time_s']:.1f} s)",
        flush=True,
      )
  print(format_table(rows))
  print(_NOTE)
  page = write_page(pages.output_dir(None, args.publish, args.out), rows, command, args)
  print(f"wrote {page}")
  return rows


if __name__ == "__main__":
  main()
