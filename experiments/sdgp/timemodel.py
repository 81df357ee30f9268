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

Time-to-accuracy (Fig. 10): the epoch at which each trained n:m cell of ``sdgp_fig8`` (same
budget, read from its JSON) first reaches the target accuracy, times its projected epoch time:
the dense cell's mean measured epoch time scaled by the setting's projected step / dense step.
(The paper rescales the recorded epoch times the same way, for a 94.5% target; on a CPU the
SDGP cells' own epoch times measure the pruning overhead, not sparse hardware, so the dense
epoch is the base.)

    python -m experiments.run sdgp_timemodel --budget cpu [--fig8 PATH] [--publish]

``--budget`` sets the width and batch of the timed model and the target accuracy
(``experiments/common/budgets.py``); writes ``timemodel_<budget>.{md,json}`` to ``runs/sdgp/``, or to
``experiments/results/sdgp/`` with ``--publish``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import budgets, cli, pages
from experiments.common.machine import machine_description
from experiments.sdgp.fig8 import SWEEP as SETTINGS
from jaxprune import models, sdgp, train
from jaxprune.sdgp.timemodel import conv_layers, layer_jobs
from jaxprune.timing import interleaved_times

STEP_METHODS = ("magnitude", "rescaled_magnitude", "mvue")


def step_job(model: nnx.Module, batch: int) -> tuple[Callable, tuple]:
  """The jitted train step (SGD momentum, wd 5e-4, label smoothing 0.1) on a fixed batch."""
  trainer = train.Trainer(
    model, train.sgd(0.1, 0.9, weight_decay=5e-4), label_smoothing=0.1, progress=False, donate=False
  )
  rng = np.random.default_rng(0)
  images = jnp.asarray(rng.normal(size=(batch, 32, 32, 3)).astype(np.float32))
  labels = jnp.asarray(rng.integers(0, 10, size=batch).astype(np.int32))
  state = train.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)
  return trainer.steps.train, (state, images, labels)


def time_to_accuracy(
  cells: Sequence[dict[str, Any]], step_ratio: dict[tuple[int, int], float], target: float
) -> list[dict[str, Any]]:
  """Fig. 10's time-to-accuracy of trained cells.

  Args:
    cells: ``sdgp_fig8`` records (``method``, ``n``, ``m``, ``history`` with per-epoch
      ``test_acc`` and ``epoch_time_s``), one of them ``method == "dense"``.
    step_ratio: ``(n, m)`` -> projected step time / dense step time.
    target: the accuracy to reach (a fraction).

  Returns:
    Per cell: ``epochs`` (the first epoch at or above ``target``, None if never),
    ``epoch_s`` (the dense mean epoch time × the cell's step ratio) and ``tta_s``.

  Raises:
    ValueError: ``cells`` has no dense cell (its epoch time is the base), or a sparse cell's
      setting is not in ``step_ratio``.
  """
  dense = [c for c in cells if c["method"] == "dense"]
  if not dense:
    raise ValueError("cells: no dense cell; its measured epoch time is the base of the projection")
  history = dense[0]["history"]
  dense_epoch = sum(r["epoch_time_s"] for r in history) / len(history)
  out = []
  for cell in cells:
    key = (cell["n"], cell["m"])
    if cell["method"] != "dense" and key not in step_ratio:
      raise ValueError(f"step_ratio: no projection for {key[0]}:{key[1]}")
    ratio = 1.0 if cell["method"] == "dense" else step_ratio[key]
    reached = [r["epoch"] for r in cell["history"] if r["test_acc"] >= target]
    epochs = reached[0] if reached else None
    epoch_s = dense_epoch * ratio
    out.append(
      {
        "method": cell["method"],
        "n": cell["n"],
        "m": cell["m"],
        "epochs": epochs,
        "epoch_s": epoch_s,
        "tta_s": None if epochs is None else epochs * epoch_s,
      }
    )
  return out


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="sdgp_timemodel", description=__doc__.splitlines()[0])
  cli.add_table_arguments(parser, "sdgp_timemodel")
  parser.add_argument(
    "--repeats",
    type=int,
    default=10,
    help="round-robin rounds of the conv parts; the minimum is reported",
  )
  parser.add_argument(
    "--step-rounds", type=int, default=30, help="round-robin rounds of the whole train steps"
  )
  parser.add_argument(
    "--fig8",
    default=None,
    help="sdgp_fig8 JSON for the time-to-accuracy (default: fig8_<budget>.json in the same "
    "folder as this run's output)",
  )
  return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = cli.command_line("sdgp_timemodel", argv)
  budget = budgets.get_budget("sdgp_timemodel", args.budget)
  width, batch_size = budget.width, budget.batch_size
  folder = pages.output_dir("sdgp", args.publish, args.out)

  def build() -> nnx.Module:
    return models.create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=width)

  layers = conv_layers(build(), (batch_size, 32, 32, 3))
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

  step_jobs = {"dense": step_job(build(), batch_size)}
  for method in STEP_METHODS:
    model = sdgp.convert_model(build(), n=2, m=4, method=method)
    step_jobs[method] = step_job(model, batch_size)
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

  fig8 = Path(args.fig8) if args.fig8 else folder / f"fig8_{args.budget}.json"
  tta = None
  if fig8.exists():
    ratios = {(p["n"], p["m"]): p["projected_step_s"] / steps["dense"] for p in projections}
    tta = {
      "source": fig8.name,
      "target_acc": budget["target_acc"],
      "cells": time_to_accuracy(
        json.loads(fig8.read_text())["cells"], ratios, budget["target_acc"]
      ),
    }
  result = {
    "command": command,
    "budget_name": args.budget,
    "budget": dict(budget),
    "time_to_accuracy": tta,
    "width": width,
    "batch_size": batch_size,
    "layers": [{k: v for k, v in layer.items() if k != "kwargs"} for layer in layers],
    "totals": totals,
    "input_grad_share": share,
    "steps": steps,
    "projections": projections,
  }
  name = f"timemodel_{args.budget}"
  (folder / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
  _write_markdown(folder / f"{name}.md", args, result, command)
  return result


def _write_markdown(
  path: Path, args: argparse.Namespace, result: dict[str, Any], command: str
) -> None:
  date = pages.utc_now()
  ms = lambda s: f"{1e3 * s:.2f}"
  steps, totals = result["steps"], result["totals"]
  lines = [
    "# SDGP time model (Fig. 9/10) and step overhead — sdgp-resnet9",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}",
    (
      f"- Machine: {machine_description()} (each time is the minimum over {args.repeats} "
      f"round-robin rounds of all conv jobs ({args.step_rounds} for the train steps), which "
      "damps but does not remove the noise of other jobs on the machine)"
    ),
    (
      f"- Budget: `{args.budget}`: width ×{result['width']}, batch {result['batch_size']}, "
      "32×32 inputs (the paper: full width, batch 512, A100). Each conv part is its own jitted "
      "function."
    ),
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
    (
      f"| **total** | | | {ms(totals['forward'])} | {ms(totals['input_grad'])} | "
      f"{ms(totals['weight_grad'])} |"
    ),
    "",
    (
      f"dX share of conv time: **{100 * result['input_grad_share']:.1f}%** "
      f"(paper, ResNet-18 on A100: 33.2%). Conv total {ms(conv_total)} ms."
    ),
    "",
    "## Projected step time with N:M-accelerated dX convs (Fig. 10's method)",
    "",
    (
      f"Dense train step (measured): {ms(steps['dense'])} ms. Projected = dense step − "
      "ΣdX·(1 − n/m); paper-style = dense step · (1 − s + s·n/m) with s the dX share."
    ),
    "",
    "| n:m | ratio m/n | projected step (ms) | speed-up | paper-style step (ms) |",
    "|---|---:|---:|---:|---:|",
  ]
  for p in result["projections"]:
    lines.append(
      f"| {p['n']}:{p['m']} | {p['ratio']:g} | {ms(p['projected_step_s'])} | "
      f"{p['projected_speedup']:.3f}x | {ms(p['paper_style_step_s'])} |"
    )
  lines += ["", *_tta_lines(result["time_to_accuracy"])]
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
    (
      "Caveats: SDGP does the dense step's work plus one pass over each conv's output "
      "gradient, so a ratio below 1 would be noise, not a speed-up. On a shared machine the "
      "ratios drift with other jobs' load (runs under heavy load moved by ±0.3); equal-shape "
      "layers (res1/0 vs res1/1, res2/0 vs res2/1) timing alike is a sign of a quiet run. "
      "The per-part conv times are standalone jitted convs; their sum and the step time "
      "need not add up."
    ),
  ]
  path.write_text("\n".join(lines) + "\n")


def _tta_lines(tta: dict[str, Any] | None) -> list[str]:
  """The time-to-accuracy section (Fig. 10's right half)."""
  lines = ["## Time-to-accuracy (Fig. 10)", ""]
  if tta is None:
    return lines + [
      (
        "Not computed: no `sdgp_fig8` JSON of this budget beside this page (run "
        "`python -m experiments.run sdgp_fig8` with the same `--budget` and output first)."
      )
    ]
  lines += [
    (
      f"Target {100 * tta['target_acc']:.1f}% test accuracy; cells from "
      f"[{tta['source']}]({tta['source'].removesuffix('.json')}.md). Paper (94.5%, A100, "
      "projected): 4:32 reaches the target 27% faster than 16:32; the dX share is 33.31%."
    ),
    "",
    "| setting | first epoch at target | projected epoch (s) | time-to-accuracy (s) |",
    "|---|---:|---:|---:|",
  ]
  for c in tta["cells"]:
    label = "dense" if c["method"] == "dense" else f"{c['n']}:{c['m']}"
    epochs = "not reached" if c["epochs"] is None else str(c["epochs"])
    tta_s = "—" if c["tta_s"] is None else f"{c['tta_s']:.0f}"
    lines.append(f"| {label} | {epochs} | {c['epoch_s']:.1f} | {tta_s} |")
  return lines


if __name__ == "__main__":
  main()
