"""Walking a forward pass's jaxpr to join channel dimensions (private to the channel graph).

:class:`_ChannelWalker` gives every axis of every jaxpr value a node of :class:`_Dims` and
applies one rule per primitive: elementwise operations unify their operands' axes; a conv
unifies its input's feature axis with its kernel's input axis (per group: a grouped conv's
feature axis is ``groups x channels per group``) and gives its output the kernel's output
axis; ``dot_general`` unifies contracted axes; ``reshape`` flattens or splits axes into
products; ``concatenate`` and ``slice`` / ``split`` into concatenations; a ``gather`` of whole slices
(an embedding lookup) carries the axes it takes whole; reductions keep the
other axes and mark the reduced ones; calls (``jit``, ``custom_vjp``, ``custom_jvp``,
``remat``) are walked inside. Every other primitive marks its operands' axes ``unfollowed``
(named): its channels cannot be pruned, and the graph says which operation stopped them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxprune.prunetrain._dims import _Dims

# Primitives that act position by position on operands of one shape.
_ELEMENTWISE = frozenset(
  """add sub mul div rem pow max min neg sign floor ceil round is_finite exp exp2 log log1p
  expm1 tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt
  cbrt integer_pow square abs erf erfc erf_inv lgamma digamma select_n clamp
  convert_element_type eq ne lt le gt ge and or not xor nextafter copy copy_p reduce_precision
  stop_gradient add_any real imag conj sharding_constraint
  mesh_cast pvary bitcast_convert_type shift_left shift_right_logical shift_right_arithmetic
  population_count""".split()
)
_REDUCTIONS = frozenset(
  "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)
_WINDOWED = frozenset("reduce_window_sum reduce_window_max reduce_window_min reduce_window".split())
# Primitives whose outputs carry no channel of their inputs (random bits, index ranges).
_SOURCES = frozenset(
  """iota random_bits random_seed random_wrap random_unwrap random_fold_in random_split
  threefry2x32 rng_bit_generator rng_uniform""".split()
)
# Nested primitives with their own calling conventions (a body per step or per branch).
_CONTROL_FLOW = frozenset("scan while cond pallas_call".split())


def _is_literal(v: Any) -> bool:
  return isinstance(v, jax.extend.core.Literal)


def _shape(v: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in getattr(v.aval, "shape", ()))


@dataclasses.dataclass
class _ConvUse:
  """A conv whose kernel is a view of a parameter leaf."""

  leaf: int  # index of the parameter leaf
  groups_node: int | None  # the groups axis of a grouped conv (None: one group)


class _ChannelWalker:
  """Walks a jaxpr, joining the axes of every value into :class:`_Dims` nodes.

  Attributes:
    dims: the nodes.
    axes: ``var -> [node per axis]``.
    weight_origin: ``id(var) -> parameter leaf index`` of every kernel operand (from the
      FLOP walker).
    feature_nodes: nodes of the axes a conv / dense kernel multiplies over or produces.
    convs: every conv whose kernel is a parameter, with its groups axis.
  """

  def __init__(self, weight_origin: dict[int, int]) -> None:
    self.dims = _Dims()
    self.axes: dict[Any, list[int]] = {}
    self.weight_origin = weight_origin
    self.feature_nodes: list[int] = []
    self.convs: list[_ConvUse] = []
    # Every dot_general between two activations (attention's q·kᵀ and weights·v): the nodes of
    # its operands and of its output, from which keep_head_dims tells heads from head_dim.
    self.activation_dots: list[tuple[list[int], list[int]]] = []

  def keep_head_dims(self) -> None:
    """Blocks head_dim, once the walk is done.

    Attention is two products of activations, q·kᵀ and weights·v. The channels of the
    projections that both products carry through to their outputs are the heads (with grouped
    queries, the kv heads and the query heads of a group); the other projection channels they
    touch are head_dim, q and k's (contracted by q·kᵀ) and v's (carried by weights·v only). A
    head is removed whole and head_dim stays: RoPE's rotation pairs and the softmax scale
    1/sqrt(head_dim) live there. Attention layers do not share their heads, so a channel is a
    head only where two products of one layer agree.
    """
    features = {a for node in self.feature_nodes for a in self.dims.atoms(node)}

    def atoms(nodes: list[int]) -> set[int]:
      return {a for node in nodes for a in self.dims.atoms(node)} & features

    outputs = [atoms(out) for _, out in self.activation_dots]
    heads = {a for i, x in enumerate(outputs) for y in outputs[i + 1 :] for a in x & y}
    for operands, out in self.activation_dots:
      for atom in (atoms(operands) | atoms(out)) - heads:
        self.dims.mark(
          atom, ("kept", "a head's head_dim (RoPE pairs and the softmax scale live there)")
        )

  # -- values ----------------------------------------------------------------------------------
  def fresh(self, v: Any, mark: tuple[str, str] | None = None) -> list[int]:
    nodes = [self.dims.new(d, mark) for d in _shape(v)]
    self.axes[v] = nodes
    return nodes

  def read(self, v: Any) -> list[int]:
    if _is_literal(v):
      return [self.dims.new(d) for d in _shape(v)]
    if v not in self.axes:
      self.fresh(v)
    return self.axes[v]

  def constant(self, v: Any, value: Any) -> None:
    """A constant array: its axes along which it varies are fixed.

    It is not a variable the surgery could slice; an axis along which it is uniform follows whatever
    it meets.
    """
    nodes = self.fresh(v)
    array = np.asarray(value) if value is not None else None
    for axis, node in enumerate(nodes):
      if array is None or array.dtype == object or not _uniform(array, axis):
        self.dims.mark(node, ("fixed", "a constant array that varies along the channels"))

  # -- walking ---------------------------------------------------------------------------------
  def walk(
    self, jaxpr: Any, ins: Sequence[list[int]], consts: Sequence[Any] = ()
  ) -> list[list[int]]:
    for v, nodes in zip(jaxpr.invars, ins):
      self.axes[v] = nodes
    for i, v in enumerate(jaxpr.constvars):
      self.constant(v, consts[i] if i < len(consts) else None)
    for eqn in jaxpr.eqns:
      self._equation(eqn)
    return [self.read(v) for v in jaxpr.outvars]

  def _equation(self, eqn: Any) -> None:
    name = eqn.primitive.name
    rule = _RULES.get(name)
    if rule is not None:
      rule(self, eqn)
    elif name in _ELEMENTWISE:
      self._elementwise(eqn)
    elif name in _REDUCTIONS:
      self._reduction(eqn)
    elif name in _WINDOWED:
      self._windowed(eqn)
    elif name in _SOURCES:
      for v in eqn.outvars:
        self.fresh(v)
    elif name not in _CONTROL_FLOW and self._call(eqn):
      pass
    else:
      self._unfollowed(eqn)

  def _unfollowed(self, eqn: Any) -> None:
    name = eqn.primitive.name
    for v in eqn.invars:
      for node in self.read(v):
        self.dims.mark(node, ("unfollowed", f"operation {name!r}"))
    for v in eqn.outvars:
      self.fresh(v, ("unfollowed", f"operation {name!r}"))

  def _call(self, eqn: Any) -> bool:
    """A call-like primitive (jit, custom_jvp / custom_vjp, remat): its body is walked on the
    operands. False if it has no body taking the operands one to one."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
      body = eqn.params.get(key)
      if body is None:
        continue
      closed = body if isinstance(body, jax.extend.core.ClosedJaxpr) else None
      inner = closed.jaxpr if closed is not None else body
      if not isinstance(inner, jax.extend.core.Jaxpr):
        continue
      if len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
        return False
      outs = self.walk(inner, [self.read(v) for v in eqn.invars], closed.consts if closed else ())
      for v, nodes in zip(eqn.outvars, outs):
        self.axes[v] = nodes
      return True
    return False

  # -- rules -----------------------------------------------------------------------------------
  def _elementwise(self, eqn: Any) -> None:
    name = eqn.primitive.name
    shaped = [self.read(v) for v in eqn.invars if _shape(v)]
    out_shape = _shape(eqn.outvars[0])
    # Operands of the output's rank meet axis by axis; a size-1 axis is broadcast (it carries
    # no channel) and a rank-0 operand is a scalar.
    if any(len(nodes) != len(out_shape) for nodes in shaped):
      self._unfollowed(eqn)
      return
    out = []
    for axis, size in enumerate(out_shape):
      full = [nodes[axis] for nodes in shaped if self.dims.size(nodes[axis]) == size]
      if not full:
        out.append(self.dims.new(size))
        continue
      for other in full[1:]:
        self.dims.unify(full[0], other, name)
      out.append(full[0])
    for v in eqn.outvars:
      self.axes[v] = list(out)

  def _reduction(self, eqn: Any) -> None:
    name = eqn.primitive.name
    nodes = self.read(eqn.invars[0])
    axes = set(eqn.params["axes"])
    for axis in axes:
      self.dims.mark(
        nodes[axis],
        ("normalized", f"{name} over the channels (a statistic of them: removing one changes it)"),
      )
    self.axes[eqn.outvars[0]] = [n for i, n in enumerate(nodes) if i not in axes]

  def _windowed(self, eqn: Any) -> None:
    """Pooling: an axis with a window of one and a stride of one, unpadded, keeps its node."""
    nodes = self.read(eqn.invars[0])
    window = eqn.params["window_dimensions"]
    strides = eqn.params["window_strides"]
    padding = eqn.params["padding"]
    out = []
    for axis, node in enumerate(nodes):
      if window[axis] == 1 and strides[axis] == 1 and tuple(padding[axis]) == (0, 0):
        out.append(node)
      else:
        self.dims.mark(node, ("fixed", "a pooled (spatial) axis"))
        out.append(self.dims.new(_shape(eqn.outvars[0])[axis], ("fixed", "a pooled axis")))
    self.axes[eqn.outvars[0]] = out

  def _conv(self, eqn: Any) -> None:
    lhs, rhs = self.read(eqn.invars[0]), self.read(eqn.invars[1])
    numbers = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec
    groups = int(eqn.params["feature_group_count"])
    if int(eqn.params["batch_group_count"]) != 1:
      self._unfollowed(eqn)
      return
    kernel_in, kernel_out = rhs[rhs_spec[1]], rhs[rhs_spec[0]]
    groups_node = None
    if groups == 1:
      self.dims.unify(lhs[lhs_spec[1]], kernel_in, "conv input channels")
    else:
      # Input channel g*I + i meets kernel input i of group g, and output g*O + o comes
      # from group g (depthwise: I = O = 1, so the channels pass straight through).
      groups_node = self.dims.new(groups)
      per_group_out = self.dims.new(self.dims.size(kernel_out) // groups)
      self.dims.unify(
        lhs[lhs_spec[1]],
        self.dims.composite("prod", [groups_node, kernel_in]),
        "grouped conv input",
      )
      self.dims.unify(
        kernel_out, self.dims.composite("prod", [groups_node, per_group_out]), "grouped conv output"
      )
    out_shape = _shape(eqn.outvars[0])
    out = [0] * len(out_shape)
    out[out_spec[0]] = lhs[lhs_spec[0]]
    out[out_spec[1]] = kernel_out
    for axis in out_spec[2:]:
      out[axis] = self.dims.new(out_shape[axis], ("fixed", "a conv's spatial axis"))
    self.axes[eqn.outvars[0]] = out
    if id(eqn.invars[1]) in self.weight_origin:
      self.feature_nodes += [kernel_in, kernel_out]
      self.convs.append(_ConvUse(self.weight_origin[id(eqn.invars[1])], groups_node))

  def _dot(self, eqn: Any) -> None:
    lhs, rhs = self.read(eqn.invars[0]), self.read(eqn.invars[1])
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    for a, b in zip(lc, rc):
      self.dims.unify(lhs[a], rhs[b], "dot_general contraction")
    for a, b in zip(lb, rb):
      self.dims.unify(lhs[a], rhs[b], "dot_general batch")
    lhs_free = [n for i, n in enumerate(lhs) if i not in lc and i not in lb]
    rhs_free = [n for i, n in enumerate(rhs) if i not in rc and i not in rb]
    self.axes[eqn.outvars[0]] = [lhs[a] for a in lb] + lhs_free + rhs_free
    if not any(id(v) in self.weight_origin for v in eqn.invars[:2]):
      self.activation_dots.append((lhs + rhs, self.axes[eqn.outvars[0]]))
    for v, nodes, batch in ((eqn.invars[0], lhs, lb), (eqn.invars[1], rhs, rb)):
      if id(v) in self.weight_origin:
        self.feature_nodes += [n for i, n in enumerate(nodes) if i not in batch]

  def _identity(self, eqn: Any) -> None:
    """Each output is its operand (``optimization_barrier``)."""
    for v, operand in zip(eqn.outvars, eqn.invars):
      self.axes[v] = self.read(operand)

  def _broadcast(self, eqn: Any) -> None:
    nodes = self.read(eqn.invars[0])
    shape = _shape(eqn.outvars[0])
    out = [self.dims.new(d) for d in shape]
    for node, axis in zip(nodes, eqn.params["broadcast_dimensions"]):
      if self.dims.size(node) == shape[axis]:
        out[axis] = node
    self.axes[eqn.outvars[0]] = out

  def _transpose(self, eqn: Any) -> None:
    nodes = self.read(eqn.invars[0])
    self.axes[eqn.outvars[0]] = [nodes[p] for p in eqn.params["permutation"]]

  def _squeeze(self, eqn: Any) -> None:
    nodes = self.read(eqn.invars[0])
    dropped = {d % len(nodes) for d in eqn.params["dimensions"]}
    self.axes[eqn.outvars[0]] = [n for i, n in enumerate(nodes) if i not in dropped]

  def _reshape(self, eqn: Any) -> None:
    if eqn.params.get("dimensions") is not None:
      self._unfollowed(eqn)
      return
    nodes = self.read(eqn.invars[0])
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    out = [self.dims.new(d) for d in out_shape]
    ins = [i for i, d in enumerate(in_shape) if d != 1]
    outs = [j for j, d in enumerate(out_shape) if d != 1]
    i = j = 0
    while i < len(ins) and j < len(outs):
      a, b = [ins[i]], [outs[j]]
      pa, pb = in_shape[ins[i]], out_shape[outs[j]]
      while pa != pb:
        if pa < pb:
          i += 1
          a.append(ins[i])
          pa *= in_shape[ins[i]]
        else:
          j += 1
          b.append(outs[j])
          pb *= out_shape[outs[j]]
      if len(a) == 1 and len(b) == 1:
        out[b[0]] = nodes[a[0]]
      elif len(b) == 1:
        out[b[0]] = self.dims.composite("prod", [nodes[k] for k in a])
      else:
        joined = self.dims.composite("prod", [nodes[k] for k in a])
        self.dims.unify(joined, self.dims.composite("prod", [out[k] for k in b]), "reshape")
      i, j = i + 1, j + 1
    self.axes[eqn.outvars[0]] = out

  def _concatenate(self, eqn: Any) -> None:
    axis = eqn.params["dimension"]
    operands = [self.read(v) for v in eqn.invars]
    out = list(operands[0])
    for nodes in operands[1:]:
      for k, node in enumerate(nodes):
        if k != axis:
          self.dims.unify(out[k], node, "concatenate")
    out[axis] = self.dims.composite("cat", [nodes[axis] for nodes in operands])
    self.axes[eqn.outvars[0]] = out

  def _split_axis(self, nodes: list[int], axis: int, bounds: list[int]) -> list[int]:
    """``nodes[axis]`` cut at ``bounds`` (a concatenation of the pieces); the pieces' nodes."""
    edges = [0, *bounds, self.dims.size(nodes[axis])]
    pieces = [self.dims.new(b - a) for a, b in zip(edges[:-1], edges[1:])]
    self.dims.unify(nodes[axis], self.dims.composite("cat", pieces), "slice of an axis")
    return pieces

  def _split(self, eqn: Any) -> None:
    nodes = self.read(eqn.invars[0])
    axis = eqn.params["axis"]
    sizes = list(eqn.params["sizes"])
    pieces = self._split_axis(nodes, axis, list(np.cumsum(sizes)[:-1]))
    for v, piece in zip(eqn.outvars, pieces):
      self.axes[v] = [piece if k == axis else n for k, n in enumerate(nodes)]

  def _slice(self, eqn: Any) -> None:
    nodes = self.read(eqn.invars[0])
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    strides = eqn.params["strides"] or (1,) * len(nodes)
    out = list(nodes)
    for axis in range(len(nodes)):
      if strides[axis] != 1:
        out[axis] = self._strided(
          nodes, axis, starts[axis], strides[axis], _shape(eqn.outvars[0])[axis]
        )
      else:
        out[axis] = self._piece(nodes, axis, starts[axis], limits[axis])
    self.axes[eqn.outvars[0]] = out

  def _piece(self, nodes: list[int], axis: int, begin: int, end: int) -> int:
    """``nodes[axis]`` restricted to ``[begin, end)``: the axis itself when that is all of it,
    else that piece of the axis cut at ``begin`` and ``end`` (a concatenation of the pieces)."""
    size = self.dims.size(nodes[axis])
    if (begin, end) == (0, size):
      return nodes[axis]
    cuts = [b for b in (begin, end) if 0 < b < size]
    return self._split_axis(nodes, axis, cuts)[1 if begin > 0 else 0]

  def _strided(self, nodes: list[int], axis: int, start: int, stride: int, out_size: int) -> int:
    """The output axis of ``x[start:stop:stride]`` along ``nodes[axis]``.

    The slice reads one channel of each of ``out_size`` blocks of ``stride`` channels, the
    blocks cut from the axis at ``start - phase`` (the first phase that keeps them inside it).
    That piece is ``(out_size, stride)``: the output is its major factor, the phase its minor
    one, so output channel j is a block of ``stride`` input channels and the group is followed.
    The phases are fixed: the stride is in the model's code and the surgery cannot change it.
    A slice whose blocks do not fit in the axis (``out_size * stride`` past its size) is not
    followed.
    """
    node, size = nodes[axis], self.dims.size(nodes[axis])
    if out_size * stride > size:
      mark = ("unfollowed", "a strided slice of the axis")
      self.dims.mark(node, mark)
      return self.dims.new(out_size, mark)
    begin = start - max(0, start + out_size * stride - size)
    node = self._piece(nodes, axis, begin, begin + out_size * stride)
    major, phases = self.dims.new(out_size), [self.dims.new(1) for _ in range(stride)]
    for p in phases:
      self.dims.mark(p, ("fixed", "a strided slice's phase (its stride is in the model's code)"))
    self.dims.unify(
      node,
      self.dims.composite("prod", [major, self.dims.composite("cat", phases)]),
      "strided slice",
    )
    return major

  def _gather(self, eqn: Any) -> None:
    """A gather of whole slices (``nnx.Embed``'s row lookup, ``x[idx]``): an operand axis taken
    whole is carried to its output offset axis, as a slice taken whole would be; the axes the
    indices address are not followed (a vocabulary, or channels picked by index); the indices
    carry no channel."""
    numbers = eqn.params["dimension_numbers"]
    if getattr(numbers, "operand_batching_dims", ()):
      self._unfollowed(eqn)
      return
    nodes = self.read(eqn.invars[0])
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    sizes = eqn.params["slice_sizes"]
    collapsed, indexed = set(numbers.collapsed_slice_dims), set(numbers.start_index_map)
    # The output's other axes are the indices' (tokens of a lookup, or picked channels): not
    # followed either.
    out = [self.dims.new(d, ("unfollowed", "operation 'gather'")) for d in out_shape]
    kept = [a for a in range(len(in_shape)) if a not in collapsed]
    for axis, offset in zip(kept, numbers.offset_dims):
      if axis not in indexed and sizes[axis] == in_shape[axis]:
        out[offset] = nodes[axis]
    # An indexed axis may be a vocabulary (no kernel meets it: not a channel group) or channels
    # picked or permuted (jnp.take over features): the graph cannot follow the latter, so the
    # axis is refused as before, by name, and the strict callback still refuses such a model.
    for axis in indexed | collapsed:
      self.dims.mark(nodes[axis], ("unfollowed", "operation 'gather'"))
    self.axes[eqn.outvars[0]] = out

  def _pad(self, eqn: Any) -> None:
    nodes = self.read(eqn.invars[0])
    out = []
    for axis, (node, config) in enumerate(zip(nodes, eqn.params["padding_config"])):
      if tuple(config) == (0, 0, 0):
        out.append(node)
      else:
        self.dims.mark(node, ("fixed", "a padded (spatial) axis"))
        out.append(self.dims.new(_shape(eqn.outvars[0])[axis]))
    self.axes[eqn.outvars[0]] = out


def _uniform(array: np.ndarray, axis: int) -> bool:
  if array.shape[axis] <= 1:
    return True
  return bool(np.all(array == np.take(array, [0], axis=axis)))


_RULES = {
  "conv_general_dilated": _ChannelWalker._conv,
  "dot_general": _ChannelWalker._dot,
  "optimization_barrier": _ChannelWalker._identity,
  "broadcast_in_dim": _ChannelWalker._broadcast,
  "transpose": _ChannelWalker._transpose,
  "squeeze": _ChannelWalker._squeeze,
  "reshape": _ChannelWalker._reshape,
  "concatenate": _ChannelWalker._concatenate,
  "split": _ChannelWalker._split,
  "slice": _ChannelWalker._slice,
  "pad": _ChannelWalker._pad,
  "gather": _ChannelWalker._gather,
}
