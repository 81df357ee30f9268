"""Images per second of a ClickTrain VGG-11 epoch: the host loader against the device loader.

    python -m experiments.run device_loader_bench [--width 0.25] [--steps 60] [--repeats 2]

Trains ``clicktrain-vgg11`` (the ``cpu`` budget's width by default) with ClickTrain's transform
on CIFAR-10 for two epochs of ``--steps`` steps at batch 128 and reads the second epoch's
``images_per_s`` (the first compiles), for each loader: the NumPy :class:`~jaxprune.data.Loader`
(crop + flip on the host, a float32 copy to the device every step) and
:class:`~jaxprune.data.DeviceLoader` at 1 and ``--steps-per-dispatch`` steps per call. The
configurations alternate ``--repeats`` times, so a drift in the host's load reaches them alike;
the page gives the median and each ratio to the host loader of the same repeat. Writes
``experiments/results/benchmarks/device_loader_<method>_<platform>.{md,json}`` (``runs/benchmarks/``
without ``--publish``).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from flax import nnx

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from jaxprune import data, methods, models, train


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="device_loader_bench", description=__doc__.splitlines()[0])
  p.add_argument("--width", type=float, default=0.25, help="VGG-11 width multiplier")
  p.add_argument("--steps", type=int, default=60, help="steps per epoch (batch 128)")
  p.add_argument("--steps-per-dispatch", type=int, default=10)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--method", choices=["clicktrain", "dense"], default="clicktrain")
  p.add_argument("--root", default=None, help="CIFAR-10 source (default: data package's)")
  cli.add_publish_argument(p, "benchmarks")
  a = p.parse_args(argv)
  for name in ("steps", "steps_per_dispatch", "repeats"):
    if getattr(a, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  return a


def _epoch_rate(loader: Any, width: float, method: str) -> float:
  """Images per second of the second of two epochs (the first compiles)."""
  model = models.create(
    "clicktrain-vgg11", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=width
  )
  inner = train.sgd(0.05, momentum=0.9, weight_decay=5e-4)
  tx = methods.get(method).make_tx(inner, methods.Run.from_loader(loader, epochs=2))
  trainer = train.Trainer(model, tx, progress=False)
  return trainer.fit(loader, epochs=2)[-1]["images_per_s"]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  import jax

  subset = data.load("cifar10", root=args.root, split="train").balanced_subset(128 * args.steps, 0)
  configs = {
    "host Loader": lambda: data.Loader(subset, 128, seed=0, augment="clicktrain"),
    "DeviceLoader, 1 step per call": lambda: data.DeviceLoader(
      subset, 128, seed=0, augment="clicktrain"
    ),
    f"DeviceLoader, {args.steps_per_dispatch} steps per call": lambda: data.DeviceLoader(
      subset, 128, seed=0, augment="clicktrain", steps_per_dispatch=args.steps_per_dispatch
    ),
  }
  rates: dict[str, list[float]] = {name: [] for name in configs}
  for repeat in range(args.repeats):
    for name, make in configs.items():
      rates[name].append(_epoch_rate(make(), args.width, args.method))
      print(f"repeat {repeat + 1}: {name}: {rates[name][-1]:.1f} images/s", flush=True)
  host = rates["host Loader"]
  rows = [
    {
      "loader": name,
      "images_per_s": statistics.median(r),
      "ratio_to_host": statistics.median(x / h for x, h in zip(r, host)),
      "each": r,
    }
    for name, r in rates.items()
  ]
  command = cli.command_line("device_loader_bench", argv)
  machine = machine_description()
  lines = [
    f"# Host loader vs device loader: a {args.method} VGG-11 training epoch",
    "",
    f"- Command: `{command}`",
    f"- Date: {pages.utc_now()}",
    f"- Machine: {machine}",
    f"- Model: clicktrain-vgg11 at width ×{args.width:g}, method {args.method}, batch 128, "
    f"{args.steps} steps per epoch of CIFAR-10 (crop + flip); the second of two epochs; "
    f"{args.repeats} alternating repeats (median).",
    "",
    "| loader | images/s | vs host loader (same repeat) |",
    "|---|---:|---:|",
    *(f"| {r['loader']} | {r['images_per_s']:.1f} | {r['ratio_to_host']:.2f}× |" for r in rows),
    "",
  ]
  result = {"command": command, "machine": machine, "args": vars(args), "rows": rows}
  folder = pages.output_dir("benchmarks", args.publish)
  stem = f"device_loader_{args.method}_{jax.default_backend()}"
  pages.write_result(folder / stem, result, "\n".join(lines))
  return result


if __name__ == "__main__":
  main()
