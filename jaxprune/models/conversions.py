"""Rebuilding a model from a (new) width spec, conversions included.

A model of this package is fully described by its class, ``model.spec``,
``model.num_classes`` and its precision (``model.dtype``, ``model.param_dtype``), plus
whatever *conversions* were applied to it after construction (e.g. SDGP's converter swaps
every conv for an ``SDGPConv``). A converter records itself on
the model with :func:`record_conversion`; :func:`rebuild` builds a new model of the same class
from a spec and re-applies, in order, every conversion the old model carries. PruneTrain's
reconfiguration (which changes the widths) and the trainer's checkpoint resume (which rebuilds a
reconfigured model) both go through :func:`rebuild`, so a converted model stays converted.

A conversion is any hashable callable ``model -> model`` that changes the model in place and
returns it (a frozen dataclass with ``__call__`` is the natural form; it is stored in the
model's graph definition, which must be hashable). It may declare ``channel_multiple``: the
multiple every output width must keep (e.g. SDGP's ``m``), which width-changing code honours.
This module knows nothing about any particular conversion.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Optional

from flax import nnx

__all__ = [
  "Conversion",
  "applied_conversions",
  "channel_multiple",
  "rebuild",
  "record_conversion",
  "replace_submodule",
  "submodule",
]

Conversion = Callable[[nnx.Module], nnx.Module]

# The attribute holding the recorded conversions: a tuple of hashable callables, a static
# attribute of the module (part of its graph definition, not of its state).
_ATTRIBUTE = "applied_conversions"

# The model attributes rebuild passes on to the new model's constructor (Flax's names).
_PRECISION = ("dtype", "param_dtype")


def record_conversion(model: nnx.Module, conversion: Conversion) -> nnx.Module:
  """Remembers that ``conversion`` was applied to ``model`` (called by converters).

  Args:
    model: the converted model (changed in place).
    conversion: a hashable callable ``model -> model`` that re-applies the conversion to a
      freshly built model of the same class.

  Returns:
    ``model``.

  Raises:
    ValueError: ``conversion`` is not callable or not hashable.
  """
  if not callable(conversion):
    raise ValueError(f"conversion must be callable, got {type(conversion).__name__}")
  try:
    hash(conversion)
  except TypeError:
    raise ValueError(
      f"conversion must be hashable (a frozen dataclass), got {type(conversion).__name__}"
    ) from None
  setattr(model, _ATTRIBUTE, applied_conversions(model) + (conversion,))
  return model


def submodule(model: nnx.Module, path: tuple) -> nnx.Module:
  """The module at ``path`` inside ``model``.

  ``path`` as given by ``nnx.iter_modules``: attribute names and list indices.
  """
  for part in path:
    model = model[part] if isinstance(part, int) else getattr(model, part)
  return model


def replace_submodule(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
  """Puts ``new`` at ``path`` inside ``model``.

  ``path`` as given by ``nnx.iter_modules``: attribute names and list indices. This is what a
  converter does to each module it swaps.
  """
  parent = submodule(model, path[:-1])
  if isinstance(path[-1], int):
    parent[path[-1]] = new
  else:
    setattr(parent, path[-1], new)


def applied_conversions(model: nnx.Module) -> tuple[Conversion, ...]:
  """The conversions recorded on ``model``, in the order they were applied."""
  return tuple(getattr(model, _ATTRIBUTE, ()))


def channel_multiple(model: nnx.Module) -> int:
  """The multiple every output width of ``model`` must keep for its conversions (1: none)."""
  return math.lcm(1, *(int(getattr(c, "channel_multiple", 1)) for c in applied_conversions(model)))


def rebuild(model: nnx.Module, spec: Any = None, *, rngs: Optional[nnx.Rngs] = None) -> nnx.Module:
  """A new model of ``model``'s class, built from ``spec``, with its conversions re-applied.

  It keeps ``model``'s ``num_classes`` and precision (``dtype`` / ``param_dtype``, where the model
  has them), and re-applies every conversion recorded on ``model``.

  The new model's variables are freshly initialised (copy values over with ``nnx.update``);
  wrap the call in ``nnx.eval_shape`` to build it abstractly.

  Args:
    model: a model built as ``type(model)(spec, num_classes=..., rngs=...)`` (every model of
      :mod:`jaxprune.models`).
    spec: the width spec of the new model; default ``model.spec`` (same architecture).
    rngs: random streams of the new model's initialisation; default ``nnx.Rngs(0)``.

  Returns:
    The new model, in training mode.

  Raises:
    ValueError: ``model`` has no ``spec`` / ``num_classes`` to rebuild from.

  Example:
    >>> model = create("prunetrain-resnet20", num_classes=10, rngs=nnx.Rngs(0))
    >>> spec = model.spec.with_widths({"stages/0/0/conv1": 8})
    >>> smaller = rebuild(model, spec)
  """
  for name in ("spec", "num_classes"):
    if getattr(model, name, None) is None:
      raise ValueError(f"model: {type(model).__name__} has no {name!r} to rebuild from")
  spec = model.spec if spec is None else spec
  # A mixed-precision model stays one: PruneTrain's reconfiguration and checkpoint resume
  # rebuild through here.
  precision = {name: getattr(model, name) for name in _PRECISION if hasattr(model, name)}
  new = type(model)(spec, num_classes=model.num_classes, rngs=rngs or nnx.Rngs(0), **precision)
  for conversion in applied_conversions(model):
    new = conversion(new)
  if applied_conversions(new) != applied_conversions(model):
    # A conversion that does not record itself would be lost at the next rebuild.
    setattr(new, _ATTRIBUTE, applied_conversions(model))
  return new
