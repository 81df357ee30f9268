"""SDGP time model (paper Fig. 9/10) and the SDGP/dense step-time overhead.

Per conv layer of sdgp-resnet9 this times, each as its own jitted function on the layer's
real shapes: the forward conv, the input-gradient (dX) conv and the weight-gradient (dW)
conv (``jax.vjp`` of ``lax.conv_general_dilated`` w.r.t. one argument; XLA drops the unused
forward). The stem's dX is not part of training (its input is the image) and is left out,
as in the paper's framework. From the totals:

* the dX share of conv time (the paper measures ≈1/3 for ResNet-18);
* the projected step time for N:M settings (Fig. 10's method): with sparse hardware the dX
  convs run ``r = m/n`` times faster, so ``projected = dense_step − ΣdX · (1 − 1/r)``; the
  paper's shortcut ``dense_step · (1 − s + s/r)`` with ``s`` the dX share is listed too.

It also times the whole jitted train step (forward, backward, SGD update) of the dense model
and of SDGP-converted copies in the same run: on hardware without N:M support SDGP cannot be
faster, the ratio measures the pruning overhead (target ≤ 1.10).

    python -m experiments.run sdgp_timemodel [--width 0.25] [--batch-size 32] [--repeats 10]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments._machine import machine_description
from jaxprune import models, sdgp, train

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ((2, 4), (1, 4), (2, 8), (4, 32))
STEP_METHODS = ("magnitude", "rescaled_magnitude", "mvue")


class _ConvRecorder:
  """Stands in for ``lax.conv_general_dilated`` inside an ``nnx.Conv`` to record its call."""

  def __init__(self, name: str, records: list[dict[str, Any]]):
    self.name, self.records = name, records

  def __call__(self, lhs, rhs, window_strides, padding, **kwargs):
    kwargs.pop("out_sharding", None)
    kwargs.pop("preferred_element_type", None)
    self.records.append(
      dict(
        name=self.name,
        lhs=lhs.shape,
        rhs=rhs.shape,
        strides=tuple(window_strides),
        padding=padding,
        kwargs=kwargs,
      )
    )
    return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, **kwargs)


def conv_layers(model: nnx.Module, image_shape: tuple[int, ...]) -> list[dict[str, Any]]:
  """Every conv call of one forward pass, in execution order, with its arguments."""
  records: list[dict[str, Any]] = []
  convs = [(p, c) for p, c in nnx.iter_modules(model) if isinstance(c, nnx.Conv)]
  originals = [c.conv_general_dilated for _, c in convs]
  for path, conv in convs:
    conv.conv_general_dilated = _ConvRecorder("/".join(map(str, path)), records)
  try:
    model.eval()
    jax.eval_shape(lambda x: model(x), jax.ShapeDtypeStruct(image_shape, jnp.float32))
  finally:
    for (_, conv), original in zip(convs, originals):
      conv.conv_general_dilated = original
    model.train()
  return records


def interleaved_times(
  jobs: dict[str, tuple[Callable, Sequence[Any]]], rounds: int
) -> dict[str, float]:
  """Minimum seconds of each job over ``rounds`` round-robin passes.

  On a shared machine the load drifts over seconds; running the jobs in turn within every
  round exposes each to the same drift, and the minimum estimates the undisturbed time.
  """
  for fn, args in jobs.values():
    jax.block_until_ready(fn(*args))  # compile + warm up
  best = {name: float("inf") for name in jobs}
  for _ in range(rounds):
    for name, (fn, args) in jobs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def layer_jobs(layer: dict[str, Any], key: jax.Array) -> dict[str, tuple[Callable, tuple]]:
  """The forward, dX and dW convs of one layer, each jitted on its own."""

  def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, layer["strides"], layer["padding"], **layer["kwargs"])

  kx, kw, kg = jax.random.split(key, 3)
  x = jax.random.normal(kx, layer["lhs"])
  w = jax.random.normal(kw, layer["rhs"])
  g = jax.random.normal(kg, jax.eval_shape(conv, x, w).shape)
  input_grad = jax.jit(lambda x, w, g: jax.vjp(lambda x_: conv(x_, w), x)[1](g)[0])
  weight_grad = jax.jit(lambda x, w, g: jax.vjp(lambda w_: conv(x, w_), w)[1](g)[0])
  jobs = {"forward": (jax.jit(conv), (x, w)), "weight_grad": (weight_grad, (x, w, g))}
  if layer["lhs"][-1] > 3:  # the stem's input is the image: no dX in training
    jobs["input_grad"] = (input_grad, (x, w, g))
  return jobs


def step_job(model: nnx.Module, batch: int) -> tuple[Callable, tuple]:
  """The jitted train step (SGD momentum, wd 5e-4, label smoothing 0.1) on a fixed batch."""
  trainer = train.Trainer(
    model, train.sgd(0.1, 0.9, weight_decay=5e-4), label_smoothing=0.1, progress=False, donate=False
  )
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)).astype(np.float32))
  labels = jnp.asarray(rng.integers(0, 10, size=batch).astype(np.int32))
  state = (trainer.params, trainer.rest, trainer.opt_state, train.Metrics.zeros())
  return trainer.steps.train, (*state, images, labels)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="sdgp_timemodel", description=__doc__.splitlines()[0])
  parser.add_argument("--width", type=float, default=0.25, help="ResNet-9 width multiplier")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument(
    "--repeats",
    type=int,
    default=10,
    help="round-robin rounds of the conv parts; the minimum is reported",
  )
  parser.add_argument(
    "--step-rounds", type=int, default=30, help="round-robin rounds of the whole train steps"
  )
  parser.add_argument("--name", default="sdgp_timemodel")
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = "python -m experiments.run sdgp_timemodel " + shlex.join(
    list(argv) if argv is not None else sys.argv[1:]
  )

  def build() -> nnx.Module:
    return models.create(
      "sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=args.width
    )

  layers = conv_layers(build(), (args.batch_size, 32, 32, 3))
  key = jax.random.key(0)
  jobs = {}
  for i, layer in enumerate(layers):
    for part, job in layer_jobs(layer, jax.random.fold_in(key, i)).items():
      jobs[(i, part)] = job
  times = interleaved_times(jobs, args.repeats)
  for i, layer in enumerate(layers):
    layer["times"] = {
      part: times.get((i, part), 0.0) for part in ("forward", "input_grad", "weight_grad")
    }
    print(layer["name"], {k: f"{1e3 * v:.2f} ms" for k, v in layer["times"].items()}, flush=True)

  totals = {
    k: sum(layer["times"][k] for layer in layers) for k in ("forward", "input_grad", "weight_grad")
  }
  conv_total = sum(totals.values())
  share = totals["input_grad"] / conv_total

  step_jobs = {"dense": step_job(build(), args.batch_size)}
  for method in STEP_METHODS:
    model = sdgp.convert_model(build(), n=2, m=4, method=method)
    step_jobs[method] = step_job(model, args.batch_size)
  steps = interleaved_times(step_jobs, args.step_rounds)
  for method in STEP_METHODS:
    print(f"step {method}: {steps[method] / steps['dense']:.3f}x dense", flush=True)

  projections = []
  for n, m in SETTINGS:
    r = m / n
    projected = steps["dense"] - totals["input_grad"] * (1 - 1 / r)
    paper_style = steps["dense"] * (1 - share + share / r)
    projections.append(
      {
        "n": n,
        "m": m,
        "ratio": r,
        "projected_step_s": projected,
        "projected_speedup": steps["dense"] / projected,
        "paper_style_step_s": paper_style,
        "conv_time_s": conv_total - totals["input_grad"] * (1 - 1 / r),
      }
    )

  result = {
    "command": command,
    "width": args.width,
    "batch_size": args.batch_size,
    "layers": [{k: v for k, v in layer.items() if k != "kwargs"} for layer in layers],
    "totals": totals,
    "input_grad_share": share,
    "steps": steps,
    "projections": projections,
  }
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1, default=str))
  _write_markdown(RESULTS / f"{args.name}.md", args, result, command)
  return result


def _write_markdown(
  path: Path, args: argparse.Namespace, result: dict[str, Any], command: str
) -> None:
  date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
  ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
  steps, totals = result["steps"], result["totals"]
  lines = [
    "# SDGP time model (Fig. 9/10) and step overhead — sdgp-resnet9",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()} (2 cores shared with other jobs; each time is the "
    f"minimum over {args.repeats} round-robin rounds of all conv jobs ({args.step_rounds} "
    "for the train steps), which still carries the noise of a shared machine)",
    f"- Reduced for CPU: width ×{args.width}, batch {args.batch_size}, 32×32 inputs (the paper: "
    "full width, batch 512, A100). Each conv part is its own jitted function.",
    "",
    "## Per-layer conv time (ms)",
    "",
    "| layer | input | kernel | forward | dX (input grad) | dW (weight grad) |",
    "|---|---|---|---:|---:|---:|",
  ]
  for layer in result["layers"]:
    t = layer["times"]
    dx = "— (stem)" if layer["lhs"][-1] <= 3 else ms(t["input_grad"])
    lines.append(
      f"| {layer['name']} | {'×'.join(map(str, layer['lhs']))} | "
      f"{'×'.join(map(str, layer['rhs']))} | {ms(t['forward'])} | {dx} | "
      f"{ms(t['weight_grad'])} |"
    )
  conv_total = sum(totals.values())
  lines += [
    f"| **total** | | | {ms(totals['forward'])} | {ms(totals['input_grad'])} | "
    f"{ms(totals['weight_grad'])} |",
    "",
    f"dX share of conv time: **{100 * result['input_grad_share']:.1f}%** "
    f"(paper, ResNet-18 on A100: 33.2%). Conv total {ms(conv_total)} ms.",
    "",
    "## Projected step time with N:M-accelerated dX convs (Fig. 10's method)",
    "",
    f"Dense train step (measured): {ms(steps['dense'])} ms. Projected = dense step − "
    "ΣdX·(1 − n/m); paper-style = dense step · (1 − s + s·n/m) with s the dX share.",
    "",
    "| n:m | ratio m/n | projected step (ms) | speed-up | paper-style step (ms) |",
    "|---|---:|---:|---:|---:|",
  ]
  for p in result["projections"]:
    lines.append(
      f"| {p['n']}:{p['m']} | {p['ratio']:g} | {ms(p['projected_step_s'])} | "
      f"{p['projected_speedup']:.3f}x | {ms(p['paper_style_step_s'])} |"
    )
  lines += [
    "",
    "## Measured SDGP step / dense step on this machine (2:4, no sparse hardware)",
    "",
    "| step | time (ms) | ratio to dense (target ≤ 1.10) |",
    "|---|---:|---:|",
  ]
  for name, seconds in steps.items():
    lines.append(f"| {name} | {ms(seconds)} | {seconds / steps['dense']:.3f} |")
  lines += [
    "",
    "Caveats: SDGP does the dense step's work plus one pass over each conv's output "
    "gradient, so a ratio below 1 would be noise, not a speed-up. On a shared machine the "
    "ratios drift with other jobs' load (runs under heavy load moved by ±0.3); equal-shape "
    "layers (res1/0 vs res1/1, res2/0 vs res2/1) timing alike is a sign of a quiet run. "
    "The per-part conv times are standalone jitted convs; their sum and the step time "
    "need not add up.",
  ]
  path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
