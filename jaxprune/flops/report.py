"""Markdown read-outs of per-layer FLOPs: :func:`format_table` and :func:`model_flops_report`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxprune.flops.layers import LayerFlops, inference_flops, layer_flops, training_flops_per_step
from jaxprune.flops.sparsity import _shape, compression_ratio


def _fmt_shape(shape: Sequence[int] | None) -> str:
  return "—" if shape is None else "×".join(map(str, shape))


def format_table(layers: Sequence[LayerFlops], *, scale: float = 1e6, unit: str = "MFLOPs") -> str:
  """Markdown table of per-layer FLOPs, with a total row.

  Args:
    layers: output of :func:`layer_flops`.
    scale: FLOPs are divided by this before printing.
    unit: the unit name shown in the header.

  Returns:
    A markdown table: layer, kind, kernel, input, output, stride, groups, kept weights,
    forward, backward-data, backward-weight and training FLOPs.
  """
  if scale <= 0:
    raise ValueError(f"scale must be positive, got {scale}")
  header = (
    f"| layer | kind | kernel | input | output | stride | groups | kept weights "
    f"| fwd ({unit}) | bwd-data ({unit}) | bwd-weight ({unit}) | train ({unit}) |"
  )
  rows = [header, "|" + "---|" * 12]
  for layer in layers:
    stride = "—" if layer.strides is None else "×".join(map(str, layer.strides))
    groups = "—" if layer.feature_group_count is None else str(layer.feature_group_count)
    rows.append(
      f"| {layer.name} | {layer.kind} | {_fmt_shape(layer.kernel_shape)} "
      f"| {_fmt_shape(layer.input_shape)} | {_fmt_shape(layer.output_shape)} | {stride} "
      f"| {groups} | {layer.weight_nnz}/{layer.weight_size} "
      f"| {layer.forward / scale:.4g} | {layer.backward_data / scale:.4g} "
      f"| {layer.backward_weight / scale:.4g} | {layer.training / scale:.4g} |"
    )
  fwd = sum(layer.forward for layer in layers)
  bwd_data = sum(layer.backward_data for layer in layers)
  bwd_weight = sum(layer.backward_weight for layer in layers)
  rows.append(
    f"| **total** | | | | | | | {sum(l.weight_nnz for l in layers)}/"
    f"{sum(l.weight_size for l in layers)} | {fwd / scale:.4g} | {bwd_data / scale:.4g} "
    f"| {bwd_weight / scale:.4g} | {(fwd + bwd_data + bwd_weight) / scale:.4g} |"
  )
  return "\n".join(rows)


def model_flops_report(model: nnx.Module, input_shape: Sequence[int], *, masks: Any = None) -> str:
  """Markdown report of a model's costs: per-layer table, totals and compression ratio.

  Args:
    model: an NNX model.
    input_shape: input batch shape (batch 1 gives per-image numbers).
    masks: optional weight masks, see :func:`layer_flops`.

  Returns:
    Markdown text: the per-layer table, inference and training FLOPs for the batch, the
    backward share, the conv compression ratio, and the parameter count.
  """
  layers = layer_flops(model, input_shape, masks=masks)
  params = nnx.state(model, nnx.Param)
  inference = inference_flops(layers)
  training = training_flops_per_step(layers)
  backward_share = 1 - inference / training if training else 0.0
  leaves = jax.tree_util.tree_leaves(params)
  n_params = sum(math.prod(_shape(leaf)) for leaf in leaves)
  # The compression ratio needs weight values; an abstract model (nnx.eval_shape) has none.
  concrete = all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)
  has_conv = any(len(_shape(leaf)) == 4 for leaf in leaves)
  ratio = f"{compression_ratio(params, masks):.3f}×" if has_conv and concrete else "—"
  lines = [
    f"Input batch {_fmt_shape(tuple(input_shape))}; multiply-add = 2 FLOPs.",
    "",
    format_table(layers),
    "",
    f"- inference FLOPs: {inference:,} ({inference / 1e6:.2f} M)",
    f"- training FLOPs per step: {training:,} ({training / 1e6:.2f} M; "
    f"backward share {backward_share:.1%})",
    f"- conv compression ratio: {ratio}",
    f"- parameters: {n_params:,}",
  ]
  return "\n".join(lines)
