"""Does a reconfigured (smaller, dense) model train faster in proportion to its FLOPs?

PruneTrain's speed-up comes from training a smaller dense network after each
reconfiguration (§4.2).  This benchmark takes a CIFAR ResNet (default ResNet-32), kills a
fraction of the channels of every channel tensor (zeroing all their writer and reader
groups, as group lasso would), reconfigures it with :func:`jaxprune.prunetrain.reconfigure`
and times the jitted training step (forward, backward, SGD-momentum update; the trainer's
own step function) of the dense and the pruned model in the same run, interleaved, at the
same batch size.  The measured time ratio is put beside the training-FLOP ratio
(:mod:`jaxprune.flops`); target: time ratio within 1.25x of the FLOP ratio.

    python -m experiments.run prunetrain_speed [--model prunetrain-resnet32] [--keep 0.75 0.5 0.25] \
        [--run runs/prunetrain/table1_cpu_resnet32.json] [--publish]

Writes ``runs/prunetrain/probes/speed{--name-suffix}.{md,json}``, or to
``experiments/results/prunetrain/probes/`` with ``--publish``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import cli, pages
from experiments.common.machine import host_steal_seconds, machine_description, steal_since
from experiments.common.masks import kill_channels
from experiments.common.op_profile import KINDS, op_seconds_by_kind
from jaxprune import flops, models, train
from jaxprune import prunetrain as pt
from jaxprune.timing import mean_call_s


def _round_spec(spec: Any, multiple: int, dense_spec: Any) -> Any:
  """A ResNet spec with every width rounded up to ``multiple`` (capped at the dense width)."""
  if not hasattr(spec, "map_widths"):
    raise ValueError(f"--channel-multiple: only ResNet specs are supported, got {spec!r}")
  return spec.map_widths(lambda width, cap: pt.rounded_width(width, multiple, cap), dense_spec)


class _Timed:
  """The trainer's jitted train step for one model, with its own state copies."""

  def __init__(self, model: nnx.Module, batch: int, image_shape: tuple[int, ...]):
    self.batch, self.image_shape = batch, image_shape
    _, _, params, rest = train.split_model(model)
    # The step donates its inputs: copy, so the model's own arrays stay valid.
    params, rest = jax.tree.map(jnp.copy, (params, rest))
    self.tx = train.sgd(0.01, momentum=0.9, weight_decay=5e-4)
    self.steps = train.step_functions(train.step_settings(model, self.tx))
    self.state = train.TrainState.start(params, rest, self.tx.init(params))
    rng = np.random.default_rng(0)
    self.images = jnp.asarray(rng.normal(size=(batch, *image_shape)).astype(np.float32))
    self.labels = jnp.asarray(rng.integers(0, 10, size=batch).astype(np.int32))
    self.run(2)  # compile + warm up

  def memory(self, batch: int) -> int:
    """XLA's memory analysis of this step compiled at ``batch`` (what §4.3 budgets)."""
    params, rest, opt_state, _ = self.state
    return train.train_step_memory(self.steps, params, rest, opt_state, self.image_shape, batch)[
      "total"
    ]

  def run(self, steps: int) -> tuple[float, float]:
    """Wall-clock and process-CPU seconds per step over ``steps`` steps."""
    cpu_start = time.process_time()

    def step():
      self.state = self.steps.train(self.state, self.images, self.labels)
      return self.state

    wall = mean_call_s(step, calls=steps, warmup=0)
    return wall, (time.process_time() - cpu_start) / steps

  def op_profile(self, steps: int) -> dict[str, float]:
    """Op-seconds per step by kind of XLA op (:mod:`experiments.common.op_profile`)."""
    compiled = self.steps.train.lower(self.state, self.images, self.labels).compile()

    def run():
      self.state = compiled(self.state, self.images, self.labels)
      return self.state

    return op_seconds_by_kind(run, compiled.as_text(), steps)


def _time_row(
  label: str,
  keep: float | None,
  params: int,
  flop_ratio: float,
  dense: _Timed,
  pruned: _Timed,
  args: argparse.Namespace,
) -> dict[str, Any]:
  """Interleaved timing of ``pruned`` against ``dense``; ratios are per training image.

  Wall time is what a user waits for, but on a shared virtual machine the hypervisor's
  steal time stretches it by tens of percent from one block to the next; the process CPU
  time (all threads) is the work done and is not stretched, so both ratios are reported,
  with the steal time seen during the row.
  """
  dense_times, pruned_times, dense_cpu, pruned_cpu = [], [], [], []
  steal_start = host_steal_seconds()
  for _ in range(args.repeats):  # interleaved, so load changes hit both alike
    wall, cpu = dense.run(args.steps)
    dense_times.append(wall)
    dense_cpu.append(cpu)
    wall, cpu = pruned.run(args.steps)
    pruned_times.append(wall)
    pruned_cpu.append(cpu)
  steal = steal_since(steal_start)
  dense_time, pruned_time = statistics.median(dense_times), statistics.median(pruned_times)
  time_ratio = (pruned_time / pruned.batch) / (dense_time / dense.batch)
  cpu_ratio = (statistics.median(pruned_cpu) / pruned.batch) / (
    statistics.median(dense_cpu) / dense.batch
  )
  return {
    "label": label,
    "keep": keep,
    "params": params,
    "batch": pruned.batch,
    "train_flops_ratio": flop_ratio,  # per image, so the same at any batch
    "time_ratio": time_ratio,
    "time_over_flops": time_ratio / flop_ratio,
    "cpu_time_ratio": cpu_ratio,
    "cpu_time_over_flops": cpu_ratio / flop_ratio,
    "dense_step_s": dense_time,
    "pruned_step_s": pruned_time,
    "dense_times": dense_times,
    "pruned_times": pruned_times,
    "dense_cpu_times": dense_cpu,
    "pruned_cpu_times": pruned_cpu,
    "host_steal_s": steal,
  }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="prunetrain_speed", description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="prunetrain-resnet32")
  parser.add_argument(
    "--keep",
    type=float,
    nargs="*",
    default=[0.75, 0.5, 0.25],
    help="fractions of the channels kept in the uniform rows (none: only --run rows)",
  )
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--steps", type=int, default=3, help="steps per timing block")
  parser.add_argument("--repeats", type=int, default=5, help="interleaved timing blocks")
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument(
    "--run",
    nargs="*",
    default=[],
    help="prunetrain_table1 result JSON files: also time each run's final reconfigured model",
  )
  parser.add_argument(
    "--channel-multiple",
    type=int,
    default=None,
    help="with --run: also time the run's model with every width rounded up to this multiple "
    "(what reconfigure(channel_multiple=...) would keep)",
  )
  parser.add_argument(
    "--grown-batch",
    action="store_true",
    help="also time every pruned model at the batch PruneTrain's dynamic mini-batch grows "
    "it to (+32 while the step's memory fits the dense step's) and compare time per image",
  )
  parser.add_argument("--max-batch-size", type=int, default=1024, help="cap of --grown-batch")
  parser.add_argument(
    "--op-profile",
    action="store_true",
    help="also trace the dense and every pruned step (at --batch-size) with jax.profiler and "
    "split the op time into convolution / dot, transpose / copy and elementwise / reduction",
  )
  parser.add_argument("--name-suffix", default="", help="appended to the result file names")
  cli.add_publish_argument(parser, "prunetrain/")
  args = parser.parse_args(argv)
  if not args.keep and not args.run:
    parser.error("nothing to time: give --keep fractions or --run files")
  if any(not 0 < k <= 1 for k in args.keep):
    parser.error("--keep values must be in (0, 1]")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  command = cli.command_line("prunetrain_speed", argv)
  image_shape = (args.image_size, args.image_size, 3)
  input_shape = (args.batch_size, *image_shape)
  dense_model = models.create(args.model, num_classes=10, rngs=nnx.Rngs(0))
  dense_flops = flops.training_flops_per_step(dense_model, input_shape)
  dense = _Timed(dense_model, args.batch_size, image_shape)
  candidates = []  # (label, keep or None, reconfigured model)
  for keep in args.keep:
    model = nnx.clone(dense_model)
    kill_channels(model, keep)
    pruned_model, _, _ = pt.reconfigure(model, None, input_shape=(1, *image_shape))
    candidates.append((f"{100 * keep:.0f}% (uniform)", keep, pruned_model))
  for path in args.run:
    run = json.loads(Path(path).read_text())
    if run["args"]["model"] != args.model:
      raise ValueError(f"--run: {path} trained {run['args']['model']}, not {args.model}")
    spec = train.decode_spec(run["runs"]["prunetrain"]["final_spec_json"])
    pruned_model = type(dense_model)(spec, num_classes=10, rngs=nnx.Rngs(0))
    candidates.append((f"PruneTrain run {Path(path).stem}", None, pruned_model))
    if args.channel_multiple:
      rounded = _round_spec(spec, args.channel_multiple, dense_model.spec)
      candidates.append(
        (
          f"same, widths rounded up to x{args.channel_multiple}",
          None,
          type(dense_model)(rounded, num_classes=10, rngs=nnx.Rngs(0)),
        )
      )
  rows = []
  for label, keep, pruned_model in candidates:
    params = sum(np.size(x) for x in jax.tree.leaves(nnx.state(pruned_model, nnx.Param)))
    flop_ratio = flops.training_flops_per_step(pruned_model, input_shape) / dense_flops
    pruned = _Timed(pruned_model, args.batch_size, image_shape)
    timed = [(label, pruned)]
    if args.grown_batch:
      # PruneTrain §4.3: the batch grows into the memory the reconfiguration freed.
      grown = pt.grow_batch_size(
        pruned.memory,
        args.batch_size,
        dense.memory(args.batch_size),
        granularity=32,
        max_batch_size=args.max_batch_size,
      )
      if grown > args.batch_size:
        timed.append((f"{label}, dynamic mini-batch", _Timed(pruned_model, grown, image_shape)))
    for row_label, candidate in timed:
      rows.append(_time_row(row_label, keep, params, flop_ratio, dense, candidate, args))
      rows[-1]["spec"] = repr(pruned_model.spec)
      if args.op_profile and candidate is pruned:
        rows[-1]["dense_op_s"] = dense.op_profile(args.steps * args.repeats)
        rows[-1]["pruned_op_s"] = pruned.op_profile(args.steps * args.repeats)
      print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("times")}), flush=True)
  result = {
    "args": vars(args),
    "command": command,
    "dense_train_flops": dense_flops,
    "dense_params": sum(np.size(x) for x in jax.tree.leaves(nnx.state(dense_model, nnx.Param))),
    "rows": rows,
  }
  _write(result, args)
  return result


def _write(result: dict[str, Any], args: argparse.Namespace) -> None:
  # A measurement beside the table, not a row of it: the probes' folder.
  folder = pages.probes_dir(pages.output_dir("prunetrain", args.publish))
  date = pages.utc_now()
  machine = machine_description()
  result = {**result, "date": date, "machine": machine}
  name = f"speed{args.name_suffix}"
  (folder / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
  (folder / f"{name}.md").write_text("\n".join(_markdown(result, args)) + "\n")


def _markdown(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
  """The results table of ``result`` (as written to the JSON), one line per item."""
  command, date, machine = result["command"], result["date"], result["machine"]
  lines = [
    f"# PruneTrain: training-step time after reconfiguration vs FLOPs ({args.model})",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}; machine: {machine}",
    f"- Jitted train step (forward + backward + SGD momentum), dense at batch "
    f"{args.batch_size}, {args.image_size}x{args.image_size} images; median of "
    f"{args.repeats} interleaved blocks of {args.steps} steps. Uniform rows: that fraction "
    "of the channels kept, killed at random in every channel tensor, then "
    "`jaxprune.prunetrain.reconfigure`; run rows: the final model of a PruneTrain run "
    "(`--run`). Dynamic mini-batch rows: the same model at the batch PruneTrain §4.3 grows "
    "it to (+32 while XLA's memory analysis of the step stays within the dense step's). "
    "Time and FLOP ratios are per training image. Wall time is what one waits for; CPU "
    "time is the process's CPU seconds (all threads), which the host's steal time does not "
    "stretch (steal seen during each row in the last column; CPU-seconds over both cores).",
    f"- Dense: {result['dense_params']:,} params, "
    f"{result['dense_train_flops'] / 1e9:.2f} GFLOPs per step.",
    "",
    "| model | params | batch | train FLOPs ratio | wall-time ratio | wall / FLOPs "
    "(target ≤ 1.25) | CPU-time ratio | CPU / FLOPs | dense step (ms) | pruned step (ms) "
    "| steal (s) |",
    "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in result["rows"]:
    steal = r.get("host_steal_s")
    lines.append(
      f"| {r['label']} | {r['params']:,} | {r.get('batch', args.batch_size)} "
      f"| {r['train_flops_ratio']:.3f} "
      f"| {r['time_ratio']:.3f} | {r['time_over_flops']:.2f} "
      f"| {r['cpu_time_ratio']:.3f} | {r['cpu_time_over_flops']:.2f} "
      f"| {1e3 * r['dense_step_s']:.1f} | {1e3 * r['pruned_step_s']:.1f} "
      f"| {'—' if steal is None else f'{steal:.1f}'} |"
    )
  return lines + _op_profile_lines(result["rows"])


def _op_profile_lines(rows: list[dict[str, Any]]) -> list[str]:
  """The ``--op-profile`` table: per kind of op, pruned / dense op time and its share."""
  rows = [r for r in rows if "pruned_op_s" in r]
  if not rows:
    return []
  lines = [
    "",
    "Op time by kind (`--op-profile`: one `jax.profiler` trace of "
    "`--steps` x `--repeats` steps each, summed op durations per step): the pruned / dense "
    "ratio of each kind, beside the FLOP ratio, and each kind's share of the step's op time "
    "(dense → pruned).",
    "",
    "| model | train FLOPs ratio | op time dense → pruned (ms) | op-time ratio | "
    + " | ".join(f"{kind} ratio" for kind in KINDS)
    + " | "
    + " | ".join(f"{kind} share" for kind in KINDS)
    + " |",
    "|---:" * (4 + 2 * len(KINDS)) + "|",
  ]
  for r in rows:
    dense, pruned = r["dense_op_s"], r["pruned_op_s"]
    dense_total, pruned_total = sum(dense.values()), sum(pruned.values())
    lines.append(
      f"| {r['label']} | {r['train_flops_ratio']:.3f} "
      f"| {1e3 * dense_total:.0f} → {1e3 * pruned_total:.0f} | {pruned_total / dense_total:.3f} | "
      + " | ".join(f"{pruned[k] / dense[k]:.3f}" if dense[k] else "—" for k in KINDS)
      + " | "
      + " | ".join(
        f"{100 * dense[k] / dense_total:.0f}% → {100 * pruned[k] / pruned_total:.0f}%"
        for k in KINDS
      )
      + " |"
    )
  return lines


if __name__ == "__main__":
  main()
