"""Training step with 1x1 weight gradients as matmuls vs XLA:CPU's own weight gradients.

``jaxprune.models.ConvBN`` computes the weight gradient of its 1x1 convolutions as one
matmul on CPU (``jaxprune/models/conv.py``); this times a full training step (forward,
backward, SGD with momentum and weight decay) of the same models with every convolution
set back to ``lax.conv_general_dilated``. The two variants alternate, ``--repeats`` times
each, and each row reports the median. Inference MFLOPs per image say what the step should
cost: PruneTrain's ResNet-50 has 1.6x ResNet-32's FLOPs, but with lax's weight gradients it
stepped 8.7x slower on 2 cores (every bottleneck's first 1x1 conv reads the residual stream,
whose elementwise chain XLA:CPU recomputes in each weight gradient's transpose).

    python -m experiments.run bench_conv_weight_grad [--publish]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from jaxprune import models, train
from jaxprune import prunetrain as pt
from jaxprune.timing import mean_call_s

VARIANTS = ("lax weight gradient", "1x1 matmul weight gradient")


def _model(name: str, width: float, lax_weight_gradient: bool) -> nnx.Module:
  model = models.create(name, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=width)
  if lax_weight_gradient:
    for _, module in nnx.iter_graph(model):
      if isinstance(module, nnx.Conv):
        module.conv_general_dilated = lax.conv_general_dilated
  return model


def _step_seconds(trainer: train.Trainer, state: list, x, y, steps: int) -> float:
  """Seconds per step of ``steps`` training steps from ``state`` (updated in place: the step
  donates its buffers)."""

  def step():
    state[0] = trainer.steps.train(state[0], x, y)
    return state[0].params

  return mean_call_s(step, calls=steps, warmup=0)


def bench_model(name: str, width: float, batch: int, steps: int, repeats: int) -> dict:
  """Median seconds per training step of each of :data:`VARIANTS`, alternating."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)).astype(np.float32))
  y = jnp.asarray(rng.integers(0, 10, batch).astype(np.int32))
  runs = {}
  for variant in VARIANTS:
    trainer = train.Trainer(
      _model(name, width, variant == VARIANTS[0]), train.sgd(0.05, 0.9, weight_decay=5e-4)
    )
    state = [train.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)]
    _step_seconds(trainer, state, x, y, 1)  # compile
    runs[variant] = (trainer, state)
  times = {variant: [] for variant in VARIANTS}
  for _ in range(repeats):
    for variant in VARIANTS:
      times[variant].append(_step_seconds(*runs[variant], x, y, steps))
  costs = pt.model_costs(_model(name, width, False), (32, 32, 3))
  return {
    "model": name,
    "mflops_per_image": costs["inference_flops"] / 1e6,
    **{f"{variant} ms": 1e3 * statistics.median(times[variant]) for variant in VARIANTS},
  }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="bench_conv_weight_grad", description=__doc__.splitlines()[0]
  )
  parser.add_argument(
    "--models", default="prunetrain-resnet32,prunetrain-resnet50,prunetrain-vgg11"
  )
  parser.add_argument("--width", type=float, default=0.5)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
  parser.add_argument("--repeats", type=int, default=3)
  cli.add_output_arguments(parser, "benchmarks/")
  args = parser.parse_args(argv)
  for key in ("batch", "steps", "repeats"):
    if getattr(args, key) < 1:
      parser.error(f"--{key} must be at least 1")
  return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
  args = _parse(argv)
  rows = []
  for name in [m for m in args.models.split(",") if m]:
    row = bench_model(name, args.width, args.batch, args.steps, args.repeats)
    row["speedup"] = row[f"{VARIANTS[0]} ms"] / row[f"{VARIANTS[1]} ms"]
    rows.append(row)
    print(json.dumps(row), flush=True)
  command = cli.command_line("bench_conv_weight_grad", argv)
  date = pages.utc_now()
  lines = [
    "# Training step: 1x1 weight gradients as matmuls vs XLA:CPU's",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()}",
    (
      f"- Setting: width {args.width}, batch {args.batch} of 32x32x3, SGD momentum + wd; "
      f"median of {args.repeats} repeats of {args.steps} steps, the variants alternating."
    ),
    "",
    (
      "| model | MFLOPs / image | lax weight gradient (ms / step) | 1x1 matmul (ms / step) "
      "| speed-up | ms / step per MFLOP (matmul) |"
    ),
    "|---|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    ours = r[f"{VARIANTS[1]} ms"]
    lines.append(
      f"| {r['model']} | {r['mflops_per_image']:.1f} | {r[f'{VARIANTS[0]} ms']:.0f} | "
      f"{ours:.0f} | {r['speedup']:.2f}x | {ours / r['mflops_per_image']:.1f} |"
    )
  folder = pages.output_dir("benchmarks", args.publish, args.out)
  folder.mkdir(parents=True, exist_ok=True)
  (folder / "conv_weight_grad.md").write_text("\n".join(lines) + "\n")
  (folder / "conv_weight_grad.json").write_text(
    json.dumps({"command": command, "date": date, "args": vars(args), "rows": rows}, indent=1)
  )
  return rows


if __name__ == "__main__":
  main()
