"""Quickstart: train on scikit-learn's 8x8 digits and print a results table.

Runs in about two minutes on 2 CPU cores (five methods x 15 epochs), with no data to
download (the digits ship inside scikit-learn). Every row is a *method*: an optimizer factory plus an optional model
converter, trained with the same data, model and budget, so pruning methods can be
compared with the dense baseline:

    python -m experiments.run quickstart [--epochs 15] [--methods dense] [--json out.json]

Adding a method (e.g. SDGP, PruneTrain, ClickTrain) is one entry in ``METHODS``::

    METHODS["sdgp mag 2:4"] = Method(
        make_tx=lambda cfg: dense_tx(cfg),
        convert=lambda model: jaxprune.sdgp.convert(model, n=2, m=4, method="magnitude"))

``make_tx(cfg)`` gets a :class:`RunConfig` (epochs, steps per epoch, lr, ...) and returns
any Optax transform (wrappers such as ClickTrain's receive the loss as ``value``);
``convert(model)`` returns the model to train (default: unchanged); ``callbacks(cfg)``
returns trainer callbacks (e.g. PruneTrain reconfiguration every few epochs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from flax import nnx

from jaxprune import data, flops, models, prunetrain, sdgp, train
from jaxprune.clicktrain import clicktrain


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """What a method's factories may depend on."""

  epochs: int
  steps_per_epoch: int
  batch_size: int
  lr: float
  weight_decay: float
  num_classes: int


@dataclasses.dataclass(frozen=True)
class Method:
  """One row of the table.

  Attributes:
    make_tx: ``RunConfig -> optax transform``.
    convert: ``model -> model`` applied before training (e.g. SDGP conv swap).
    callbacks: ``RunConfig -> list of jaxprune.train callbacks``.
  """

  make_tx: Callable[[RunConfig], optax.GradientTransformation]
  convert: Callable[[nnx.Module], nnx.Module] | None = None
  callbacks: Callable[[RunConfig], Sequence[Any]] | None = None


def dense_tx(cfg: RunConfig) -> optax.GradientTransformationExtraArgs:
  """SGD momentum 0.9, coupled weight decay, triangular LR (peak at 20% of training)."""
  schedule = train.triangular_schedule(
    cfg.lr, cfg.steps_per_epoch, peak_epoch=max(1, cfg.epochs // 5), total_epochs=cfg.epochs
  )
  return train.sgd(schedule, momentum=0.9, weight_decay=cfg.weight_decay)


def _sdgp(method: str, n: int = 2, m: int = 4) -> Method:
  """SDGP: N:M pruning of each conv's output data gradient (the stem stays dense)."""
  return Method(
    make_tx=dense_tx, convert=lambda model: sdgp.convert_model(model, n=n, m=m, method=method)
  )


def _prunetrain_tx(cfg: RunConfig) -> optax.GradientTransformationExtraArgs:
  # A short run needs a larger penalty share than the paper's 0.2 for channels to die
  # within the budget (PruneTrain §4.1 sets λ from this ratio at the first step).
  return prunetrain.with_group_lasso(dense_tx(cfg), penalty_ratio=0.9)


def _prunetrain_callbacks(cfg: RunConfig) -> list[Any]:
  # Reconfigure twice in the run; the threshold is raised from 1e-4 for the same reason.
  return [
    prunetrain.PruneTrainCallback(
      every_epochs=max(1, cfg.epochs // 3),
      threshold=1e-2,
      image_shape=(8, 8, 1),
      dynamic_batch=False,
    )
  ]


def _clicktrain_tx(cfg: RunConfig) -> optax.GradientTransformationExtraArgs:
  # The paper's stages compressed into the budget: pool generation from 20% of the run,
  # finalization after it, hard prune at 2/3 (ClickTrain §4.1-4.4).
  epoch = max(1, cfg.epochs // 5)
  return clicktrain(
    dense_tx(cfg),
    steps_per_epoch=cfg.steps_per_epoch,
    hard_prune_epoch=max(3 * epoch + 1, (2 * cfg.epochs) // 3),
    pool_start_epoch=epoch,
    pool_epochs=epoch,
    finalize_epochs=epoch,
    kernel_prune_ratio=0.5,
  )


METHODS: dict[str, Method] = {
  "dense": Method(make_tx=dense_tx),
  "sdgp rescaled 2:4": _sdgp("rescaled_magnitude"),
  "sdgp mvue 2:4": _sdgp("mvue"),
  "prunetrain": Method(make_tx=_prunetrain_tx, callbacks=_prunetrain_callbacks),
  "clicktrain": Method(make_tx=_clicktrain_tx),
}


def build_model(num_classes: int, seed: int) -> nnx.Module:
  """PruneTrain's ResNet-20 at half width (8-16-32 channels) for 8x8 grey images."""
  return models.create(
    "prunetrain-resnet20",
    num_classes=num_classes,
    rngs=nnx.Rngs(seed),
    width_multiplier=0.5,
    in_channels=1,
  )


def _conv_weights(model: nnx.Module) -> tuple[int, float]:
  """(conv kernel weights, compression ratio of the model's own conv kernels)."""
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  total = sum(int(p.size) for p in jax.tree.leaves(params) if p.ndim == 4)
  return total, flops.compression_ratio(params)


def run_method(name: str, method: Method, args: argparse.Namespace) -> dict[str, Any]:
  train_set = data.load("digits", split="train")
  test_set = data.load("digits", split="test")
  train_loader = data.Loader(
    train_set, args.batch_size, shuffle=True, seed=args.seed, augment=None, drop_last=True
  )
  test_loader = data.Loader(test_set, 256, shuffle=False, drop_last=False)
  cfg = RunConfig(
    epochs=args.epochs,
    steps_per_epoch=len(train_loader),
    batch_size=args.batch_size,
    lr=args.lr,
    weight_decay=args.weight_decay,
    num_classes=train_set.num_classes,
  )
  model = build_model(train_set.num_classes, args.seed)
  dense_total, _ = _conv_weights(model)
  if method.convert is not None:
    model = method.convert(model)
  trainer = train.Trainer(
    model,
    method.make_tx(cfg),
    label_smoothing=args.label_smoothing,
    callbacks=list(method.callbacks(cfg)) if method.callbacks else [],
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
  }


def format_table(rows: Sequence[dict[str, Any]]) -> str:
  lines = ["| method | test acc | compression | train time (s) |", "|---|---:|---:|---:|"]
  for r in rows:
    lines.append(
      f"| {r['method']} | {100 * r['test_acc']:.2f}% | {r['compression']:.2f}x "
      f"| {r['train_time_s']:.1f} |"
    )
  return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="quickstart", description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=15)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--weight-decay", type=float, default=5e-4)
  parser.add_argument("--label-smoothing", type=float, default=0.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--methods", default=",".join(METHODS), help=f"comma-separated subset of: {', '.join(METHODS)}"
  )
  parser.add_argument("--json", default=None, help="also write the rows as JSON here")
  parser.add_argument("--progress", action="store_true", help="show per-epoch progress bars")
  args = parser.parse_args(argv)
  if args.epochs < 1:
    parser.error("--epochs must be at least 1")
  unknown = [m for m in args.methods.split(",") if m not in METHODS]
  if unknown:
    parser.error(f"unknown method(s) {unknown}; available: {', '.join(METHODS)}")
  return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = _parse(argv)
  rows = []
  for name in args.methods.split(","):
    rows.append(run_method(name, METHODS[name], args))
    print(
      f"{name}: test acc {100 * rows[-1]['test_acc']:.2f}% ({rows[-1]['train_time_s']:.1f} s)",
      flush=True,
    )
  print(format_table(rows))
  print(
    "compression = dense conv weights / nonzero conv weights of the final model; SDGP prunes "
    "data gradients, not weights, so its model stays dense."
  )
  if args.json:
    with open(args.json, "w") as f:
      json.dump(rows, f, indent=2)
  return rows


if __name__ == "__main__":
  main()
