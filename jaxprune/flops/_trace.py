"""Tracing a forward pass and walking its jaxpr (private to :mod:`jaxprune.flops`).

:func:`_trace` runs :func:`jax.make_jaxpr` on an NNX model or a plain ``fn(params, x)``;
:class:`_Walker` walks the resulting jaxpr (also inside ``jit``, ``custom_vjp_call``,
``custom_jvp_call``, ``remat``, ``scan``, ``cond``, ``while`` and ``pallas_call`` bodies), records
every ``conv_general_dilated`` / ``dot_general`` that multiplies the data, and follows each weight
operand back through shape- and value-preserving operations to the parameter leaf that feeds it.
What is known about each jaxpr value (which parameter it is a view of, whether it depends on the
input batch or on a parameter) is a :class:`_Flow`. Turning the records into
:class:`~jaxprune.flops.LayerFlops` is :mod:`jaxprune.flops.layers`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from jaxprune.paths import ParamPath, flatten_with_paths

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


def _input_flows(jaxpr: Any, n_leaves: int, input_index: int) -> list[_Flow]:
  """The flow of every input of a :func:`_trace` jaxpr: parameter leaves, then the other model
  state (batch statistics, RNG keys: neither data nor parameter), then the batch."""
  flows = []
  for i, _ in enumerate(jaxpr.invars):
    if i < n_leaves:
      flows.append(_Flow(i, False, True))
    elif i == input_index:
      flows.append(_Flow(None, True, False))
    else:
      flows.append(_CONST)
  return flows


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
