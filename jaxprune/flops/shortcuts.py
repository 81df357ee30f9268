"""Which 1x1 convs of a model are projection shortcuts, read from its traced forward pass.

A projection shortcut is the 1x1 conv on the skip path of a residual block: the block's input
``u`` reaches a residual add twice, once through this conv alone and once through at least one
other conv. ClickTrain leaves these dense (the authors' released code prunes every conv but the
stem and the 1x1 shortcuts); deciding it from the data flow rather than the layer's name makes
the choice the same for ``shortcut``, ``downsample`` or ``b2_proj``. A 1x1 conv *on* the
residual branch (MobileNetV2's projection before an identity shortcut) is not one.

The walk follows every value that depends on the input batch and notes, for each, the convs
that last produced it and all the convs upstream of it (the model's input counts as one), also
inside ``jit``, ``custom_vjp`` / ``custom_jvp`` and ``remat`` bodies. Convs inside ``scan``,
``while``, ``cond`` or Pallas bodies are not looked into (none of them is taken for a shortcut).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxprune.flops._trace import _PASS_THROUGH, _is_literal, _sub_jaxprs, _trace
from jaxprune.paths import path_string

__all__ = ["projection_shortcuts"]

_INPUT = -1  # the model's input, as a conv that produced the batch
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint")


@dataclasses.dataclass(frozen=True)
class _Value:
  """What the walk knows of one jaxpr value."""

  last: frozenset[int] = frozenset()  # the convs that last produced it (data values)
  upstream: frozenset[int] = frozenset()  # every conv before it (data values)
  leaf: int | None = None  # the parameter leaf it is a view of (weights)

  @property
  def data(self) -> bool:
    return bool(self.last)


_NOTHING = _Value()


@dataclasses.dataclass
class _Conv:
  leaf: int | None
  one_by_one: bool
  reads: frozenset[int]  # the convs that last produced its input


class _Walk:
  def __init__(self) -> None:
    self.convs: list[_Conv] = []
    self.shortcuts: set[int] = set()

  def walk(self, jaxpr: Any, values: Sequence[_Value]) -> list[_Value]:
    env = dict(zip(jaxpr.invars, values))

    def read(v: Any) -> _Value:
      return _NOTHING if _is_literal(v) else env.get(v, _NOTHING)

    for eqn in jaxpr.eqns:
      outs = self._equation(eqn, [read(v) for v in eqn.invars])
      env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]

  def _equation(self, eqn: Any, ins: list[_Value]) -> list[_Value]:
    name = eqn.primitive.name
    data = [v for v in ins if v.data]
    merged = _Value(
      frozenset().union(*(v.last for v in data)), frozenset().union(*(v.upstream for v in data))
    )
    if name == "conv_general_dilated" and ins[0].data and not ins[1].data:
      rhs = eqn.params["dimension_numbers"].rhs_spec
      shape = eqn.invars[1].aval.shape
      one_by_one = all(shape[d] == 1 for d in rhs[2:])
      self.convs.append(_Conv(ins[1].leaf, one_by_one, ins[0].last))
      c = len(self.convs) - 1
      return [_Value(frozenset({c}), ins[0].upstream | {c})]
    subs = [j for k, v in eqn.params.items() for j in _sub_jaxprs(v)]
    if subs and (name in _CALLS or name.startswith("custom_")):
      sub = subs[0]
      if len(sub.invars) <= len(ins):
        outs = self.walk(sub, ins[len(ins) - len(sub.invars) :])
        if len(outs) == len(eqn.outvars):
          return outs
    if name in ("add", "add_any") and len(data) == 2:
      self._residual(*data)
    if not data and name in _PASS_THROUGH and len(eqn.outvars) == 1:
      size = math.prod(eqn.outvars[0].aval.shape)
      for v, value in zip(eqn.invars, ins):
        if value.leaf is not None and math.prod(v.aval.shape) == size:
          return [_Value(leaf=value.leaf)]
    return [merged] * len(eqn.outvars)

  def _residual(self, a: _Value, b: _Value) -> None:
    """Marks the 1x1 conv that alone leads one operand of a residual add from the tensor the
    other operand's path starts at, through at least one other conv."""
    for skip, branch in ((a, b), (b, a)):
      if len(skip.last) != 1:
        continue
      (c,) = skip.last
      if c == _INPUT or not self.convs[c].one_by_one or c in branch.upstream:
        continue
      reads = self.convs[c].reads
      if reads <= branch.upstream and not branch.last <= reads:
        self.shortcuts.add(c)


def projection_shortcuts(
  model: Any, input_shape: Sequence[int], *, input_dtype: Any = jnp.float32
) -> frozenset[str]:
  """The parameter paths of the kernels of ``model``'s 1x1 projection shortcuts.

  Args:
    model: an NNX module called as ``model(x)``.
    input_shape: the shape of ``x`` (a batch of one is enough; traced abstractly).
    input_dtype: the dtype of ``x``.

  Returns:
    The kernels' paths, keys joined by ``/`` (``"blocks/1/proj/kernel"``), as
    :func:`jaxprune.clicktrain.clicktrain`'s ``layer_filter`` sees them.

  Raises:
    ValueError: an ``input_shape`` the model does not accept.

  Example:
    >>> projection_shortcuts(model, (1, 32, 32, 3))  # doctest: +SKIP
    frozenset({'stages/1/0/shortcut/conv/kernel', 'stages/2/0/shortcut/conv/kernel'})
  """
  closed, leaves, input_index = _trace(model, input_shape, None, input_dtype)
  values = [
    _Value(leaf=i)
    if i < len(leaves)
    else _Value(frozenset({_INPUT}), frozenset({_INPUT}))
    if i == input_index
    else _NOTHING
    for i in range(len(closed.jaxpr.invars))
  ]
  walk = _Walk()
  walk.walk(closed.jaxpr, values)
  return frozenset(
    path_string(leaves[walk.convs[c].leaf][0])
    for c in walk.shortcuts
    if walk.convs[c].leaf is not None
  )
