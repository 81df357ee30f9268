"""What one PruneTrain reconfiguration costs in compilation, on this machine.

Every installed reconfiguration (every 10 epochs on CIFAR, §4.2; 18 times at the paper's 182
epochs) brings a new model whose train and eval programs are compiled anew, and the dynamic
mini-batch (§4.3) compiles the new train step once per memory probe.  This measures, for
PruneTrain's ResNet-32 at the cpu budget's width (``experiments/common/budgets.py``:
``prunetrain_table1``), the seconds from the reconfiguration to the end of the new model's
first train step and first evaluation:

- the batch search before (doubling then bisection, one probe per step) and now
  (:func:`jaxprune.prunetrain.grow_batch_size`: an affine fit from two probes and a check);
- without JAX's persistent compilation cache, with it empty (cold) and with it filled by the
  cold run (warm: a rerun, a resumed row) (``experiments/compile_cache.py``).

Each case runs in a fresh process (so nothing stays compiled in memory from another case):
build the dense model, train one step at batch 128, record the dense step's memory (the
budget), make a share of every layer's channels dead (as the group lasso
does), then time :func:`jaxprune.prunetrain.reconfigure`, the batch growth, one train step
at the grown batch and one evaluation.  Wall and CPU seconds are both reported: on a shared
machine other processes stretch wall time.

    python -m experiments.run prunetrain_compile_bench            # about 10 min on 2 cores
    python -m experiments.run prunetrain_compile_bench --publish  # results/benchmarks/

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from experiments.common import budgets, cli, compile_cache, pages
from experiments.common.machine import host_steal_seconds, machine_description, steal_since

_MODEL = "prunetrain-resnet32"
_IMAGE = (32, 32, 3)
_BATCH = 128  # the paper's and the cpu budget's batch
_EVAL_BATCH = 500  # prunetrain_table1's test batch
# (policy, cache) of each case, in the order they run: "cold" empties the cache folder first
# and "warm" reuses what the cold case wrote.
_CASES = (("before", "off"), ("now", "off"), ("now", "cold"), ("now", "warm"))
_STEM = "prunetrain_reconfigure_compile_cpu"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="prunetrain_compile_bench", description=__doc__)
  parser.add_argument("--width", type=float, default=None, help="default: the cpu budget's")
  parser.add_argument(
    "--dead", type=float, default=0.5, help="share of every layer's channels made dead"
  )
  parser.add_argument("--repeats", type=int, default=1, help="runs of every case")
  parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # one case, in a child
  cli.add_output_arguments(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.width is None:
    args.width = float(budgets.get_budget("prunetrain_table1", "cpu")["width"])
  if not 0.0 < args.dead < 1.0:
    raise ValueError(f"dead must be in (0, 1), got {args.dead}")
  if args.repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {args.repeats}")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs every case in its own process and writes the page and JSON.

  Returns:
    The result (also written to ``<folder>/prunetrain_reconfigure_compile_cpu.{md,json}``).

  Raises:
    ValueError: bad arguments.
    RuntimeError: a case's process failed (its error output is included).
  """
  args = _parse(argv)
  if args.case is not None:
    print(json.dumps(_run_case(args)), flush=True)
    return {}
  command = cli.command_line("prunetrain_compile_bench", argv)
  folder = pages.output_dir("benchmarks", args.publish, args.out)
  rows = []
  with tempfile.TemporaryDirectory() as cache_dir:
    for repeat in range(args.repeats):
      for policy, cache in _CASES:
        if cache == "cold":
          for entry in Path(cache_dir).iterdir():
            entry.unlink()
        rows.append({"repeat": repeat, **_child(args, f"{policy},{cache}", cache_dir)})
        print(json.dumps(rows[-1]), flush=True)
  result = {
    "command": command,
    "date": pages.utc_now(),
    "machine": machine_description(),
    "model": _MODEL,
    "width": args.width,
    "dead": args.dead,
    "batch": _BATCH,
    "rows": rows,
  }
  pages.write_result(folder / _STEM, result, _page(result))
  return result


def _child(args: argparse.Namespace, case: str, cache_dir: str) -> dict[str, Any]:
  """One case in a fresh interpreter (the same module with ``--case``)."""
  argv = ["--case", case, "--width", str(args.width), "--dead", str(args.dead)]
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{compile_cache.ENV_VAR: cache_dir})
  done = subprocess.run(
    [sys.executable, "-m", "experiments.run", "prunetrain_compile_bench", *argv],
    capture_output=True,
    text=True,
    env=env,
    cwd=Path(__file__).resolve().parents[2],
    check=False,
  )
  if done.returncode:
    raise RuntimeError(f"case {case} failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


def _run_case(args: argparse.Namespace) -> dict[str, Any]:
  """Times one reconfiguration in this process (see the module docstring)."""
  policy, cache = args.case.split(",")
  if cache != "off":
    compile_cache.enable()  # before anything compiles
  import jax
  import numpy as np
  from flax import nnx

  from experiments.common.masks import kill_channels
  from jaxprune import data, models, train
  from jaxprune import prunetrain as pt
  from jaxprune.prunetrain import dynamic_batch

  if policy == "before":
    dynamic_batch.grow_batch_size = _doubling_then_bisection
  compiles = _CompileCounter(jax)
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (_EVAL_BATCH, *_IMAGE), dtype=np.uint8)
  dataset = data.Dataset.from_arrays(images, rng.integers(0, 10, _EVAL_BATCH), num_classes=10)
  model = models.create(_MODEL, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=args.width)
  trainer = train.Trainer(model, pt.with_group_lasso(train.sgd(0.1, momentum=0.9)), progress=False)
  # The epoch sets the trainer's batch size (the loader's), which the memory budget reads.
  trainer.train_epoch(data.Loader(dataset.subset(slice(0, _BATCH)), _BATCH, shuffle=False))
  batch_policy = pt.DynamicBatch(_IMAGE, max_batch_size=_EVAL_BATCH)
  batch_policy.measure_budget(trainer)
  kill_channels(trainer.model, 1.0 - args.dead)
  probes = _count_calls(trainer, "step_memory")

  compiles.reset()
  cpu, wall, steal = time.process_time(), time.perf_counter(), host_steal_seconds()
  phases = {}
  with _Phase(phases, "reconfigure", compiles):
    new_model, new_opt_state, report = pt.reconfigure(
      trainer.model, trainer.opt_state, count_flops=False
    )
    trainer.replace(new_model, new_opt_state)
  with _Phase(phases, "batch_growth", compiles):
    new_batch = batch_policy.grow(trainer)
  with _Phase(phases, "first_train_step", compiles):
    subset = dataset.subset(slice(0, new_batch))
    trainer.train_epoch(data.Loader(subset, new_batch, shuffle=False))
  with _Phase(phases, "first_eval", compiles):
    trainer.evaluate(data.Loader(dataset, _EVAL_BATCH, shuffle=False))
  return {
    "policy": policy,
    "cache": cache,
    "wall_s": time.perf_counter() - wall,
    "cpu_s": time.process_time() - cpu,
    "steal_s": steal_since(steal),
    "phases": phases,
    "memory_probes": probes[0],
    "new_batch": new_batch,
    "channels_removed": sum(report.channels_removed.values()),
    "compiles": compiles.count,
    "compile_s": compiles.seconds,
    "cache_hits": compiles.hits,
    "load_average": os.getloadavg()[0],
  }


class _CompileCounter:
  """XLA compilations (JAX's backend-compile events, a persistent-cache load included) and
  persistent-cache hits since :meth:`reset`."""

  def __init__(self, jax: Any):
    self.reset()
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)

  def reset(self) -> None:
    self.count, self.seconds, self.hits = 0, 0.0, 0

  def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      self.count += 1
      self.seconds += duration

  def _on_event(self, event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
      self.hits += 1


class _Phase:
  """``with _Phase(phases, name, compiles):`` puts the block's wall seconds and the XLA
  compilations in it (count, seconds; from a :class:`_CompileCounter`) in ``phases[name]``."""

  def __init__(self, phases: dict[str, Any], name: str, compiles: _CompileCounter):
    self.phases, self.name, self.compiles = phases, name, compiles

  def __enter__(self) -> None:
    self.start = time.perf_counter()
    self.count, self.seconds = self.compiles.count, self.compiles.seconds

  def __exit__(self, *exc: object) -> None:
    self.phases[self.name] = {
      "s": time.perf_counter() - self.start,
      "compiles": self.compiles.count - self.count,
      "compile_s": self.compiles.seconds - self.seconds,
    }


def _count_calls(obj: Any, method: str) -> list[int]:
  """Wraps ``obj.method`` to count its calls; returns the one-element counter."""
  counter, inner = [0], getattr(obj, method)

  def counted(*args: Any, **kwargs: Any) -> Any:
    counter[0] += 1
    return inner(*args, **kwargs)

  setattr(obj, method, counted)
  return counter


def _doubling_then_bisection(
  memory_of: Callable[[int], int],
  batch_size: int,
  budget: int,
  *,
  granularity: int = 32,
  max_batch_size: int | None = None,
) -> int:
  """The batch search this measures against: :func:`jaxprune.prunetrain.grow_batch_size`
  before the affine fit (doubling the step count until a probe does not fit, then bisecting;
  one probe, one compilation, per step)."""
  limit = max_batch_size if max_batch_size is not None else 1 << 30
  fits = lambda k: memory_of(batch_size + k * granularity) <= budget
  low, high = 0, (limit - batch_size) // granularity + 1
  probe = 1
  while probe < high:
    if not fits(probe):
      high = probe
      break
    low, probe = probe, 2 * probe
  while high - low > 1:
    middle = (low + high) // 2
    if fits(middle):
      low = middle
    else:
      high = middle
  return batch_size + low * granularity


def _page(result: dict[str, Any]) -> str:
  """The Markdown page of ``result``."""
  rows = result["rows"]
  lines = [
    (
      f"# PruneTrain: compilation of one reconfiguration, {result['model']} "
      f"(width x{result['width']}), CPU"
    ),
    "",
    f"- Command: `{result['command']}`",
    f"- Date: {result['date']}",
    f"- Machine: {result['machine']}",
    (
      "- Timed: from `reconfigure` to the end of the new model's first train step (at the "
      f"grown batch) and first evaluation (batch {_EVAL_BATCH}); {result['dead']:.0%} of every "
      f"layer's channels dead; dense batch {result['batch']}, budget its step's "
      "memory (PruneTrain §4.3). Each row is a fresh process. Seconds per phase: wall "
      "(XLA compiles in it, their seconds)."
    ),
    "",
    (
      "| batch search | compile cache | wall (s) | CPU (s) | reconfigure | batch growth "
      "| first train step | first eval | memory probes | grown batch | XLA compiles "
      "| compile (s) | cache hits | load avg |"
    ),
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  search = {"before": "doubling + bisection", "now": "affine fit + check"}
  for row in rows:
    phases = {
      name: f"{p['s']:.1f} ({p['compiles']}, {p['compile_s']:.1f})"
      for name, p in row["phases"].items()
    }
    lines.append(
      f"| {search[row['policy']]} | {row['cache']} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} "
      f"| {phases['reconfigure']} | {phases['batch_growth']} "
      f"| {phases['first_train_step']} | {phases['first_eval']} "
      f"| {row['memory_probes']} | {row['new_batch']} | {row['compiles']} "
      f"| {row['compile_s']:.1f} | {row['cache_hits']} | {row['load_average']:.1f} |"
    )
  lines += [
    "",
    (
      "XLA compiles: JAX's backend-compile events in the timed part (a program loaded from the "
      "persistent cache counts too, with its load time); cache hits: programs loaded from it. "
      "Load avg: the machine's 1-minute load average at the end of the case (2 cores: above 2, "
      "other processes shared them and wall time stretched)."
    ),
    "",
  ]
  return "\n".join(lines)
