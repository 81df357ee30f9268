"""Per-step cost of the ClickTrain wrapper against the inner optimizer alone.

Times the full jitted train step (forward, backward, optimizer) of a model with
``train.sgd`` alone and with ``jaxprune.clicktrain.clicktrain(train.sgd(...))`` forced into
each training stage (``--mode paper``: warmup, DPPG pool generation, finalization,
regularization, pruned, plus pool / finalization with the importance work every 4th step;
``--mode one_shot``: warmup, regularization, pruned), and the inner optimizer with the pruned
stage's final masks (``optax.chain(sgd, masking.mask(masks))``): what the pruned stage should
cost, since its masks no longer change; and the pruned stage's step as a trainer runs it
after the hard prune (``specialize_pruned``: the stage machine left out). The layers stay
dense and masked here; the step with the aligned or sparse layers is ``step_bench``'s.
Variants are timed in interleaved rounds (the machine is shared); the minimum
and the median per-step time of each are reported with their ratio to the inner
optimizer (target <= 1.05x during pool generation and finalization). Because
contention noise on a shared machine is of the order of the effect, the
optimizer update is also timed alone (same params / gradients, no model): its
extra cost over the inner update, divided by the full inner train step, is the
wrapper's overhead free of the model's noise:

    python -m experiments.run clicktrain_overhead [--model clicktrain-vgg11]
        [--width 0.25] [--batch 64] [--steps 10] [--rounds 5] [--mode paper|one_shot]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxprune
from experiments.common import cli, pages
from experiments.common.machine import machine_description
from jaxprune import masking, models, train
from jaxprune.clicktrain import state as ct_state
from jaxprune.timing import mean_call_s


def _forced(state: ct_state.ClickTrainState, stage: int) -> ct_state.ClickTrainState:
  """The state as it would be in ``stage`` (pool set, masks random but valid)."""
  rng = np.random.default_rng(0)
  layers = {}
  for name, ls in state.layers.items():
    if ls.pool is not None:
      ls = ls._replace(pool=jnp.arange(ls.pool.shape[0], dtype=jnp.int32) * 7)
    keep = jnp.asarray(rng.random(ls.kernel_keep.shape) > 0.5)
    layers[name] = ls._replace(kernel_keep=keep)
  return state._replace(
    stage=jnp.asarray(stage, jnp.int32), layers=layers, last_loss=jnp.float32(2.3)
  )


def _time_variant(step, state, x, y, steps: int) -> float:
  carried = [jax.tree.map(jnp.copy, state)]

  def one_step():
    carried[0] = step(carried[0], x, y)
    return carried[0]

  return mean_call_s(one_step, calls=steps, warmup=0)


def _time_update(update, grads, state, params, loss, steps: int) -> float:
  carried = [state]

  def one_update():
    out, carried[0] = update(grads, carried[0], params, loss)
    return out

  return mean_call_s(one_update, calls=steps)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(prog="clicktrain_overhead", description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="clicktrain-vgg11")
  parser.add_argument("--width", type=float, default=0.25)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument(
    "--mode", choices=("paper", "one_shot"), default="paper", help="ClickTrain's rule"
  )
  parser.add_argument("--name", default="clicktrain_overhead")
  cli.add_publish_argument(parser, "benchmarks/")
  args = parser.parse_args(argv)
  command = cli.command_line("clicktrain_overhead", argv)

  model = models.create(args.model, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=args.width)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(args.batch, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, args.batch), jnp.int32)

  def inner():
    return train.sgd(0.01, momentum=0.9, weight_decay=5e-4)

  def wrapped(every: int):
    return jaxprune.clicktrain.clicktrain(
      inner(),
      steps_per_epoch=10_000,
      hard_prune_epoch=100,
      kernel_prune_ratio=0.5,
      importance_every=every,
      **({"pool_start_epoch": 1} if args.mode == "paper" else {"one_shot_epoch": 1}),
    )

  variants: dict[str, tuple[Any, Any]] = {}
  updates_only: dict[str, tuple[Any, Any]] = {}

  def add(label, tx, stage=None, specialised=False):
    trainer = train.Trainer(model, tx, progress=False, donate=False)
    state = train.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)
    if stage is not None:
      opt_state = _forced(trainer.opt_state, stage)
      if specialised:  # what PrunedStageStep installs after the hard prune
        opt_state = jaxprune.clicktrain.specialize_pruned(opt_state)
      state = state._replace(opt_state=opt_state)
    jax.block_until_ready(trainer.steps.train(state, x, y))  # compile
    variants[label] = (trainer.steps.train, state)
    tx_extra = optax.with_extra_args_support(tx)
    update = jax.jit(lambda g, s, p, l: tx_extra.update(g, s, p, value=l))
    updates_only[label] = (update, state.opt_state)

  add("inner optimizer alone", inner())
  tx1, tx4 = wrapped(1), wrapped(4)
  stages = (ct_state.WARMUP, ct_state.POOL, ct_state.FINALIZE, ct_state.REGULARIZE)
  for stage in stages if args.mode == "paper" else (ct_state.WARMUP, ct_state.REGULARIZE):
    add(f"clicktrain: {ct_state.STAGE_NAMES[stage]}", tx1, stage)
  add("clicktrain: pruned", tx1, ct_state.PRUNED)
  add("clicktrain: pruned, specialised", tx1, ct_state.PRUNED, specialised=True)
  # What the pruned stage should cost: the inner optimizer and the same final masks.
  pruned_state = variants["clicktrain: pruned"][1]
  final_masks = jaxprune.clicktrain.masks(pruned_state.opt_state, pruned_state.params)
  add("inner optimizer + the final masks", optax.chain(inner(), masking.mask(final_masks)))
  if args.mode == "paper":
    add("clicktrain: pool, importance every 4 steps", tx4, ct_state.POOL)
    add("clicktrain: finalize, importance every 4 steps", tx4, ct_state.FINALIZE)

  params = variants["inner optimizer alone"][1][0]
  grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  loss = jnp.float32(2.3)
  times: dict[str, list[float]] = {k: [] for k in variants}
  utimes: dict[str, list[float]] = {k: [] for k in variants}
  for _ in range(args.rounds):
    for label, (step, state) in variants.items():
      times[label].append(_time_variant(step, state, x, y, args.steps))
      update, opt_state = updates_only[label]
      utimes[label].append(_time_update(update, grads, opt_state, params, loss, 4 * args.steps))
  median = {k: float(np.median(v)) for k, v in times.items()}
  best = {k: float(np.min(v)) for k, v in times.items()}
  umin = {k: float(np.min(v)) for k, v in utimes.items()}
  base, base_best = median["inner optimizer alone"], best["inner optimizer alone"]
  implied = {k: 1.0 + (umin[k] - umin["inner optimizer alone"]) / base_best for k in variants}
  result = {
    "model": args.model,
    "mode": args.mode,
    "width": args.width,
    "batch": args.batch,
    "median_step_s": median,
    "min_step_s": best,
    "min_update_s": umin,
    "ratio_median": {k: v / base for k, v in median.items()},
    "ratio_min": {k: v / base_best for k, v in best.items()},
    "ratio_from_update_overhead": implied,
  }

  folder = pages.output_dir("benchmarks", args.publish)
  date = pages.utc_now()
  lines = [
    f"# ClickTrain wrapper overhead: {args.model} (width x{args.width}), batch {args.batch}, "
    f"mode {args.mode}, CPU",
    "",
    f"- Command: `{command}`",
    f"- Date: {date}",
    f"- Machine: {machine_description()} (medians of {args.rounds} interleaved "
    f"rounds of {args.steps} steps)",
    "- Step: the full jitted train step (forward, backward, optimizer update) of "
    "`jaxprune.train`; inner optimizer = `train.sgd(0.01, momentum=0.9, weight_decay=5e-4)`; "
    "the wrapper's state is forced into each stage.",
    "",
    "| variant | median step (ms) | ratio (median) | min step (ms) | ratio (min) "
    "| update alone, min (ms) | ratio from update overhead |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for k in variants:
    lines.append(
      f"| {k} | {1e3 * median[k]:.1f} | {median[k] / base:.3f}x | {1e3 * best[k]:.1f} "
      f"| {best[k] / base_best:.3f}x | {1e3 * umin[k]:.2f} | {implied[k]:.3f}x |"
    )
  lines += [
    "",
    "Last column: 1 + (update time of the variant - update time of the inner "
    "optimizer) / (minimum full train step of the inner optimizer).",
  ]
  (folder / f"{args.name}.md").write_text("\n".join(lines) + "\n")
  (folder / f"{args.name}.json").write_text(json.dumps(result, indent=2))
  print("\n".join(lines), flush=True)
  return result


if __name__ == "__main__":
  main()
