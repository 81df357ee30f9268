"""All-reduce bytes per data-parallel step, dense vs ClickTrain's sparse reduction (§5.3).

For each model, ClickTrain's masks are chosen at the paper's per-layer kernel-prune ratios
(the released code's one-shot rule on one batch's gradient; ResNet-32 55 / 65 / 75% by stage,
VGG-11 35, 45, 65, 75, 80, 80, 85%), then one data-parallel train step (a ``jax.shard_map``
over a ``batch`` axis of 4 CPU devices: forward, backward, gradient all-reduce, SGD) is
compiled twice: with the dense reduction and with ``jaxprune.distributed``'s sparse one. The
bytes every all-reduce carries are read from each compiled program's HLO
(``jaxprune.flops.compiled_allreduces``), per layer and in total, beside the ring cost model
(``jaxprune.flops.allreduce_bytes``) and the step time of both programs::

    python -m experiments.run allreduce_bench --num-cpu-devices 4
        [--models clicktrain-resnet32,clicktrain-vgg11] [--batch 16] [--steps 3]
        [--rounds 3] [--publish]

The table goes to ``runs/benchmarks/`` unless ``--publish`` writes it to
``experiments/results/benchmarks/allreduce_bytes.md``.
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
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from experiments.common.masks import clicktrain_to_hard_prune, step_until_pruned
from jaxprune import clicktrain, distributed, flops, masking, models, multihost, train
from jaxprune.paths import path_string
from jaxprune.timing import mean_call_s
from jaxprune.train import data_parallel
from jaxprune.train import step as train_step

NAME = "allreduce_bytes"


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="allreduce_bench", description=__doc__.splitlines()[0])
  parser.add_argument("--models", default="clicktrain-resnet32,clicktrain-vgg11")
  parser.add_argument("--devices", type=int, default=4, help="devices on the batch axis")
  parser.add_argument("--batch", type=int, default=16, help="global batch of the timed step")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per round and variant")
  parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
  parser.add_argument("--seed", type=int, default=0)
  cli.add_output_arguments(parser, "benchmarks/")
  args = parser.parse_args(argv)
  for name in ("devices", "batch", "steps", "rounds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be at least 1")
  if args.batch % args.devices:
    parser.error(f"--batch {args.batch} must be divisible by --devices {args.devices}")
  return args


def one_shot_masks(model: nnx.Module, model_name: str, images, labels) -> Any:
  """ClickTrain's final weight masks at the paper's per-layer ratios (one-shot rule): the
  transform stepped on this batch's gradient until its hard prune, exactly as a run with
  ``steps_per_epoch=1`` would."""
  _, _, params, rest = train_step.split_model(model)
  graphdef = nnx.graphdef(model)
  method, run = clicktrain_to_hard_prune(model_name, mode="one_shot")
  tx = method.make_tx(optax.sgd(0.0), run)
  loss_fn = train_step.default_loss()

  def loss(p):
    return jnp.mean(loss_fn(nnx.merge(graphdef, p, rest)(images), labels))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  state = [tx.init(params)]

  def step():
    _, state[0] = tx.update(grads, state[0], params, value=value)
    return state[0]

  return clicktrain.masks(step_until_pruned(step, run), params)


def bench_model(model_name: str, args: argparse.Namespace, mesh: Mesh) -> dict[str, Any]:
  model = models.create(model_name, num_classes=10, rngs=nnx.Rngs(args.seed))
  rng = np.random.default_rng(args.seed)
  images = rng.normal(size=(args.batch, 32, 32, 3)).astype(np.float32)
  labels = rng.integers(0, 10, args.batch).astype(np.int32)
  masks = one_shot_masks(model, model_name, images, labels)
  _, _, params, rest = train_step.split_model(model)
  params = masking.apply_masks(params, masks)
  indices = distributed.mask_indices(masks)

  variants: dict[str, Any] = {}
  for label, idx in (("dense", None), ("sparse", indices)):
    tx = optax.sgd(0.05, momentum=0.9)
    # The library's data-parallel step: shard_map over the batch axis, the gradients reduced
    # by distributed.allreduce_gradients (sparse with ``indices``) before ``tx``.
    steps = train.step_functions(
      train.step_settings(model, tx, mesh=mesh, indices=idx, donate=False)
    )
    state = steps.replicate(train.TrainState.start(params, rest, tx.init(params)))
    batch = jax.device_put((images, labels), NamedSharding(mesh, P(data_parallel.BATCH_AXIS)))
    arguments = (state, *batch)
    compiled = steps.train.lower(*arguments).compile()
    variants[label] = {
      "fn": compiled,
      "arguments": arguments,
      "hlo": flops.compiled_allreduces(compiled),
    }

  times: dict[str, list[float]] = {"dense": [], "sparse": []}
  for _ in range(args.rounds):
    for label, v in variants.items():
      times[label].append(mean_call_s(v["fn"], *v["arguments"], calls=args.steps))

  dense, sparse = variants["dense"]["hlo"], variants["sparse"]["hlo"]
  sizes = {path_string(kp): int(np.size(leaf)) for kp, leaf in _with_paths(params)}
  kept = {
    path_string(kp): int(np.count_nonzero(m)) for kp, m in _with_paths(masks) if m is not None
  }
  layers = []
  for path, size in sizes.items():
    layers.append(
      {
        "path": path,
        "entries": size,
        "kept": kept.get(path, size),
        "dense_bytes": dense.by_path.get(path, 0),
        "sparse_bytes": sparse.by_path.get(path, 0),
      }
    )
  median = {label: float(np.median(t)) for label, t in times.items()}
  return {
    "model": model_name,
    "devices": args.devices,
    "layers": layers,
    "dense_total_bytes": dense.total_bytes,
    "sparse_total_bytes": sparse.total_bytes,
    "unnamed_bytes": {"dense": dense.by_path.get(None, 0), "sparse": sparse.by_path.get(None, 0)},
    "allreduce_ops": {"dense": len(dense.ops), "sparse": len(sparse.ops)},
    "hlo_ring_bytes": {
      "dense": dense.ring_bytes_per_device,
      "sparse": sparse.ring_bytes_per_device,
    },
    "model_ring_bytes": {
      "dense": flops.allreduce_bytes(params, args.devices),
      "sparse": flops.allreduce_bytes(params, args.devices, masks=masks),
    },
    "compression": flops.compression_ratio(params, masks),
    "step_s": median,
    "step_s_all": times,
    "time_ratio": median["sparse"] / median["dense"],
  }


def _with_paths(tree: Any) -> list:
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]


def _mb(b: float) -> str:
  return f"{b / 1e6:.3f}"


def markdown(results: list[dict[str, Any]], command: str, machine: str, date: str) -> str:
  lines = [
    "# All-reduce bytes per data-parallel step: dense vs ClickTrain's sparse reduction",
    "",
    f"Command: `{command}`  ",
    f"Date: {date}  ",
    f"Machine: {machine}",
    "",
    "ClickTrain §5.3 all-reduces only the kept gradient entries once the masks are final. "
    "Masks: the paper's per-layer kernel-prune ratios (ResNet-32 55 / 65 / 75% by stage; "
    "VGG-11 35, 45, 65, 75, 80, 80, 85%), 4-entry patterns, chosen by the released code's "
    "one-shot rule on one batch's gradient. Each variant's train step (a `jax.shard_map` over "
    "a `batch` axis; forward, backward, gradient all-reduce, SGD) is compiled for 4 CPU "
    "devices; the bytes are the operands of every all-reduce in the compiled HLO "
    "(`jaxprune.flops.compiled_allreduces`), i.e. the gradient payload each device "
    "contributes per step. *Ring, per device* is what a ring all-reduce sends per device, "
    "2 (p − 1) / p × payload, from the HLO and from the cost model "
    "(`jaxprune.flops.allreduce_bytes`).",
    "",
  ]
  for r in results:
    dense, sparse = r["dense_total_bytes"], r["sparse_total_bytes"]
    pruned = [layer for layer in r["layers"] if layer["kept"] < layer["entries"]]
    rest = [layer for layer in r["layers"] if layer["kept"] == layer["entries"]]
    lines += [
      f"## {r['model']} (compression {r['compression']:.2f}x over conv kernels)",
      "",
      "| layer | entries | kept | kept fraction | dense MB | sparse MB | bytes fewer |",
      "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for layer in pruned:
      frac = layer["kept"] / layer["entries"]
      fewer = 1 - layer["sparse_bytes"] / layer["dense_bytes"]
      lines.append(
        f"| `{layer['path']}` | {layer['entries']} | {layer['kept']} | {frac:.3f} | "
        f"{_mb(layer['dense_bytes'])} | {_mb(layer['sparse_bytes'])} | {100 * fewer:.1f}% |"
      )
    unnamed = r["unnamed_bytes"]
    rest_entries = sum(layer["entries"] for layer in rest)
    rest_dense = sum(layer["dense_bytes"] for layer in rest)
    rest_sparse = sum(layer["sparse_bytes"] for layer in rest)
    lines.append(
      f"| {len(rest)} unpruned leaves (stem, shortcuts, BN, classifier) | {rest_entries} | "
      f"{rest_entries} | 1.000 | {_mb(rest_dense)} | {_mb(rest_sparse)} | "
      f"{100 * (1 - rest_sparse / rest_dense):.1f}% |"
    )
    lines.append(
      "| not gradients: BatchNorm running statistics (averaged over the devices), loss, metric "
      f"sums | | | | {_mb(unnamed['dense'])} | {_mb(unnamed['sparse'])} | |"
    )
    entries = sum(layer["entries"] for layer in r["layers"])
    kept = sum(layer["kept"] for layer in r["layers"])
    lines += [
      f"| **total** | {entries} | {kept} | {kept / entries:.3f} | **{_mb(dense)}** | "
      f"**{_mb(sparse)}** | **{100 * (1 - sparse / dense):.1f}%** |",
      "",
      "- Each pruned layer's bytes fall exactly in proportion to its kept entries (bytes "
      "fewer = 1 − kept fraction): the compiled all-reduce carries the compact vector of kept "
      "gradient entries and nothing else of that layer.",
      f"- All-reduce instructions in the compiled step: {r['allreduce_ops']['dense']} dense, "
      f"{r['allreduce_ops']['sparse']} sparse (XLA's combiner merges the per-leaf reductions "
      "into one multi-operand all-reduce).",
      f"- Ring, per device (MB): from the HLO {_mb(r['hlo_ring_bytes']['dense'])} dense / "
      f"{_mb(r['hlo_ring_bytes']['sparse'])} sparse; cost model (`flops.allreduce_bytes`, "
      f"gradients only) {_mb(r['model_ring_bytes']['dense'])} / "
      f"{_mb(r['model_ring_bytes']['sparse'])}. {_model_note(r)}",
      f"- Step time on {r['devices']} CPU devices (median of rounds, global batch "
      f"{_batch(r)}): dense {1e3 * r['step_s']['dense']:.0f} ms, sparse "
      f"{1e3 * r['step_s']['sparse']:.0f} ms, ratio sparse / dense **{r['time_ratio']:.2f}**.",
      "",
    ]
  lines += [
    "The step-time ratio is measured with the 4 CPU devices emulated in one process on a "
    "machine of 2 shared cores: the all-reduce is a memory copy between threads, not network "
    "traffic, so the ratio cannot show the network savings; it shows only what the sparse "
    "reduction costs or saves in computation (the gather of the kept entries and the scatter "
    "back, against reducing the full gradient). The bytes columns are the measure of the "
    "communication saved.",
    "",
  ]
  return "\n".join(lines)


def _model_note(r: dict[str, Any]) -> str:
  """How the HLO's gradient bytes compare with the cost model's, and why."""
  merged = [layer for layer in r["layers"] if layer["dense_bytes"] == 0]
  named = sum(layer["dense_bytes"] for layer in r["layers"])
  model = 4 * sum(layer["entries"] for layer in r["layers"])
  note = "The HLO adds the non-gradient bytes above" + (
    "; its gradient bytes equal the model's."
    if named == model
    else f"; its gradient bytes are {model - named} fewer than the model's: "
    + ", ".join(f"`{layer['path']}`" for layer in merged)
    + " have no all-reduce of their own, because their gradient is the same value as "
    "another leaf's (a projection shortcut's BatchNorm bias and the block's last BatchNorm "
    "bias both receive the block output's gradient summed) and XLA reduces it once."
  )
  return note


def _batch(r: dict[str, Any]) -> int:
  return r.get("batch", 0)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
  args = _parse(argv)
  # Emulated CPU devices must be set before JAX starts (experiments.run's --num-cpu-devices
  # does it too); a JAX already started with another count is a ValueError.
  multihost.initialize({"num_cpu_devices": args.devices})
  mesh = data_parallel.make_mesh(jax.devices("cpu")[: args.devices])
  results = []
  for name in args.models.split(","):
    result = bench_model(name.strip(), args, mesh)
    result["batch"] = args.batch
    results.append(result)
    print(
      f"{name}: dense {result['dense_total_bytes']} B, sparse {result['sparse_total_bytes']} B "
      f"({100 * (1 - result['sparse_total_bytes'] / result['dense_total_bytes']):.1f}% fewer), "
      f"time ratio {result['time_ratio']:.2f}",
      flush=True,
    )
  out_dir = pages.output_dir("benchmarks", args.publish, args.out)
  command = cli.command_line("allreduce_bench", argv)
  date = pages.utc_now()
  (out_dir / f"{NAME}.md").write_text(markdown(results, command, machine_description(), date))
  record = {"command": command, "date": date, "machine": machine_description()}
  (out_dir / f"{NAME}.json").write_text(
    json.dumps({**record, "results": results}, indent=1, default=float)
  )
  print(f"wrote {out_dir / NAME}.md")
  return results


if __name__ == "__main__":
  main()
