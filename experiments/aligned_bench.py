"""ClickTrain's pruned stage on the device at hand: aligned vs fine-grained vs dense masked.

After the hard prune every pruned conv is either the dense convolution with its masked kernel
(what training does without a sparse path), the paper's fine-grained pattern-sparse
convolution (:func:`jaxprune.clicktrain.execution.pattern_conv.pattern_conv`), or the aligned
layout (:mod:`jaxprune.clicktrain.execution.aligned_layout`: filters in ``G`` groups share each
kept input channel's pattern; channel gather, static slices, one matrix product per group).
This times, on the default device, at ClickTrain's per-layer kernel-prune ratios (ResNet-32
55/65/75% by stage, VGG-11 35-85%; a library pattern per kept (group, channel)):

* per layer, the forward pass plus both gradients (one jitted ``jax.vjp``) of every distinct
  pruned 3x3 layer of ``clicktrain-vgg11`` and ``clicktrain-resnet32`` (CIFAR, batch 128) and
  of the four 3x3 layers of an ImageNet ResNet-50's stages (batch 64), fp32 and bf16, for the
  dense masked conv, the aligned conv at each ``G`` (for ``G > 1`` with its columns made per
  group and, ``shared``, once for every group: ``aligned_conv(columns=...)``; random masks
  share few (tap, channel) pairs between groups, so they are the shared columns' worst
  case), the aligned conv at ``G = 1`` with its
  kept channels already contiguous (no channel gather: the gather's cost), and with
  ``--fine`` the fine-grained conv;
* the whole train step (forward, backward, SGD with the masks kept) of both CIFAR models with
  every pruned conv dense-masked, aligned at each ``G`` (and ``G > 1`` with shared columns),
  with the default measured dispatch (``measured G=...``), and (``--fine``) fine-grained, with the
  model computing in each of ``--dtypes`` (parameters float32; every dtype's rows use the same
  masks and batch).

Times are medians of ``--repeats`` jitted calls after a warm-up, ``block_until_ready`` after
each; every ratio compares two functions timed in the same run. Rows are printed and saved
as they are measured (``aligned_bench_<platform>.json`` and ``.md``), so a run cut short keeps
what it measured::

    python -m experiments.run aligned_bench --publish          # the full table
    python -m experiments.run aligned_bench --small            # minutes on a 2-core CPU
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from experiments import _tables
from experiments._machine import machine_description
from experiments.pattern_conv_bench import _pruned_layers, clicktrain_like_mask
from jaxprune import masking, models, train
from jaxprune.clicktrain import patterns
from jaxprune.clicktrain.config import default_layer_filter
from jaxprune.clicktrain.execution import to_sparse_layers
from jaxprune.clicktrain.execution.aligned_conv import COLUMNS, aligned_conv
from jaxprune.clicktrain.execution.aligned_layout import aligned_mask, build_aligned_layout
from jaxprune.clicktrain.execution.layer_timing import time_train_pass
from jaxprune.clicktrain.execution.options import default_backend
from jaxprune.clicktrain.execution.pattern_conv import pattern_conv
from jaxprune.clicktrain.execution.pattern_layout import build_layout
from jaxprune.clicktrain.preset import paper_kernel_ratios
from jaxprune.paths import path_string
from jaxprune.timing import median_call_ms
from jaxprune.train.step import Metrics, split_model, step_functions

_NHWC = ("NHWC", "HWIO", "NHWC")
# The 3x3 convs of an ImageNet ResNet-50's four stages: (H, C), stride 1, batch 64.
_RESNET50_3X3 = ((56, 64), (28, 128), (14, 256), (7, 512))


def aligned_random_mask(
  shape: Sequence[int], ratio: float, groups: int, rng: np.random.Generator, *, contiguous=False
) -> np.ndarray:
  """An aligned ClickTrain-like mask: per filter group, ``ceil(ratio·Cin)`` input channels
  pruned, a library pattern (3x3; the single tap of 1x1) shared by the group elsewhere.

  ``contiguous``: the kept channels are the first ones, ordered by pattern, so the aligned
  conv needs no channel gather (what folding the order into the previous layer would give).
  """
  kh, kw, cin, cout = shape
  library = patterns.library_patterns() if (kh, kw) == (3, 3) else np.ones((1, kh, kw))
  kept = cin - math.ceil(ratio * cin)
  taps = np.zeros((groups, cin, kh, kw), np.float32)
  for g in range(groups):
    chosen = rng.integers(0, len(library), kept)
    if contiguous:
      taps[g, :kept] = library[np.sort(chosen)]
    else:
      taps[g, rng.permutation(cin)[:kept]] = library[chosen]
  return aligned_mask(taps, cout)


def _layers(args) -> list[dict[str, Any]]:
  """The distinct pruned layers: kernel, input shape, strides, padding, ratio."""
  layers, seen = [], set()
  for name in args.models:
    model = models.create(
      f"clicktrain-{name}", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=args.width
    )
    ratio_of = paper_kernel_ratios(f"clicktrain-{name}")
    for layer in _pruned_layers(model, 32, args.batch):
      path = "/".join(map(str, layer.param_path))
      if default_layer_filter(path, tuple(layer.param_shape)) != "pattern":
        continue
      ratio = ratio_of(path, tuple(layer.param_shape))
      key = (tuple(layer.param_shape), tuple(layer.input_shape), tuple(layer.strides), ratio)
      if key in seen:
        continue
      seen.add(key)
      layers.append(
        {
          "layer": f"{name}/{path.removesuffix('/kernel')}",
          "kernel": tuple(layer.param_shape),
          "input": tuple(layer.input_shape),
          "strides": tuple(layer.strides),
          "padding": tuple(tuple(p) for p in layer.padding),
          "ratio": ratio,
        }
      )
  if args.imagenet:
    for h, c in _RESNET50_3X3:
      c = max(int(c * args.width), 4)
      layers.append(
        {
          "layer": f"resnet50/{h}x{h}x{c}",
          "kernel": (3, 3, c, c),
          "input": (args.imagenet_batch, h, h, c),
          "strides": (1, 1),
          "padding": ((1, 1), (1, 1)),
          "ratio": 0.65,
        }
      )
  return layers


def bench_layer(spec: dict[str, Any], dtype: str, args, rng) -> dict[str, Any]:
  """One layer, one dtype: ms of forward + both gradients per variant."""
  kshape, strides, padding = spec["kernel"], spec["strides"], spec["padding"]
  w = jnp.asarray(rng.normal(size=kshape) * 0.1, _tables.DTYPES[dtype])

  def timed(conv):  # forward + both gradients, jitted, at the layer's input shape
    return time_train_pass(conv, spec["input"], w, repeats=args.repeats)

  mask1 = aligned_random_mask(kshape, spec["ratio"], 1, rng)
  m = jnp.asarray(mask1, w.dtype)
  row = {**spec, "dtype": dtype, "ms": {}}
  row["compression"] = float(np.prod(kshape) / mask1.sum())
  row["ms"]["dense"] = timed(
    lambda x, w: lax.conv_general_dilated(x, w * m, strides, padding, dimension_numbers=_NHWC)
  )
  variants = [(f"aligned G={g}", g, False) for g in args.groups] + [("G=1 no gather", 1, True)]
  for label, g, contiguous in variants:
    if kshape[3] % g:
      continue
    mask = (
      mask1
      if (g == 1 and not contiguous)
      else aligned_random_mask(kshape, spec["ratio"], g, rng, contiguous=contiguous)
    )
    layout = build_aligned_layout(mask, g)
    for columns in COLUMNS if g > 1 and not contiguous else COLUMNS[:1]:
      row["ms"][label + (" shared" if columns == "shared" else "")] = timed(
        lambda x, w, layout=layout, c=columns: aligned_conv(
          x, w, layout, strides=strides, padding=padding, columns=c
        )
      )
  if args.fine:
    layout = build_layout(clicktrain_like_mask(kshape, spec["ratio"], rng), nnz_per_kernel=None)
    backend = default_backend()
    row["ms"][f"fine-grained ({backend})"] = timed(
      lambda x, w: pattern_conv(x, w, layout, strides=strides, padding=padding, backend=backend)
    )
  return row


def _model_masks(model: nnx.Module, name: str, groups: int, rng, *, fine: bool = False) -> Any:
  """Masks for every pruned 3x3 conv of ``model`` (None elsewhere), aligned or fine-grained."""
  ratio_of = paper_kernel_ratios(f"clicktrain-{name}")
  params = nnx.state(model, nnx.Param)

  def leaf_mask(path, leaf):
    p = path_string(path)
    shape = tuple(leaf.shape)
    if default_layer_filter(p, shape) != "pattern":
      return None
    ratio = ratio_of(p, shape)
    if fine:
      return jnp.asarray(clicktrain_like_mask(shape, ratio, rng))
    return jnp.asarray(aligned_random_mask(shape, ratio, groups, rng))

  return jax.tree_util.tree_map_with_path(leaf_mask, nnx.as_pure(params))


def bench_step(name: str, variant: str, args, rng, dtype: str = "fp32") -> tuple[float, float]:
  """ms per train step of ``clicktrain-<name>`` computing in ``dtype`` (a key of
  ``_tables.DTYPES``) with its pruned convs run as ``variant``, and the compression of the
  pruned layers (their weights / kept weights)."""
  model = models.create(
    f"clicktrain-{name}",
    num_classes=10,
    rngs=nnx.Rngs(0),
    width_multiplier=args.width,
    dtype=_tables.compute_dtype(dtype),
  )
  fine = variant.startswith("fine")
  groups = int(variant.split("=")[1].split()[0]) if "G=" in variant else 1
  masks = _model_masks(model, name, groups, rng, fine=fine)
  nnx.update(model, masking.apply_masks(nnx.as_pure(nnx.state(model, nnx.Param)), masks))
  if variant.startswith("aligned"):
    columns = "shared" if variant.endswith("shared") else "per_group"
    to_sparse_layers(model, masks, threshold=0.0, filter_groups=groups, columns=columns)
  elif variant.startswith("measured"):  # the default dispatch: each layer timed both ways
    shape = (args.batch, 32, 32, 3)
    _, choices = to_sparse_layers(model, masks, filter_groups=groups, input_shape=shape)
    print(
      f"  measured dispatch: {sum(c.backend != 'dense' for c in choices)} of "
      f"{len(choices)} layers aligned",
      flush=True,
    )
  elif fine:
    to_sparse_layers(model, masks, threshold=0.0)
  tx = optax.chain(train.sgd(0.05, 0.9, weight_decay=5e-4), masking.mask(masks))
  train_def, eval_def, params, rest = split_model(model)
  steps = step_functions(train_def, eval_def, tx, train.step.default_loss())
  state = [params, rest, tx.init(params), Metrics.zeros()]
  x = jnp.asarray(rng.normal(size=(args.batch, 32, 32, 3)), jnp.float32)
  y = jnp.asarray(rng.integers(0, 10, args.batch), jnp.int32)

  def step():
    state[:] = steps.train(*state, x, y)
    return state[0]

  kept = [np.asarray(m) for m in jax.tree.leaves(masks)]
  compression = sum(m.size for m in kept) / sum(float(m.sum()) for m in kept)
  return median_call_ms(step, repeats=args.repeats), compression


def _release_compiled() -> None:
  """Drops the compiled programs of the row just timed. A full run compiles hundreds of train
  steps and layer passes; kept, their code mappings exhaust the process's memory maps and a
  later compilation fails (XLA:CPU: "LLVM ERROR: Unable to allocate section memory")."""
  jax.clear_caches()
  gc.collect()


def to_markdown(result: dict[str, Any]) -> str:
  lines = [
    "# ClickTrain's pruned stage: aligned vs fine-grained vs dense masked",
    "",
    f"Command: `{result['command']}`  ",
    f"Date: {result['date']}  ",
    f"Machine: {result['machine']}  ",
    f"Median of {result['repeats']} jitted calls after a warm-up; ratio = time / dense masked "
    "in the same run (below 1: faster than dense).",
    "",
  ]
  # Rows saved before the step rows had a dtype were fp32.
  step_dtypes = dict.fromkeys(r.get("dtype", "fp32") for r in result["steps"])
  for dtype in step_dtypes:
    lines += [f"## Whole train step (forward, backward, SGD), {dtype}", ""]
    lines += [
      "| model | variant | pruned layers' compression | ms / step | vs dense |",
      "|---|---|---:|---:|---:|",
    ]
    for r in result["steps"]:
      if r.get("dtype", "fp32") != dtype:
        continue
      lines.append(
        f"| {r['model']} | {r['variant']} | {r['compression']:.1f}× | {r['ms']:.2f} | "
        f"{r['ms'] / r['dense_ms']:.2f}× |"
      )
    lines.append("")
  if result["layers"]:
    variants = sorted({k for r in result["layers"] for k in r["ms"] if k != "dense"})
    lines += [
      "## Per layer: forward + data gradient + weight gradient",
      "",
      "| layer | kernel | input | dtype | compression | dense ms | " + " | ".join(variants) + " |",
      "|---|---|---|---|---:|---:|" + "---:|" * len(variants),
    ]
    for r in result["layers"]:
      cells = [
        f"{r['ms'][v]:.2f} ({r['ms'][v] / r['ms']['dense']:.2f}×)" if v in r["ms"] else "–"
        for v in variants
      ]
      lines.append(
        f"| `{r['layer']}` | {'×'.join(map(str, r['kernel']))} | "
        f"{'×'.join(map(str, r['input']))} | {r['dtype']} | {r['compression']:.1f}× | "
        f"{r['ms']['dense']:.2f} | " + " | ".join(cells) + " |"
      )
    lines.append("")
  return "\n".join(lines)


_FULL = {"width": 1.0, "batch": 128, "imagenet_batch": 64, "repeats": 20}
_SMALL = {"width": 0.25, "batch": 16, "imagenet_batch": 4, "repeats": 3}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="aligned_bench", description=__doc__.split("\n")[0])
  parser.add_argument(
    "--models",
    nargs="+",
    default=["vgg11", "resnet32"],
    type=lambda name: name.removeprefix("clicktrain-"),
    choices=["vgg11", "vgg13", "resnet32"],
    help="CIFAR models by short name (vgg11 = clicktrain-vgg11; the full name works too), "
    "pruned at ClickTrain's per-layer ratios",
  )
  parser.add_argument(
    "--groups",
    type=int,
    nargs="+",
    default=[1, 2, 4],
    help="filter groups G of the aligned rows (each must divide the layers' filters)",
  )
  parser.add_argument(
    "--dtypes",
    nargs="+",
    default=["fp32", "bf16"],
    choices=list(_tables.DTYPES),
    help="compute dtypes of the per-layer and whole-step rows",
  )
  parser.add_argument("--batch", type=int, help="batch of the CIFAR rows (128; --small: 16)")
  parser.add_argument(
    "--imagenet-batch", type=int, help="batch of the ImageNet ResNet-50 layer rows (64; --small: 4)"
  )
  parser.add_argument(
    "--width", type=float, help="width multiplier of the CIFAR models (1; --small: 0.25)"
  )
  parser.add_argument(
    "--repeats", type=int, help="timed calls per row, the median kept (20; --small: 3)"
  )
  parser.add_argument(
    "--no-imagenet",
    dest="imagenet",
    action="store_false",
    help="skip the ImageNet ResNet-50 layer rows",
  )
  parser.add_argument("--fine", action="store_true", help="also time the fine-grained path")
  parser.add_argument(
    "--measured", type=int, nargs="*", default=[1], help="G of the measured-dispatch step rows"
  )
  parser.add_argument(
    "--skip",
    nargs="*",
    default=[],
    choices=["steps", "layers"],
    help="leave out the whole-step rows or the per-layer rows",
  )
  parser.add_argument("--layers", type=int, default=None, help="time only the first N layers")
  parser.add_argument(
    "--small",
    action="store_true",
    help="quarter width, batch 16 (ImageNet 4), 3 repeats, where those flags are not given",
  )
  parser.add_argument("--seed", type=int, default=0, help="seed of the masks, weights and batch")
  _tables.add_output_arguments(parser, "benchmarks/")
  args = parser.parse_args(argv)
  _tables.fill_defaults(args, _SMALL if args.small else _FULL)
  if min(args.groups) < 1:
    parser.error("--groups must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  out = _tables.output_dir("benchmarks", args.publish, args.out)
  rng = np.random.default_rng(args.seed)
  result: dict[str, Any] = {
    "command": _tables.command_line("aligned_bench", argv),
    "date": datetime.date.today().isoformat(),
    "machine": machine_description(),
    "repeats": args.repeats,
    "steps": [],
    "layers": [],
  }
  # One page per platform, so a GPU run and a CPU run each keep their own.
  suffix = f"_{jax.default_backend()}" + ("_small" if args.small else "")

  def save():
    _tables.write_result(out / f"aligned_bench{suffix}", result, to_markdown(result))

  if "steps" not in args.skip:
    for i, dtype in enumerate(args.dtypes):
      # The first dtype draws from the run's generator (as the fp32-only step rows did, so the
      # layer rows after them draw what they drew); each other dtype replays the same draws from
      # a fresh one: the same masks and batch in every dtype.
      step_rng = rng if i == 0 else np.random.default_rng(args.seed)
      for name in args.models:
        variants = ["dense"] + [f"aligned G={g}" for g in args.groups]
        variants += [f"aligned G={g} shared" for g in args.groups if g > 1]
        variants += [f"measured G={g}" for g in args.measured]
        variants += ["fine-grained"] if args.fine else []
        dense_ms = None
        for variant in variants:
          ms, compression = bench_step(name, variant, args, step_rng, dtype)
          _release_compiled()
          dense_ms = ms if variant == "dense" else dense_ms
          result["steps"].append(
            {
              "model": f"clicktrain-{name}",
              "variant": variant,
              "dtype": dtype,
              "compression": compression,
              "ms": ms,
              "dense_ms": dense_ms,
            }
          )
          print(f"step {name} {variant} {dtype}: {ms:.2f} ms ({ms / dense_ms:.2f}x)", flush=True)
          save()
  if "layers" not in args.skip:
    for dtype in args.dtypes:
      for spec in _layers(args)[: args.layers]:
        row = bench_layer(spec, dtype, args, rng)
        _release_compiled()
        result["layers"].append(row)
        ratios = ", ".join(f"{k} {v / row['ms']['dense']:.2f}x" for k, v in row["ms"].items())
        print(f"{row['layer']} {dtype}: dense {row['ms']['dense']:.2f} ms; {ratios}", flush=True)
        save()
  save()
  print(to_markdown(result))
  return result
