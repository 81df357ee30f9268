"""FLOPs, compression, memory-traffic and communication accounting for pruned models.

The three papers report costs differently, and this module gives the pieces for each:

* **PruneTrain** (Lym et al., SC'19, §3 Fig. 2, §5 Tab. 1) reports *training* FLOPs integrated over
  the whole run while the network shrinks at every reconfiguration, inference FLOPs of the final
  model, the memory traffic of the (bandwidth-bound) BatchNorm layers and the ring all-reduce
  volume of the weight gradients (§5, Fig. 11).
  → :func:`training_flops_per_step`, :func:`integrate_training_flops`, :func:`inference_flops`,
  :func:`batchnorm_traffic`, :func:`allreduce_bytes`
  (:func:`layer_flops_and_batchnorm_traffic` gives the FLOPs and the traffic from one trace).
* **ClickTrain** (Zhang et al., ICS'21, Tab. 1) reports the compression ratio over conv layers and
  the training / inference FLOPs saved once the pattern + connectivity masks are hard-pruned.
  → :func:`compression_ratio`, :func:`conv_sparsity`, and every FLOPs function with ``masks=``.
* **SDGP** (arXiv 2022, §IV-C) uses a *time* model: data-gradient convolutions take about a third
  of the conv time and an n:m sparsity divides that share by m/n. The per-layer split into
  forward, backward-data and backward-weight FLOPs in :class:`LayerFlops` is what that model needs
  (see ``backward_data_density`` of :func:`training_flops_per_step`).

Counting conventions (used everywhere in this module):

* One multiply-add is **2 FLOPs**. A conv's forward pass costs
  ``2 · batch · out_h · out_w · kh · kw · (Cin / groups) · Cout``; a dense layer's
  ``2 · rows · Din · Dout``. Padding positions are counted like any other (the usual convention).
* Backward-data (the input gradient, a transposed conv / matmul) and backward-weight (the weight
  gradient) each cost as much as the forward pass.
* A layer whose input does not depend on any trainable parameter (the stem conv that reads the
  image) has **no backward-data cost**: nobody needs the gradient with respect to the input
  images. This is decided from the traced data flow, not from the layer's position.
* With weight masks only the nonzero weights are counted: a masked conv costs
  ``2 · batch · out_h · out_w · nnz(kernel)`` for the forward pass and the same for each backward
  part. ClickTrain §5.2 runs the forward and the data-gradient convs (δ ⊛ rot180(W)) with the
  sparse W; the weight gradient is needed only at the kept positions, so it is counted sparse
  too.

Layers are found by **tracing**: :func:`layer_flops` runs :func:`jax.make_jaxpr` on the forward
pass, walks every ``conv_general_dilated`` and ``dot_general`` equation (also inside ``jit``,
``custom_vjp_call``, ``custom_jvp_call``, ``remat``, ``scan``, ``cond``, ``while`` and
``pallas_call`` bodies) and
follows the weight operand back through shape- and value-preserving operations (mask multiply,
dtype conversion, reshape, transpose, ...) to the parameter leaf that feeds it. So it works for any
Flax NNX model and for any plain ``fn(params, x)``, including SDGP's custom-VJP conv.

Only shapes matter, so the model can be abstract (no weights allocated or initialized)::

    model = nnx.eval_shape(lambda: jaxprune.models.create(
        "prunetrain-resnet32", num_classes=10, rngs=nnx.Rngs(0)))
    layers = flops.layer_flops(model, (1, 32, 32, 3))
    print(flops.format_table(layers))
    per_image = flops.training_flops_per_step(layers)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.paths import ParamPath, flatten_with_paths, param_path

__all__ = [
  "LayerFlops",
  "BatchNormTraffic",
  "layer_flops",
  "training_flops_per_step",
  "inference_flops",
  "integrate_training_flops",
  "format_table",
  "model_flops_report",
  "compression_ratio",
  "conv_sparsity",
  "batchnorm_traffic",
  "layer_flops_and_batchnorm_traffic",
  "allreduce_bytes",
  "param_path",
]



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


# --------------------------------------------------------------------------------------------
# Parameter paths and masks
# --------------------------------------------------------------------------------------------


def _shape(leaf: Any) -> tuple[int, ...]:
  """Shape of an array or of an abstract leaf (``ShapeDtypeStruct`` from ``nnx.eval_shape``)."""
  return tuple(leaf.shape) if hasattr(leaf, "shape") else tuple(np.shape(leaf))


def _dtype(leaf: Any) -> np.dtype:
  return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _mask_table(masks: Any, params_by_path: Mapping[ParamPath, Any]) -> dict[ParamPath, np.ndarray]:
  """Normalizes ``masks`` to ``{param path: bool array}`` and validates it against the params.

  ``masks`` is either a pytree mirroring the params (``None`` leaves / missing entries = no
  mask), or a mapping from parameter path tuples to mask arrays (a "per-layer" mask).
  """
  if masks is None:
    return {}
  if isinstance(masks, Mapping) and masks and all(isinstance(k, tuple) for k in masks):
    items = [(tuple(k), v) for k, v in masks.items() if v is not None]
  else:
    items = flatten_with_paths(masks)
  table: dict[ParamPath, np.ndarray] = {}
  for path, mask in items:
    if path not in params_by_path:
      raise ValueError(f"masks: no parameter at path {path!r}")
    mask = np.asarray(mask)
    expected = _shape(params_by_path[path])
    if mask.shape != expected:
      raise ValueError(
        f"masks: mask at {path!r} has shape {mask.shape}, the parameter has {expected}"
      )
    table[path] = mask != 0
  return table


# --------------------------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------------------------

# Operations through which a weight keeps its identity: they only change dtype / layout or apply
# an elementwise factor of the same size (a pruning mask, weight standardization, conv_transpose's
# kernel flip). Broadcasts are allowed only when they do not grow the array (so a bias broadcast
# onto an activation never inherits the bias's identity).
_PASS_THROUGH = frozenset(
  {
    "convert_element_type",
    "reshape",
    "transpose",
    "copy",
    "copy_p",
    "squeeze",
    "expand_dims",
    "broadcast_in_dim",
    "rev",
    "reduce_precision",
    "neg",
    "mul",
    "div",
    "add",
    "sub",
    "select_n",
    "max",
    "min",
    "sign",
    "abs",
    "optimization_barrier",
    "get",
  }
)


@dataclasses.dataclass(frozen=True)
class _Flow:
  """What is known about one jaxpr value."""

  origin: int | None  # index of the parameter leaf it is a view of
  data: bool  # depends on the input batch
  param: bool  # depends on a trainable parameter


_CONST = _Flow(None, False, False)


def _is_literal(v: Any) -> bool:
  return isinstance(v, jax.extend.core.Literal)


def _sub_jaxprs(value: Any) -> list[Any]:
  """Jaxprs (open) inside one equation parameter value."""
  if isinstance(value, jax.extend.core.ClosedJaxpr):
    return [value.jaxpr]
  if isinstance(value, jax.extend.core.Jaxpr):
    return [value]
  if isinstance(value, (tuple, list)):
    return [j for item in value for j in _sub_jaxprs(item)]
  return []


class _Walker:
  """Walks a jaxpr, propagating :class:`_Flow` facts and recording conv / dot layers."""

  def __init__(self) -> None:
    self.records: list[dict[str, Any]] = []

  def walk(self, jaxpr: Any, flows: Sequence[_Flow], count: int) -> list[_Flow]:
    env: dict[Any, _Flow] = dict(zip(jaxpr.invars, flows))
    for v in jaxpr.constvars:
      env[v] = _CONST

    def read(v: Any) -> _Flow:
      return _CONST if _is_literal(v) else env.get(v, _CONST)

    for eqn in jaxpr.eqns:
      ins = [read(v) for v in eqn.invars]
      outs = self._equation(eqn, ins, count)
      for v, flow in zip(eqn.outvars, outs):
        env[v] = flow
    return [read(v) for v in jaxpr.outvars]

  def _equation(self, eqn: Any, ins: list[_Flow], count: int) -> list[_Flow]:
    name = eqn.primitive.name
    any_data = any(f.data for f in ins)
    any_param = any(f.param for f in ins)
    merged = _Flow(None, any_data, any_param)
    if name == "conv_general_dilated":
      self._record_conv(eqn, ins, count)
      return [merged]
    if name == "dot_general":
      self._record_dot(eqn, ins, count)
      return [merged]
    subs = {k: _sub_jaxprs(v) for k, v in eqn.params.items()}
    subs = {k: v for k, v in subs.items() if v}
    if subs:
      return self._nested(eqn, ins, subs, count, merged)
    if name == "stop_gradient":
      # No gradient flows back through it: what follows needs no gradient for it.
      return [_Flow(ins[0].origin, ins[0].data, False)]
    if name in _PASS_THROUGH and len(eqn.outvars) == 1:
      return [_Flow(self._pass_origin(eqn, ins), any_data, any_param)]
    return [merged] * len(eqn.outvars)

  def _pass_origin(self, eqn: Any, ins: list[_Flow]) -> int | None:
    out_size = math.prod(eqn.outvars[0].aval.shape)
    if any(f.data for f in ins):
      return None
    for v, f in zip(eqn.invars, ins):
      if f.origin is not None and math.prod(v.aval.shape) == out_size:
        return f.origin
    return None

  def _nested(
    self, eqn: Any, ins: list[_Flow], subs: dict[str, list[Any]], count: int, merged: _Flow
  ) -> list[_Flow]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    if name == "scan":
      # Carries may pick up data / parameter dependence in later iterations: be
      # conservative and give every carry the union of all inputs.
      n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
      carry = [merged] * n_carry
      # Scanned-over inputs keep their origin: a stacked kernel sliced per layer.
      flows = ins[:n_consts] + carry + ins[n_consts + n_carry :]
      self.walk(subs["jaxpr"][0], flows, count * int(eqn.params["length"]))
      return [merged] * n_out
    if name == "while":
      # Trip count unknown at trace time: the body is counted once (documented).
      nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      carry = [merged] * (len(ins) - nc - nb)
      self.walk(eqn.params["body_jaxpr"].jaxpr, ins[nc : nc + nb] + carry, count)
      return [merged] * n_out
    if name == "cond":
      # Every branch is counted (an upper bound; CNNs in this library have no cond).
      for branch in subs["branches"]:
        self.walk(branch, ins[1:], count)
      return [merged] * n_out
    if name == "pallas_call":
      # The body runs once per grid step on blocks: its inputs are refs to the operands,
      # followed by output / scratch refs.
      body = subs["jaxpr"][0]
      grid = math.prod(int(g) for g in eqn.params["grid_mapping"].grid)
      flows = ins + [merged] * (len(body.invars) - len(ins))
      self.walk(body, flows[: len(body.invars)], count * grid)
      return [merged] * n_out
    # Call-like primitives (jit, custom_jvp_call, custom_vjp_call, remat, closed_call): one
    # body called on the operands. Walk only one body so nothing is counted twice.
    key = next((k for k in ("jaxpr", "call_jaxpr") if k in subs), next(iter(subs)))
    sub = subs[key][0]
    if len(sub.invars) == len(ins):
      flows = ins
    elif len(sub.invars) < len(ins):
      flows = ins[len(ins) - len(sub.invars) :]
    else:  # unknown calling convention: assume the worst about every input
      flows = [merged] * len(sub.invars)
    sub_outs = self.walk(sub, flows, count)
    return sub_outs if len(sub_outs) == n_out else [merged] * n_out

  # -- layer records ------------------------------------------------------------------------

  def _record_conv(self, eqn: Any, ins: list[_Flow], count: int) -> None:
    out_shape = eqn.outvars[0].aval.shape
    rhs_shape = eqn.invars[1].aval.shape
    out_features = rhs_shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    # Each output element is a dot product over kh·kw·Cin/groups kernel entries.
    macs = math.prod(out_shape) * (math.prod(rhs_shape) // out_features)
    self._record("conv", eqn, ins, macs, count)

  def _record_dot(self, eqn: Any, ins: list[_Flow], count: int) -> None:
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    lhs_shape = eqn.invars[0].aval.shape
    contract = math.prod(lhs_shape[d] for d in lhs_contract)
    macs = math.prod(eqn.outvars[0].aval.shape) * contract
    self._record("dense", eqn, ins, macs, count)

  def _record(self, kind: str, eqn: Any, ins: list[_Flow], macs: int, count: int) -> None:
    lhs_flow, rhs_flow = ins[:2]
    if not lhs_flow.data and not rhs_flow.data:
      return  # weight-only computation (e.g. a factorized kernel): no per-batch cost
    both_data = lhs_flow.data and rhs_flow.data
    if both_data and kind == "dense":
      kind = "matmul"
    # Convs take the kernel as rhs; for dot_general the weight is whichever side is not data.
    data_idx, weight_idx = (0, 1) if lhs_flow.data else (1, 0)
    conv = eqn.primitive.name == "conv_general_dilated"
    self.records.append(
      dict(
        kind=kind,
        both_data=both_data,
        data=(eqn.invars[data_idx], ins[data_idx]),
        weight=(eqn.invars[weight_idx], ins[weight_idx]),
        out_shape=tuple(eqn.outvars[0].aval.shape),
        macs=macs,
        count=count,
        strides=tuple(eqn.params["window_strides"]) if conv else None,
        padding=tuple(tuple(p) for p in eqn.params["padding"]) if conv else None,
        lhs_dilation=tuple(eqn.params["lhs_dilation"]) if conv else None,
        rhs_dilation=tuple(eqn.params["rhs_dilation"]) if conv else None,
        feature_group_count=int(eqn.params["feature_group_count"]) if conv else None,
      )
    )


# --------------------------------------------------------------------------------------------
# Model handling
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _record_batchnorm_inputs(records: list[tuple[int, tuple[int, ...], Any]]):
  """Temporarily wraps ``nnx.BatchNorm.__call__`` to record (module id, input shape, dtype).

  NNX has no method interceptors; the wrapper is removed on exit (not thread-safe).
  """
  original = nnx.BatchNorm.__call__

  def recording_call(self, x, *args, **kwargs):
    records.append((id(self), tuple(x.shape), x.dtype))
    return original(self, x, *args, **kwargs)

  nnx.BatchNorm.__call__ = recording_call
  try:
    yield
  finally:
    nnx.BatchNorm.__call__ = original


def _check_input_shape(input_shape: Any) -> tuple[int, ...]:
  try:
    shape = tuple(int(d) for d in input_shape)
  except TypeError as err:
    raise ValueError(f"input_shape must be a sequence of ints, got {input_shape!r}") from err
  if not shape or any(d <= 0 for d in shape):
    raise ValueError(f"input_shape must be non-empty with positive sizes, got {input_shape!r}")
  return shape


def _trace(
  model_or_fn: Any,
  input_shape: Sequence[int],
  params: Any,
  input_dtype: Any,
  batchnorm_records: list | None = None,
  batchnorm_paths: dict[int, str] | None = None,
) -> tuple[Any, list[tuple[ParamPath, Any]], int]:
  """Traces the forward pass → (jaxpr, [(path, leaf)] of the params, index of the input)."""
  shape = _check_input_shape(input_shape)
  x = jax.ShapeDtypeStruct(shape, input_dtype)
  if isinstance(model_or_fn, nnx.Module):
    if params is not None:
      raise ValueError("params must be None for an NNX model (its nnx.Param state is used)")
    graphdef, param_state, rest = nnx.split(model_or_fn, nnx.Param, ...)

    def forward(p, r, images):
      model = nnx.merge(graphdef, p, r)
      if batchnorm_paths is not None:
        for path, node in nnx.iter_graph(model):
          if isinstance(node, nnx.BatchNorm):
            batchnorm_paths[id(node)] = "/".join(map(str, path))
      return model(images)

    args = (param_state, rest, x)
    leaves = flatten_with_paths(param_state)
    input_index = len(leaves) + len(jax.tree_util.tree_leaves(rest))
  elif callable(model_or_fn):
    if params is None:
      raise ValueError("params is required when model_or_fn is a plain fn(params, x)")
    forward = model_or_fn
    args = (params, x)
    leaves = flatten_with_paths(params)
    input_index = len(leaves)
  else:
    raise ValueError(
      f"model_or_fn must be an nnx.Module or a callable fn(params, x), got {model_or_fn!r}"
    )
  context = (
    _record_batchnorm_inputs(batchnorm_records)
    if batchnorm_records is not None
    else contextlib.nullcontext()
  )
  try:
    with context:
      closed = jax.make_jaxpr(forward)(*args)
  except (TypeError, ValueError) as err:
    raise ValueError(f"input_shape {shape} does not fit the model (tracing failed: {err})") from err
  return closed, leaves, input_index


def _layers_from_trace(
  closed: Any, leaves: list[tuple[ParamPath, Any]], input_index: int, masks: Any
) -> list[LayerFlops]:
  jaxpr = closed.jaxpr
  n_leaves = len(leaves)
  flows = []
  for i, _ in enumerate(jaxpr.invars):
    if i < n_leaves:
      flows.append(_Flow(i, False, True))
    elif i == input_index:
      flows.append(_Flow(None, True, False))
    else:  # other model state (batch statistics, RNG keys): neither data nor parameter
      flows.append(_CONST)
  walker = _Walker()
  walker.walk(jaxpr, flows, 1)

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


# --------------------------------------------------------------------------------------------
# Public FLOPs API
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Compression
# --------------------------------------------------------------------------------------------


def _conv_counts(params: Any, masks: Any) -> tuple[int, int]:
  leaves = flatten_with_paths(params)
  params_by_path = dict(leaves)
  mask_by_path = _mask_table(masks, params_by_path)
  total = nonzero = 0
  for path, leaf in leaves:
    if len(_shape(leaf)) != 4:
      continue
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(f"params: leaf {path!r} is abstract; nonzeros need concrete values")
    values = np.asarray(leaf)
    if path in mask_by_path:
      values = values * mask_by_path[path]
    total += values.size
    nonzero += int(np.count_nonzero(values))
  if total == 0:
    raise ValueError("params contains no conv kernels (4-D leaves)")
  return total, nonzero


def compression_ratio(params: Any, masks: Any = None) -> float:
  """Total / nonzero weights over the conv kernels (4-D leaves) — the papers' definition.

  ClickTrain (§6, Tab. 1) "calculate[s] the compression ratio only considering the
  convolutional layers". A 3×3 kernel keeping 4 of 9 weights gives 9/4; additionally removing
  a fraction p of kernels gives 9/4 · 1/(1−p).

  Args:
    params: any param pytree (NNX ``State``, pure dict, Linen dict).
    masks: optional masks (see :func:`layer_flops`); then the nonzeros of ``params * mask``
      are counted. Without masks the nonzeros of ``params`` are.

  Returns:
    ``total / nonzero``; ``math.inf`` when every conv weight is zero (all pruned).

  Raises:
    ValueError: no 4-D leaf in ``params``, or a mask does not match its parameter.
  """
  total, nonzero = _conv_counts(params, masks)
  return math.inf if nonzero == 0 else total / nonzero


def conv_sparsity(params: Any, masks: Any = None) -> float:
  """Fraction of conv-kernel weights (4-D leaves) that are zero (after masking).

  Arguments as in :func:`compression_ratio`; ``1 − 1 / compression_ratio``.
  """
  total, nonzero = _conv_counts(params, masks)
  return 1.0 - nonzero / total


# --------------------------------------------------------------------------------------------
# Memory traffic and communication
# --------------------------------------------------------------------------------------------

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


def allreduce_bytes(params: Any, num_devices: int, masks: Any = None) -> float:
  """Bytes each device sends per step to all-reduce the weight gradients (ring all-reduce).

  PruneTrain §5 (Fig. 11) models communication with ring all-reduce: each of ``p`` devices
  sends (and receives) ``2 (p − 1) / p × gradient bytes``. With ``masks`` only the kept
  gradient entries are reduced (ClickTrain §5.3's sparse all-reduce; the fixed positions are
  known to every device, so no index traffic is counted).

  Args:
    params: the parameter pytree (every leaf is a gradient that is reduced).
    num_devices: ``p`` ≥ 1; one device communicates nothing.
    masks: optional masks (see :func:`layer_flops`).

  Returns:
    Bytes per device per step.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
    raise ValueError(f"num_devices must be an int, got {num_devices!r}")
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  leaves = flatten_with_paths(params)
  mask_by_path = _mask_table(masks, dict(leaves))
  gradient_bytes = 0
  for path, leaf in leaves:
    itemsize = _dtype(leaf).itemsize
    entries = (
      int(np.count_nonzero(mask_by_path[path])) if path in mask_by_path else math.prod(_shape(leaf))
    )
    gradient_bytes += entries * itemsize
  return 2.0 * (num_devices - 1) / num_devices * gradient_bytes
