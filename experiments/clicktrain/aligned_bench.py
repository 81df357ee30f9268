"""ClickTrain's pruned convs on the device at hand: aligned vs fine-grained vs dense masked.

After the hard prune every pruned conv is either the dense convolution with its masked kernel
(what training does without a sparse path), the paper's fine-grained pattern-sparse
convolution (:func:`jaxprune.clicktrain.execution.pattern_conv.pattern_conv`), or the aligned
layout (:mod:`jaxprune.clicktrain.execution.aligned_layout`: filters in ``G`` groups share each
kept input channel's pattern; channel gather, static slices, one matrix product per group).
This times, layer by layer on the default device, at ClickTrain's per-layer kernel-prune
ratios (ResNet-32 55/65/75% by stage, VGG-11 35-85%; a library pattern per kept (group,
channel)):

* the forward pass plus both gradients (one jitted ``jax.vjp``) of every distinct
  pruned 3x3 layer of ``clicktrain-vgg11`` and ``clicktrain-resnet32`` (CIFAR, batch 128) and
  of the four 3x3 layers of an ImageNet ResNet-50's stages (batch 64), fp32 and bf16, for the
  dense masked conv, the aligned conv at each ``G`` (for ``G > 1`` with its columns made per
  group and, ``shared``, once for every group: ``aligned_conv(columns=...)``; random masks
  share few (tap, channel) pairs between groups, so they are the shared columns' worst
  case), the aligned conv at ``G = 1`` with its
  kept channels already contiguous (no channel gather: the gather's cost), and with
  ``--fine`` the fine-grained conv.

The whole train step of the pruned models (dense masked, fine-grained, the measured dispatch,
aligned at each ``G`` with per-group and shared columns, in fp32 and bf16) is ``step_bench``'s
ClickTrain suites (``python -m experiments.run step_bench --suites clicktrain
clicktrain-vgg11``), the one whole-step table; the step rows on this command's pages published
before that move are kept as they were measured.

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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from experiments.common import cli, pages
from experiments.common.machine import machine_description
from experiments.common.masks import clicktrain_like_mask, pruned_layers
from jaxprune import models
from jaxprune.clicktrain.config import default_layer_filter
from jaxprune.clicktrain.execution.aligned_conv import COLUMNS, aligned_conv
from jaxprune.clicktrain.execution.aligned_layout import build_aligned_layout
from jaxprune.clicktrain.execution.layer_timing import time_train_pass
from jaxprune.clicktrain.execution.options import default_backend
from jaxprune.clicktrain.execution.pattern_conv import pattern_conv
from jaxprune.clicktrain.execution.pattern_layout import build_layout
from jaxprune.clicktrain.preset import paper_kernel_ratios

_NHWC = ("NHWC", "HWIO", "NHWC")
# The 3x3 convs of an ImageNet ResNet-50's four stages: (H, C), stride 1, batch 64.
_RESNET50_3X3 = ((56, 64), (28, 128), (14, 256), (7, 512))


def _layers(args) -> list[dict[str, Any]]:
  """The distinct pruned layers: kernel, input shape, strides, padding, ratio."""
  layers, seen = [], set()
  for name in args.models:
    model = models.create(
      f"clicktrain-{name}", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=args.width
    )
    ratio_of = paper_kernel_ratios(f"clicktrain-{name}")
    for layer in pruned_layers(model, 32, args.batch):
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
  w = jnp.asarray(rng.normal(size=kshape) * 0.1, cli.DTYPES[dtype])

  def timed(conv):  # forward + both gradients, jitted, at the layer's input shape
    return time_train_pass(conv, spec["input"], w, repeats=args.repeats)

  mask1 = clicktrain_like_mask(kshape, spec["ratio"], rng, groups=1)
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
      else clicktrain_like_mask(kshape, spec["ratio"], rng, groups=g, contiguous=contiguous)
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


def _release_compiled() -> None:
  """Drops the compiled programs of the row just timed. A full run compiles hundreds of layer
  passes; kept, their code mappings exhaust the process's memory maps and a
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
    "in the same run (below 1: faster than dense). The whole train step: `step_bench`.",
    "",
  ]
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
    choices=list(cli.DTYPES),
    help="compute dtypes of the layer rows",
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
  parser.add_argument("--layers", type=int, default=None, help="time only the first N layers")
  parser.add_argument(
    "--small",
    action="store_true",
    help="quarter width, batch 16 (ImageNet 4), 3 repeats, where those flags are not given",
  )
  parser.add_argument("--seed", type=int, default=0, help="seed of the masks, weights and batch")
  cli.add_output_arguments(parser, "benchmarks/")
  args = parser.parse_args(argv)
  cli.fill_defaults(args, _SMALL if args.small else _FULL)
  if min(args.groups) < 1:
    parser.error("--groups must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  out = pages.output_dir("benchmarks", args.publish, args.out)
  rng = np.random.default_rng(args.seed)
  result: dict[str, Any] = {
    "command": cli.command_line("aligned_bench", argv),
    "date": datetime.date.today().isoformat(),
    "machine": machine_description(),
    "repeats": args.repeats,
    "layers": [],
  }
  # One page per platform, so a GPU run and a CPU run each keep their own.
  suffix = f"_{jax.default_backend()}" + ("_small" if args.small else "")

  def save():
    pages.write_result(out / f"aligned_bench{suffix}", result, to_markdown(result))

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
