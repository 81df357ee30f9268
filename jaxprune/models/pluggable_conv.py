"""Convolution layers whose convolution is a pluggable function, composed by wrapping.

Methods that change how a convolution runs (SDGP's pruned data gradient, ClickTrain's
pattern-sparse execution) do it through this one protocol, so they compose without naming
each other:

* A *conv function* is called like ``lax.conv_general_dilated`` (``lhs, rhs, window_strides,
  padding`` and the keywords ``lhs_dilation``, ``rhs_dilation``, ``dimension_numbers``,
  ``feature_group_count``, ``precision``; NHWC × HWIO here) and is hashable: it is a static
  attribute of its layer (``nnx.Conv``'s ``conv_general_dilated``).
* A *wrapper* is a conv function with a field ``inner``, the conv function it wraps (a frozen
  dataclass); it changes what happens around ``inner``'s call (SDGP: the backward pass).
  :func:`with_base` swaps the innermost function of a chain and keeps every wrapper: this is how
  ClickTrain puts its sparse convolution under SDGP's wrapper.
* A conv function that draws random numbers takes the keyword ``key``. :class:`PluggableConv`
  keeps that key in a :class:`ConvKey` Variable, advances it on every call and passes the
  call's key explicitly (:func:`next_call_key`).
* :class:`BoundConv` binds a conv function's geometry: ``(x, kernel) -> y``, hashable, the form
  a ``jax.custom_vjp`` takes as a static argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxprune._conv_args import canonical_padding, spatial_pair
from jaxprune.distributed import device_key

__all__ = [
  "BoundConv",
  "ConvFunction",
  "ConvKey",
  "PluggableConv",
  "base_function",
  "conv_sharing_variables",
  "next_call_key",
  "with_base",
]

Array = jax.Array
ConvFunction = Callable[..., Array]

_NHWC = ("NHWC", "HWIO", "NHWC")
_PADDINGS = ("SAME", "VALID", "SAME_LOWER")


def base_function(conv_fn: ConvFunction) -> ConvFunction:
  """The innermost conv function of a chain of wrappers (``conv_fn`` itself if it wraps none)."""
  while hasattr(conv_fn, "inner"):
    conv_fn = conv_fn.inner
  return conv_fn


def with_base(conv_fn: ConvFunction, base: ConvFunction) -> ConvFunction:
  """``conv_fn`` with its innermost function replaced by ``base``, every wrapper kept."""
  if not hasattr(conv_fn, "inner"):
    return base
  return dataclasses.replace(conv_fn, inner=with_base(conv_fn.inner, base))


def _hashable(value: Any) -> Any:
  if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
    return tuple(_hashable(v) for v in value)
  return value


@dataclasses.dataclass(frozen=True)
class BoundConv:
  """``conv_fn`` with its geometry bound: ``(x, kernel) -> y``, hashable.

  Build it with :meth:`bind` from the arguments a conv function received.
  """

  conv_fn: ConvFunction
  window_strides: tuple[int, ...]
  padding: str | tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...] | None
  rhs_dilation: tuple[int, ...] | None
  dimension_numbers: Any
  feature_group_count: int
  precision: Any

  @classmethod
  def bind(
    cls,
    conv_fn: ConvFunction,
    window_strides,
    padding,
    *,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    precision=None,
  ) -> BoundConv:
    """The call ``conv_fn(x, kernel, window_strides, padding, ...)`` with ``x, kernel`` open.

    Lists become tuples, so the result is hashable.
    """
    return cls(
      conv_fn,
      _hashable(window_strides),
      _hashable(padding),
      _hashable(lhs_dilation),
      _hashable(rhs_dilation),
      _hashable(dimension_numbers),
      int(feature_group_count),
      precision,
    )

  def __call__(self, x: Array, kernel: Array) -> Array:
    return self.conv_fn(
      x,
      kernel,
      self.window_strides,
      self.padding,
      lhs_dilation=self.lhs_dilation,
      rhs_dilation=self.rhs_dilation,
      dimension_numbers=self.dimension_numbers,
      feature_group_count=self.feature_group_count,
      precision=self.precision,
    )


class ConvKey(nnx.Variable):
  """PRNG key of a conv layer whose conv function draws random numbers; advanced every call.

  Not an ``nnx.Param``: a train step must carry it like BatchNorm statistics (``nnx.jit`` and
  ``nnx.value_and_grad`` do; a functional loop must return ``nnx.state(model)``).
  """


def next_call_key(key_variable: ConvKey | None) -> Array | None:
  """This call's key of a layer (``None`` when the layer holds no key).

  Splits the layer's :class:`ConvKey` and advances it: a fresh key per call (= per layer and
  step). Inside a data-parallel step (:func:`jaxprune.distributed.per_device_keys`) the
  returned key also folds in the device's index, so each device draws for its own shard, while
  the stored key advances as on one device.
  """
  if key_variable is None:
    return None
  state_key, key = jax.random.split(key_variable[...])
  key_variable[...] = state_key
  return device_key(key)


def _conv_key(layer: nnx.Module) -> ConvKey | None:
  """The layer's :class:`ConvKey` Variable, whatever attribute holds it (at most one)."""
  keys = [value for value in vars(layer).values() if isinstance(value, ConvKey)]
  if len(keys) > 1:
    raise ValueError(f"{type(layer).__name__} holds {len(keys)} ConvKey Variables, at most 1")
  return keys[0] if keys else None


class PluggableConv(nnx.Conv):
  """A 2-D ``nnx.Conv`` (NHWC) that calls its conv function with an explicit per-call key.

  Same parameters and forward as ``nnx.Conv`` (dtype promotion, the weight ``mask``, the
  bias); the convolution is ``conv_general_dilated``, a conv function of this module's
  protocol, called with ``key=`` when the layer holds a :class:`ConvKey` (any attribute name;
  :func:`conv_sharing_variables` carries it to a converted layer). ``preferred_element_type``
  is applied to the conv function's output. Padding ``"CIRCULAR"``, ``"REFLECT"`` and
  ``"CAUSAL"`` are not supported.
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size,
    strides=1,
    *,
    conv_general_dilated: ConvFunction,
    rngs: nnx.Rngs,
    **conv_kwargs,
  ):
    """Builds the layer; ``conv_kwargs`` are ``nnx.Conv``'s keyword arguments.

    Raises:
      ValueError: padding ``"CIRCULAR"``, ``"REFLECT"`` or ``"CAUSAL"``.
    """
    padding = conv_kwargs.get("padding", "SAME")
    if isinstance(padding, str) and padding.upper() in ("CIRCULAR", "REFLECT", "CAUSAL"):
      raise ValueError(f"padding {padding!r} is not supported by {type(self).__name__}")
    super().__init__(
      in_features,
      out_features,
      kernel_size,
      strides,
      conv_general_dilated=conv_general_dilated,
      rngs=rngs,
      **conv_kwargs,
    )

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    del out_sharding
    if inputs.ndim != 4:
      raise ValueError(
        f"{type(self).__name__} supports 2-D convolutions only, got input {inputs.shape}"
      )
    kernel = self.kernel[...]
    if self.mask is not None:
      kernel = kernel * self.mask
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
    key = next_call_key(_conv_key(self))
    y = self.conv_general_dilated(
      inputs,
      kernel,
      spatial_pair(self.strides, "strides"),
      canonical_padding(self.padding, _PADDINGS),
      lhs_dilation=spatial_pair(self.input_dilation or 1, "input_dilation"),
      rhs_dilation=spatial_pair(self.kernel_dilation or 1, "kernel_dilation"),
      dimension_numbers=_NHWC,
      feature_group_count=self.feature_group_count,
      precision=self.precision,
      **({} if key is None else {"key": key}),
    )
    if self.preferred_element_type is not None:
      y = y.astype(self.preferred_element_type)
    if bias is not None:
      y = y + bias.astype(y.dtype)
    return y


def conv_sharing_variables(cls: type, conv: nnx.Conv, **kwargs) -> nnx.Conv:
  """An instance of ``cls`` that holds ``conv``'s very Variables.

  ``cls`` is an ``nnx.Conv`` subclass; the instance has ``conv``'s settings and holds ``conv``'s
  very ``kernel`` / ``bias`` Variables and :class:`ConvKey` (same attribute): what a converter puts
  in a conv's place so the parameter tree, the optimizer state, the key stream and checkpoints stay
  the same.

  ``kwargs`` go to ``cls``'s constructor (its own settings, e.g. its ``conv_general_dilated``).
  """
  zeros = nnx.initializers.zeros
  new = cls(
    conv.in_features,
    conv.out_features,
    conv.kernel_size,
    conv.strides,
    rngs=nnx.Rngs(0),
    padding=conv.padding,
    input_dilation=conv.input_dilation,
    kernel_dilation=conv.kernel_dilation,
    feature_group_count=conv.feature_group_count,
    use_bias=conv.use_bias,
    mask=conv.mask,
    dtype=conv.dtype,
    param_dtype=conv.param_dtype,
    precision=conv.precision,
    promote_dtype=conv.promote_dtype,
    preferred_element_type=conv.preferred_element_type,
    # Zero init: the fresh params are replaced by the shared Variables just below.
    kernel_init=zeros,
    bias_init=zeros,
    **kwargs,
  )
  new.kernel = conv.kernel
  new.bias = conv.bias
  for name, value in list(vars(conv).items()):
    if isinstance(value, ConvKey):
      setattr(new, name, value)
  return new
