"""Dense baseline: PruneTrain-family ResNet-20 on CIFAR-10 (JPEG data), PruneTrain recipe.

Batch 128, SGD momentum 0.9, lr 0.1, weight decay 5e-4 (coupled, all params), random crop
(pad 4) + horizontal flip. The full recipe runs 182 epochs with x0.1 at epochs 91 and 136;
with ``--epochs E`` the drops are placed at the same fractions (50% and 75% of E).

Writes per-epoch JSON lines and a markdown summary with test accuracy, the train step's
images/s (the jitted step alone, on a fixed batch), the loader's images/s (the data
pipeline alone) and their ratio (the loader should be >= 3x faster than the step):

    python -m experiments.run cifar_baseline [--epochs 10] [--root PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from jaxprune import data, models, train
from jaxprune.timing import mean_call_s


def step_throughput(
  trainer: train.Trainer, images: np.ndarray, labels: np.ndarray, steps: int
) -> float:
  """Images/s of the jitted train step alone: a fixed device-resident batch, copies of the
  trainer's state (the step donates its inputs), after one warm-up step."""
  x, y = jnp.asarray(images), jnp.asarray(labels)
  state = [
    train.TrainState.start(
      *jax.tree.map(jnp.copy, (trainer.params, trainer.rest, trainer.opt_state))
    )
  ]

  def step():
    state[0] = trainer.steps.train(state[0], x, y)
    return state[0]

  return x.shape[0] / mean_call_s(step, calls=steps)


def loader_throughput(loader: data.Loader, batches: int) -> float:
  """Images/s of the data pipeline alone (epoch 0, the consumer does no work)."""
  images, start = 0, time.perf_counter()
  for i, (x, _) in enumerate(loader.iter_epoch(0)):
    images += x.shape[0]
    if i + 1 >= batches:
      break
  return images / (time.perf_counter() - start)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="cifar_baseline", description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--model", default="prunetrain-resnet20")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=0.1)
  parser.add_argument("--weight-decay", type=float, default=5e-4)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")
  parser.add_argument("--bench-steps", type=int, default=20, help="steps timed for the step rate")
  parser.add_argument("--name", default=None, help="result file stem (default from the model)")
  parser.add_argument(
    "--checkpoint-dir",
    default=None,
    help="orbax checkpoints (resume from the latest); default runs/NAME/ckpt",
  )
  parser.add_argument("--progress", action="store_true", help="tqdm bar even without a tty")
  parser.add_argument("--note", default="", help="a remark written into the markdown")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.epochs < 1:
    parser.error("--epochs must be at least 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  arch = args.model.split("-", 1)[-1]
  name = args.name or f"cifar10_{arch}_dense"
  folder = pages.output_dir("benchmarks", args.publish)
  log_path = folder / f"{name}.jsonl"
  ckpt = args.checkpoint_dir or str(Path("runs") / name / "ckpt")
  command = cli.command_line("cifar_baseline", argv)

  train_set = data.load("cifar10", root=args.root, split="train")
  test_set = data.load("cifar10", root=args.root, split="test")
  train_loader = data.Loader(
    train_set, args.batch_size, shuffle=True, seed=args.seed, augment="prunetrain", drop_last=True
  )
  test_loader = data.Loader(test_set, 500, shuffle=False, drop_last=False)
  steps_per_epoch = len(train_loader)
  milestones = sorted({max(1, round(0.5 * args.epochs)), max(1, round(0.75 * args.epochs))})
  milestones = [m for m in milestones if m < args.epochs] or [args.epochs]
  schedule = train.step_schedule(args.lr, steps_per_epoch, milestones)
  tx = train.sgd(schedule, momentum=0.9, weight_decay=args.weight_decay)
  model = models.create(args.model, num_classes=train_set.num_classes, rngs=nnx.Rngs(args.seed))
  # What fixes the trajectory: a resume under other settings is refused, not mixed in.
  run_config = {
    k: getattr(args, k)
    for k in ("model", "epochs", "batch_size", "lr", "weight_decay", "seed", "root")
  }
  trainer = train.Trainer(
    model,
    tx,
    log_path=log_path,
    checkpoint_dir=ckpt,
    progress=True if args.progress else None,
    run_config=run_config,
  )

  images, labels = next(iter(train_loader.iter_epoch(0)))
  step_rate = step_throughput(trainer, images, labels, args.bench_steps)
  loader_rate = loader_throughput(train_loader, batches=min(100, steps_per_epoch))
  print(
    f"train step: {step_rate:.0f} images/s; loader: {loader_rate:.0f} images/s; "
    f"ratio {loader_rate / step_rate:.1f}",
    flush=True,
  )

  base = {
    "model": args.model,
    "epochs": args.epochs,
    "milestones": milestones,
    "step_images_per_s": step_rate,
    "loader_images_per_s": loader_rate,
    "loader_to_step_ratio": loader_rate / step_rate,
  }

  def summarize(history: list[dict[str, Any]]) -> dict[str, Any]:
    return {
      **base,
      "epochs_done": len(history),
      "test_acc": history[-1]["test_acc"],
      "best_test_acc": max(r["test_acc"] for r in history),
      "wall_time_s": history[-1]["wall_time_s"],
    }

  class Report(train.Callback):
    # Rewrites the markdown after every epoch so a long run leaves a readable partial result.
    def after_epoch(self, trainer: train.Trainer, record: dict[str, Any]) -> None:
      _write_markdown(
        folder / f"{name}.md", args, summarize(trainer.history), trainer.history, command
      )

  trainer.callbacks.append(Report())
  history = trainer.fit(train_loader, test_loader, epochs=args.epochs)
  result = summarize(history)
  _write_markdown(folder / f"{name}.md", args, result, history, command)
  print(json.dumps(result), flush=True)
  return result


def _write_markdown(
  path: Path,
  args: argparse.Namespace,
  result: dict[str, Any],
  history: list[dict[str, Any]],
  command: str,
) -> None:
  date = pages.utc_now()
  lines = [
    f"# Dense baseline: {args.model} on CIFAR-10 (JPEG), {args.epochs} epochs",
    "",
    f"- Status: {result['epochs_done']} of {args.epochs} epochs done"
    + ("" if result["epochs_done"] == args.epochs else " (run in progress or interrupted)"),
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()}",
    f"- Recipe (PruneTrain): batch {args.batch_size}, SGD momentum 0.9, lr {args.lr} "
    f"x0.1 at epochs {result['milestones']} (the 182-epoch recipe's 50%/75% points), "
    f"weight decay {args.weight_decay} (coupled, all params), pad-4 crop + flip.",
    "- Data: the re-encoded JPEG CIFAR-10 (quality about 75), so accuracies run a little "
    "under published CIFAR-10 numbers.",
    *([f"- Note: {args.note}"] if args.note else []),
    "",
    "| metric | value |",
    "|---|---:|",
    f"| final test accuracy | {100 * result['test_acc']:.2f}% |",
    f"| best test accuracy | {100 * result['best_test_acc']:.2f}% |",
    f"| train step images/s (jitted step alone, batch {args.batch_size}) "
    f"| {result['step_images_per_s']:,.0f} |",
    f"| loader images/s (data pipeline alone, crop+flip) | {result['loader_images_per_s']:,.0f} |",
    f"| loader / step ratio (target >= 3) | {result['loader_to_step_ratio']:.1f} |",
    f"| training wall time (train + eval, all epochs) | {result['wall_time_s'] / 60:.1f} min |",
    "",
    "| epoch | train loss | train acc | test loss | test acc | lr | images/s (epoch) |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in history:
    lines.append(
      f"| {r['epoch']} | {r['train_loss']:.4f} | {100 * r['train_acc']:.2f}% "
      f"| {r['test_loss']:.4f} | {100 * r['test_acc']:.2f}% | {r['lr']:.4g} "
      f"| {r['images_per_s']:,.0f} |"
    )
  path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
