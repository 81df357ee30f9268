"""Pattern-sparse convolution vs the dense convolution, layer by layer (ClickTrain §5.1-5.2).

For every pruned conv of ``clicktrain-resnet32`` and ``clicktrain-vgg11`` (the layers
ClickTrain prunes: every conv but the stem and the 1x1 shortcuts), at ClickTrain-like masks
(a 4-of-9 pattern of the authors' 12-pattern library per kernel; the paper's per-layer
kernel-prune ratios, ResNet-32 55/65/75% by stage, VGG-11 35-85%: about 9x compression),
it times on the machine at hand, with the layer's real input shape:

* the forward pass, the data gradient and the weight gradient of the sparse path
  (:func:`jaxprune.clicktrain.execution.pattern_conv.pattern_conv_values` with ``--backend``)
  against the dense convolution with the masked kernel (``lax.conv_general_dilated``: XLA / cuDNN);
* the dense → values conversion at fixed positions
  (:func:`jaxprune.clicktrain.execution.pattern_layout.to_values`, the paper's ``Convert2CSR``)
  against ``jax.experimental.sparse.BCSR.fromdense`` of the same filter matrix (the
  ``dense2csr`` analogue).

Times are medians of ``--repeats`` calls of the jitted function after a warm-up call; each
ratio compares two functions timed in the same run. Writes
``runs/benchmarks/pattern_conv_bench<suffix>.{md,json}`` (``--publish``:
``experiments/results/benchmarks/``; ``--out`` to change)::

    python -m experiments.run pattern_conv_bench --publish        # the table in results/
    python -m experiments.run pattern_conv_bench --models vgg11 --batch 4 --repeats 2
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import sparse as jsparse

from experiments.common import cli, masks, pages
from experiments.common.machine import machine_description
from jaxprune import models
from jaxprune.clicktrain.execution.layer_timing import time_layer
from jaxprune.clicktrain.execution.pattern_conv import BACKENDS
from jaxprune.clicktrain.execution.pattern_layout import build_layout, to_values
from jaxprune.clicktrain.preset import paper_kernel_ratios
from jaxprune.timing import median_call_ms

_NHWC = ("NHWC", "HWIO", "NHWC")


def bench_layer(layer: Any, ratio: float, args: argparse.Namespace, rng) -> dict[str, Any]:
  """Times one layer; returns a row of the table."""
  shape = tuple(layer.param_shape)
  mask = masks.clicktrain_like_mask(shape, ratio, rng, balanced=args.balanced)
  layout = build_layout(mask, nnz_per_kernel=None)
  kernel = jnp.asarray(rng.normal(size=shape) * mask, jnp.float32)
  strides, padding = tuple(layer.strides), tuple(tuple(p) for p in layer.padding)

  row: dict[str, Any] = {
    "layer": layer.name.removesuffix("/kernel"),
    "kernel": list(shape),
    "input": list(layer.input_shape),
    "strides": list(strides),
    "ratio": ratio,
    "sparsity": layout.sparsity,
    "width": layout.width,
    "balanced": layout.balanced,
  }
  reps = args.repeats
  row.update(
    time_layer(
      layout,
      layer.input_shape,
      strides=strides,
      padding=padding,
      backend=args.backend,
      repeats=reps,
      seed=int(rng.integers(1 << 31)),
    )
  )
  row["convert_ms"] = median_call_ms(jax.jit(lambda w: to_values(w, layout)), kernel, repeats=reps)
  kh, kw, cin, cout = shape
  filter_matrix = jnp.transpose(kernel, (3, 2, 0, 1)).reshape(cout, cin * kh * kw)
  nse = max(layout.nnz, 1)
  row["bcsr_fromdense_ms"] = median_call_ms(
    jax.jit(lambda m: jsparse.BCSR.fromdense(m, nse=nse)), filter_matrix, repeats=reps
  )
  return row


def _ratio(a: float, b: float) -> str:
  return f"{a / b:.2f}×" if b > 0 else "–"


def to_markdown(result: dict[str, Any]) -> str:
  lines = [
    "# Pattern-sparse convolution vs dense, per pruned layer (ClickTrain §5.1-5.2)",
    "",
    f"Command: `{result['command']}`  ",
    f"Date: {result['date']}  ",
    f"Machine: {result['machine']}  ",
    f"Sparse backend: `{result['backend']}`; batch {result['batch']}; median of "
    f"{result['repeats']} calls after a warm-up; masks: "
    f"{'balanced (equal kernels per filter)' if result['balanced'] else 'layer-wide random kernels'}"
    " with a 4-of-9 library pattern per kernel.",
    "",
    "Ratios are sparse time / dense time (below 1: the sparse path is faster). `convert` is "
    "the dense → values gather at fixed positions; `BCSR` is `jax.experimental.sparse."
    "BCSR.fromdense` of the same filter matrix; the last column is BCSR time / convert time "
    "(above 1: the fixed-position conversion is faster).",
    "",
  ]
  for model_name, rows in result["models"].items():
    lines += [
      f"## {model_name}",
      "",
      "| layer | kernel | input | sparsity | fwd dense / sparse ms | ratio | dX dense / sparse ms "
      "| ratio | dW dense / sparse ms | ratio | convert / BCSR ms | BCSR / convert |",
      "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    tot = dict.fromkeys(["df", "sf", "dx", "sx", "dw", "sw"], 0.0)
    for r in rows:
      lines.append(
        f"| `{r['layer']}` | {'×'.join(map(str, r['kernel']))} | "
        f"{'×'.join(map(str, r['input']))} | {r['sparsity']:.1%} | "
        f"{r['dense_fwd_ms']:.2f} / {r['sparse_fwd_ms']:.2f} | "
        f"{_ratio(r['sparse_fwd_ms'], r['dense_fwd_ms'])} | "
        f"{r['dense_dx_ms']:.2f} / {r['sparse_dx_ms']:.2f} | "
        f"{_ratio(r['sparse_dx_ms'], r['dense_dx_ms'])} | "
        f"{r['dense_dw_ms']:.2f} / {r['sparse_dw_ms']:.2f} | "
        f"{_ratio(r['sparse_dw_ms'], r['dense_dw_ms'])} | "
        f"{r['convert_ms']:.3f} / {r['bcsr_fromdense_ms']:.3f} | "
        f"{_ratio(r['bcsr_fromdense_ms'], r['convert_ms'])} |"
      )
      for key, a, b in (
        ("f", "dense_fwd_ms", "sparse_fwd_ms"),
        ("x", "dense_dx_ms", "sparse_dx_ms"),
        ("w", "dense_dw_ms", "sparse_dw_ms"),
      ):
        tot["d" + key] += r[a]
        tot["s" + key] += r[b]
    dense_all = tot["df"] + tot["dx"] + tot["dw"]
    sparse_all = tot["sf"] + tot["sx"] + tot["sw"]
    lines += [
      f"| **all pruned layers** | | | | {tot['df']:.1f} / {tot['sf']:.1f} | "
      f"{_ratio(tot['sf'], tot['df'])} | {tot['dx']:.1f} / {tot['sx']:.1f} | "
      f"{_ratio(tot['sx'], tot['dx'])} | {tot['dw']:.1f} / {tot['sw']:.1f} | "
      f"{_ratio(tot['sw'], tot['dw'])} | | |",
      "",
      f"Forward + backward over the pruned layers: dense {dense_all:.1f} ms, sparse "
      f"{sparse_all:.1f} ms ({_ratio(sparse_all, dense_all)}).",
      "",
    ]
  return "\n".join(lines)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="pattern_conv_bench", description=__doc__.split("\n")[0])
  parser.add_argument(
    "--models", nargs="+", default=["resnet32", "vgg11"], choices=["resnet32", "vgg11"]
  )
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--width", type=float, default=1.0, help="width multiplier of the models")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--backend", default="reference", choices=[b for b in BACKENDS if b != "dense"]
  )
  parser.add_argument("--balanced", action="store_true", help="equal kernels removed per filter")
  parser.add_argument("--layers", type=int, default=None, help="time only the first N layers")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=Path, default=None, help="folder (default: see --publish)")
  cli.add_publish_argument(parser, "benchmarks/")
  parser.add_argument("--name-suffix", default="")
  args = parser.parse_args(argv)
  if args.out is None:
    args.out = pages.output_dir("benchmarks", args.publish)
  for name in ("batch", "image_size", "repeats"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1")
  if not 0 < args.width <= 1:
    parser.error("--width must be in (0, 1]")
  return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = _parse(argv)
  rng = np.random.default_rng(args.seed)
  result: dict[str, Any] = {
    "command": "python -m experiments.run pattern_conv_bench "
    + " ".join(sys.argv[2:] if argv is None else argv),
    "date": datetime.date.today().isoformat(),
    "machine": machine_description(),
    "backend": args.backend,
    "batch": args.batch,
    "repeats": args.repeats,
    "balanced": args.balanced,
    "models": {},
  }
  for name in args.models:
    model = models.create(
      f"clicktrain-{name}", num_classes=10, rngs=nnx.Rngs(args.seed), width_multiplier=args.width
    )
    ratio_of = paper_kernel_ratios(f"clicktrain-{name}")
    rows = []
    for layer in masks.pruned_layers(model, args.image_size, args.batch)[: args.layers]:
      ratio = ratio_of(layer.name, tuple(layer.param_shape))
      rows.append(bench_layer(layer, ratio, args, rng))
      print(
        f"{name} {rows[-1]['layer']}: fwd {rows[-1]['sparse_fwd_ms'] / rows[-1]['dense_fwd_ms']:.2f}x",
        flush=True,
      )
    result["models"][f"clicktrain-{name}"] = rows
  args.out.mkdir(parents=True, exist_ok=True)
  stem = args.out / f"pattern_conv_bench{args.name_suffix}"
  pages.write_result(stem, result, to_markdown(result))
  print(to_markdown(result))
  return result
