"""Off-chip memory traffic of the BatchNorm layers (PruneTrain §2.1, §5 "memory traffic").

BatchNorm is bandwidth-bound: PruneTrain reports the bytes it moves, which shrink with the
channel count. :func:`batchnorm_traffic` finds every ``nnx.BatchNorm`` call by tracing and
applies a fixed per-pass traffic model; :func:`layer_flops_and_batchnorm_traffic` returns it
together with :func:`~jaxprune.flops.layer_flops` from one trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.flops._trace import _trace
from jaxprune.flops.layers import LayerFlops, _layers_from_trace


@dataclasses.dataclass(frozen=True)
class BatchNormTraffic:
  """Off-chip memory traffic of one BatchNorm layer (PruneTrain §5, "memory traffic").

  Attributes:
    name: module path of the BatchNorm (``"/"``-joined), or the producing conv's name.
    activation_shape: shape of the normalized activation (whole batch).
    activation_bytes: bytes of that activation.
    forward_bytes: bytes read + written by the forward pass in training.
    backward_bytes: bytes read + written by the backward pass.
    inference_bytes: bytes read + written at inference (running statistics).
  """

  name: str
  activation_shape: tuple[int, ...]
  activation_bytes: int
  forward_bytes: int
  backward_bytes: int
  inference_bytes: int

  @property
  def training_bytes(self) -> int:
    """Bytes moved by this layer per training step (forward + backward)."""
    return self.forward_bytes + self.backward_bytes


# Element passes of one BatchNorm over its activation (PruneTrain §2.1: normalization layers
# "read their inputs multiple times"). Forward: read x for the statistics, read x again to
# normalize, write y. Backward: read dy and x to reduce dγ, dβ; read dy and x again and write dx.
# Inference: read x, write y (running statistics). PruneTrain reports *relative* savings, which
# do not depend on these constants as long as every BN uses the same ones.
_BN_FORWARD_PASSES = 3
_BN_BACKWARD_PASSES = 5
_BN_INFERENCE_PASSES = 2


def batchnorm_traffic(
  model_or_fn: Any,
  input_shape: Sequence[int],
  *,
  params: Any = None,
  input_dtype: Any = jnp.float32,
) -> list[BatchNormTraffic]:
  """Off-chip bytes moved by the BatchNorm layers per step (PruneTrain §5 memory traffic).

  For an NNX model every ``nnx.BatchNorm`` call is found by tracing (its activation shape and
  dtype are recorded). For a plain ``fn(params, x)`` a BatchNorm is assumed after every conv,
  on the conv's output.

  Traffic model per layer with an activation of ``A`` bytes: forward ``3A`` (read x for the
  statistics, read x to normalize, write y), backward ``5A`` (read dy and x for dγ/dβ, read dy
  and x and write dx), inference ``2A``.

  Args:
    model_or_fn: NNX model, or ``fn(params, x)`` with ``params=``.
    input_shape: input batch shape.
    params: params of a plain ``fn``.
    input_dtype: dtype of the traced input.

  Returns:
    One :class:`BatchNormTraffic` per BatchNorm call, in execution order.
  """
  return layer_flops_and_batchnorm_traffic(
    model_or_fn, input_shape, params=params, input_dtype=input_dtype
  )[1]


def layer_flops_and_batchnorm_traffic(
  model_or_fn: Any,
  input_shape: Sequence[int],
  *,
  params: Any = None,
  input_dtype: Any = jnp.float32,
) -> tuple[list[LayerFlops], list[BatchNormTraffic]]:
  """:func:`layer_flops` and :func:`batchnorm_traffic` from one trace of the forward pass.

  For cost accounting that needs both (``jaxprune.prunetrain.model_costs``): tracing a
  ResNet-32 takes about as long as everything else the accounting does, so tracing once
  instead of twice halves it. The arguments are those of :func:`batchnorm_traffic`.

  Returns:
    ``(layers, traffic)``: what ``layer_flops`` and ``batchnorm_traffic`` return for the
    same arguments.
  """
  records: list[tuple[int, tuple[int, ...], Any]] = []
  paths: dict[int, str] = {}
  is_module = isinstance(model_or_fn, nnx.Module)
  closed, leaves, input_index = _trace(
    model_or_fn,
    input_shape,
    params,
    input_dtype,
    batchnorm_records=records if is_module else None,
    batchnorm_paths=paths if is_module else None,
  )
  layers = _layers_from_trace(closed, leaves, input_index, None)
  if is_module:
    entries = [
      (paths.get(module_id, f"batchnorm#{i}"), shape, dtype)
      for i, (module_id, shape, dtype) in enumerate(records)
    ]
  else:
    out_dtype = np.dtype(input_dtype)
    entries = [
      (layer.name, layer.output_shape, out_dtype) for layer in layers if layer.kind == "conv"
    ]
  traffic = []
  for name, shape, dtype in entries:
    size = math.prod(shape) * np.dtype(dtype).itemsize
    traffic.append(
      BatchNormTraffic(
        name=name,
        activation_shape=tuple(shape),
        activation_bytes=size,
        forward_bytes=_BN_FORWARD_PASSES * size,
        backward_bytes=_BN_BACKWARD_PASSES * size,
        inference_bytes=_BN_INFERENCE_PASSES * size,
      )
    )
  return layers, traffic
