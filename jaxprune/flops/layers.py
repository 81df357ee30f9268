"""Per-layer FLOPs of a traced forward pass, and the training / inference totals built on them.

:func:`layer_flops` gives one :class:`LayerFlops` (forward, backward-data, backward-weight) per
conv / dense layer, optionally counting only masked-in weights (ClickTrain §5.2);
:func:`training_flops_per_step` and :func:`inference_flops` sum them (with SDGP's §IV-C
data-gradient density), and :func:`integrate_training_flops` sums a run whose model changes over
time (PruneTrain §3, Fig. 2c). The counting conventions are in :mod:`jaxprune.flops`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.flops._trace import _input_flows, _trace, _Walker
from jaxprune.flops.sparsity import _mask_table, _shape
from jaxprune.paths import ParamPath


@dataclasses.dataclass(frozen=True)
class LayerFlops:
  """FLOPs of one conv / dense layer found in a traced forward pass.

  All counts are for the whole traced input batch, with a multiply-add counted as 2 FLOPs, and
  already multiplied by ``count`` (how often the equation runs, e.g. the length of a ``scan``).

  Attributes:
    name: ``"/"``-joined ``param_path`` (or ``"<kind>#<index>"`` if no parameter feeds it).
    kind: ``"conv"``, ``"dense"``, or ``"matmul"`` (both operands are activations).
    param_path: path of the parameter leaf feeding the weight operand, e.g.
      ``('stages', 0, 0, 'conv1', 'conv', 'kernel')``; ``None`` if none was found.
    param_shape: shape of that parameter leaf (``None`` without a path).
    kernel_shape: shape of the weight operand as the primitive sees it.
    input_shape: shape of the data (activation) operand.
    output_shape: shape of the result.
    strides, padding, lhs_dilation, rhs_dilation, feature_group_count: conv settings
      (``None`` for dense layers).
    count: number of times the equation runs per forward pass.
    weight_size: weights in the parameter leaf feeding the operand (its size for dense counts).
    weight_nnz: weights counted after masking (``weight_size`` without a mask).
    dense_forward: forward FLOPs ignoring the mask.
    forward: forward FLOPs with the mask.
    backward_data: FLOPs of the input gradient; 0 when the input does not depend on any
      parameter (no gradient with respect to the images is computed in training).
    backward_weight: FLOPs of the weight gradient; 0 if the weight is not a parameter.
    has_input_grad: whether the input gradient is computed.
  """

  name: str
  kind: str
  param_path: ParamPath | None
  param_shape: tuple[int, ...] | None
  kernel_shape: tuple[int, ...]
  input_shape: tuple[int, ...]
  output_shape: tuple[int, ...]
  strides: tuple[int, ...] | None
  padding: tuple[tuple[int, int], ...] | None
  lhs_dilation: tuple[int, ...] | None
  rhs_dilation: tuple[int, ...] | None
  feature_group_count: int | None
  count: int
  weight_size: int
  weight_nnz: int
  dense_forward: int
  forward: int
  backward_data: int
  backward_weight: int
  has_input_grad: bool

  @property
  def backward(self) -> int:
    """Backward FLOPs: input gradient plus weight gradient."""
    return self.backward_data + self.backward_weight

  @property
  def training(self) -> int:
    """FLOPs of one training step of this layer: forward + both backward parts."""
    return self.forward + self.backward_data + self.backward_weight


def _layers_from_trace(
  closed: Any, leaves: list[tuple[ParamPath, Any]], input_index: int, masks: Any
) -> list[LayerFlops]:
  walker = _Walker()
  walker.walk(closed.jaxpr, _input_flows(closed.jaxpr, len(leaves), input_index), 1)

  params_by_path = dict(leaves)
  mask_by_path = _mask_table(masks, params_by_path)
  layers = []
  for index, rec in enumerate(walker.records):
    (data_var, data_flow), (weight_var, weight_flow) = rec["data"], rec["weight"]
    kernel_shape = tuple(weight_var.aval.shape)
    macs, count = rec["macs"], rec["count"]
    dense_forward = 2 * macs * count
    both_data = rec["both_data"]
    path = param_shape = None
    weight_size = weight_nnz = math.prod(kernel_shape)
    forward = dense_forward
    if not both_data and weight_flow.origin is not None:
      path, leaf = leaves[weight_flow.origin]
      param_shape = _shape(leaf)
      weight_size = math.prod(param_shape)
      weight_nnz = weight_size
      if path in mask_by_path:
        weight_nnz = int(np.count_nonzero(mask_by_path[path]))
        # macs = rows · (operand size); the operand is the leaf or a scan slice of it, so
        # this is rows · nnz summed over the slices (exact when it is the whole leaf).
        forward = (dense_forward * weight_nnz) // weight_size
    if both_data:
      backward_data = forward * (int(data_flow.param) + int(weight_flow.param))
      backward_weight = 0
      has_input_grad = data_flow.param or weight_flow.param
    else:
      has_input_grad = data_flow.param
      backward_data = forward if has_input_grad else 0
      backward_weight = forward if weight_flow.param else 0
    name = "/".join(map(str, path)) if path is not None else f"{rec['kind']}#{index}"
    layers.append(
      LayerFlops(
        name=name,
        kind=rec["kind"],
        param_path=path,
        param_shape=param_shape,
        kernel_shape=kernel_shape,
        input_shape=tuple(data_var.aval.shape),
        output_shape=rec["out_shape"],
        strides=rec["strides"],
        padding=rec["padding"],
        lhs_dilation=rec["lhs_dilation"],
        rhs_dilation=rec["rhs_dilation"],
        feature_group_count=rec["feature_group_count"],
        count=count,
        weight_size=weight_size,
        weight_nnz=weight_nnz,
        dense_forward=dense_forward,
        forward=forward,
        backward_data=backward_data,
        backward_weight=backward_weight,
        has_input_grad=bool(has_input_grad),
      )
    )
  return layers


def layer_flops(
  model_or_fn: nnx.Module | Callable[[Any, jax.Array], Any],
  input_shape: Sequence[int],
  *,
  masks: Any = None,
  params: Any = None,
  input_dtype: Any = jnp.float32,
) -> list[LayerFlops]:
  """Per-layer forward / backward-data / backward-weight FLOPs, found by tracing.

  Multiply-add = 2 FLOPs. The first layer (any layer whose input does not depend on a trainable
  parameter, i.e. reads the images) gets ``backward_data == 0``: training never computes the
  gradient with respect to the input images. With ``masks``, only nonzero mask entries count.

  Args:
    model_or_fn: a Flax NNX module (called as ``model(x)``; its ``nnx.Param`` state are the
      parameters), or a plain function ``fn(params, x)`` together with ``params=``. Only
      shapes are used, so an abstract model from ``nnx.eval_shape(lambda: Model(...))`` (or
      ``jax.ShapeDtypeStruct`` params) works and allocates nothing.
    input_shape: shape of the input batch, e.g. ``(1, 32, 32, 3)`` for one CIFAR image (NHWC).
      Counts scale with its batch size.
    masks: optional weight masks: a pytree mirroring the params (``nnx.State``, a pure dict;
      ``None`` / missing leaves = unmasked) or a mapping ``{param_path_tuple: mask}``. Each mask
      must have its parameter's shape; nonzero = kept.
    params: the parameter pytree for a plain ``fn``; must be ``None`` for an NNX model.
    input_dtype: dtype of the traced input.

  Returns:
    One :class:`LayerFlops` per ``conv_general_dilated`` / ``dot_general`` that multiplies the
    data by something, in execution order. Products of weights alone (no input dependence)
    are not listed. Inside ``scan`` a layer counts ``length`` times and inside a
    ``pallas_call`` once per grid step; a ``while`` body (unknown trip count) counts once and
    every ``cond`` branch is counted (an upper bound).

  Raises:
    ValueError: ``input_shape`` is malformed or does not fit the model, a mask's shape or path
      does not match the params, or ``model_or_fn`` / ``params`` are inconsistent.

  Example::

    layers = layer_flops(model, (1, 32, 32, 3))
    stem = layers[0]            # stem.backward_data == 0
    print(format_table(layers))
  """
  closed, leaves, input_index = _trace(model_or_fn, input_shape, params, input_dtype)
  return _layers_from_trace(closed, leaves, input_index, masks)


def _as_layers(model_or_layers: Any, input_shape: Any, kwargs: dict[str, Any]) -> list[LayerFlops]:
  if isinstance(model_or_layers, (list, tuple)) and all(
    isinstance(layer, LayerFlops) for layer in model_or_layers
  ):
    if input_shape is not None or any(v is not None for v in kwargs.values()):
      raise ValueError("input_shape / masks / params must be None when passing layers")
    return list(model_or_layers)
  if input_shape is None:
    raise ValueError("input_shape is required when passing a model")
  return layer_flops(model_or_layers, input_shape, **{k: v for k, v in kwargs.items()})


def training_flops_per_step(
  model_or_layers: Any,
  input_shape: Sequence[int] | None = None,
  *,
  masks: Any = None,
  params: Any = None,
  backward_data_density: float = 1.0,
) -> int | float:
  """FLOPs of one training step (forward + backward-data + backward-weight) for the batch.

  Args:
    model_or_layers: a model / ``fn`` (then ``input_shape`` is required, as in
      :func:`layer_flops`) or a list of :class:`LayerFlops` already computed.
    input_shape: input batch shape; use batch 1 for per-image FLOPs.
    masks: weight masks, see :func:`layer_flops`.
    params: the params of a plain ``fn``.
    backward_data_density: fraction of the input-gradient FLOPs that remain, for SDGP's
      accounting (§IV-C: an n:m pruned output gradient scales the data-gradient conv by n/m).
      Applied to conv layers only (SDGP leaves Dense layers dense).

  Returns:
    Total training FLOPs (an ``int`` unless ``backward_data_density`` is fractional).
  """
  if not 0.0 <= backward_data_density <= 1.0:
    raise ValueError(f"backward_data_density must be in [0, 1], got {backward_data_density}")
  layers = _as_layers(model_or_layers, input_shape, dict(masks=masks, params=params))
  total: int | float = 0
  for layer in layers:
    data = layer.backward_data
    if layer.kind == "conv" and backward_data_density != 1.0:
      data = data * backward_data_density
    total += layer.forward + data + layer.backward_weight
  return total


def inference_flops(
  model_or_layers: Any,
  input_shape: Sequence[int] | None = None,
  *,
  masks: Any = None,
  params: Any = None,
) -> int:
  """Forward FLOPs (conv + dense, multiply-add = 2) for the batch ``input_shape``.

  Arguments as in :func:`training_flops_per_step`.
  """
  layers = _as_layers(model_or_layers, input_shape, dict(masks=masks, params=params))
  return sum(layer.forward for layer in layers)


def integrate_training_flops(segments: Iterable[tuple[float, float]]) -> float:
  """Total training FLOPs of a run whose model changes over time.

  PruneTrain (§3, Fig. 2c; Tab. 1 "Train. FLOPs") integrates the per-iteration cost over the run
  while the model shrinks at every reconfiguration; ClickTrain's saving comes from training the
  dense model until the hard-prune epoch and the masked one after it. Both are a sum of
  ``flops_per_image × images`` over the constant-cost segments of the run.

  Args:
    segments: ``(flops_per_image, images)`` pairs, one per segment in which the model is fixed
      (``images`` = epochs in the segment × training-set size). Equivalently
      ``(flops_per_step, steps)``.

  Returns:
    ``Σ flops_per_image · images``.

  Example (PruneTrain, reconfiguration every 10 epochs, 50 000 images per epoch)::

    segments = [(training_flops_per_step(m, (1, 32, 32, 3)), 10 * 50_000) for m in models]
    saving = 1 - integrate_training_flops(segments) / (dense_per_image * 182 * 50_000)
  """
  total = 0.0
  for i, segment in enumerate(segments):
    try:
      per_image, images = segment
    except (TypeError, ValueError) as err:
      raise ValueError(f"segments[{i}] must be a (flops_per_image, images) pair") from err
    if per_image < 0 or images < 0:
      raise ValueError(f"segments[{i}] = {segment!r} has a negative entry")
    total += float(per_image) * float(images)
  return total
