"""Train-step dispatch: jaxprune.train's split/merge ``jax.jit`` step vs ``nnx.jit``.

The same model, optimizer (``jaxprune.train.sgd``) and batch are stepped with

* ``jaxprune.train``: the model split once into pure-array states; a plain ``jax.jit`` step
  with donated buffers (NNX graph traversal only at trace time),
* ``nnx.jit``: the usual NNX loop, ``nnx.Optimizer.update(model, grads, value=loss)``
  inside ``nnx.jit`` (graph traversal of model and optimizer on every call),
* ``nnx.cached_partial``: the same ``nnx.jit`` step with the graph traversal cached.

Per-step wall time is measured after warm-up with ``block_until_ready``; small batches
expose the per-call overhead, large ones the compute:

    python -m experiments.run bench_train_step [--steps 200]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from jaxprune import models, train
from jaxprune.timing import mean_call_s


def _model() -> nnx.Module:
  return models.create(
    "prunetrain-resnet20", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.5, in_channels=1
  )


def _tx():
  return train.sgd(0.05, 0.9, weight_decay=5e-4)


def _time(step: Callable[[], object], steps: int) -> float:
  return mean_call_s(step, calls=steps, warmup=2)


def bench_split_merge(x, y, steps: int) -> float:
  trainer = train.Trainer(_model(), _tx())
  state = [train.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)]

  def step():
    state[0] = trainer.steps.train(state[0], x, y)
    return state[0].params

  return _time(step, steps)


def _nnx_step(model, optimizer, x, y):
  def loss_fn(model):
    return train.cross_entropy(model(x), y)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads, value=loss)
  return loss


def bench_nnx_jit(x, y, steps: int, cached: bool) -> float:
  model = _model()
  optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
  jitted = nnx.jit(_nnx_step, donate_argnums=(0, 1))
  if cached:
    call = nnx.cached_partial(jitted, model, optimizer)
    return _time(lambda: call(x, y), steps)
  return _time(lambda: jitted(model, optimizer, x, y), steps)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="bench_train_step", description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch-sizes", default="8,64")
  parser.add_argument("--out", default=None, help="the page (default: train_step_dispatch.md)")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = str(pages.output_dir("benchmarks", args.publish) / "train_step_dispatch.md")
  if args.steps < 1:
    parser.error("--steps must be at least 1")
  return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
  args = _parse(argv)
  rows = []
  rng = np.random.default_rng(0)
  for batch in [int(b) for b in args.batch_sizes.split(",")]:
    x = jnp.asarray(rng.normal(size=(batch, 8, 8, 1)).astype(np.float32))
    y = jnp.asarray(rng.integers(0, 10, batch).astype(np.int32))
    times = {
      "jaxprune.train (split/merge jax.jit)": bench_split_merge(x, y, args.steps),
      "nnx.jit + nnx.Optimizer": bench_nnx_jit(x, y, args.steps, cached=False),
      "nnx.jit + nnx.cached_partial": bench_nnx_jit(x, y, args.steps, cached=True),
    }
    base = times["jaxprune.train (split/merge jax.jit)"]
    for name, seconds in times.items():
      rows.append(
        {"batch": batch, "method": name, "ms_per_step": 1e3 * seconds, "relative": seconds / base}
      )
      print(f"batch {batch}: {name}: {1e3 * seconds:.2f} ms/step", flush=True)
  command = cli.command_line("bench_train_step", argv)
  date = pages.utc_now()
  lines = [
    "# Train-step dispatch: split/merge jax.jit vs nnx.jit",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()}",
    f"- Model: prunetrain-resnet20 at half width on 8x8x1 inputs, SGD momentum + wd; "
    f"{args.steps} timed steps after 2 warm-up steps. Times on a shared machine vary; "
    "compare rows of the same batch.",
    "",
    "| batch | step | ms / step | relative to jaxprune.train |",
    "|---:|---|---:|---:|",
  ]
  lines += [
    f"| {r['batch']} | {r['method']} | {r['ms_per_step']:.2f} | {r['relative']:.2f} |" for r in rows
  ]
  Path(args.out).write_text("\n".join(lines) + "\n")
  return rows


if __name__ == "__main__":
  main()
