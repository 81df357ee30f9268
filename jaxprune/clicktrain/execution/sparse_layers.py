"""The layers ClickTrain's pruned convs become once the masks are final (§5.2, beyond it).

Both are :class:`jaxprune.models.PluggableConv` layers holding the very ``kernel`` / ``bias``
Variables of the conv they replace (so params, optimizer state and checkpoints are unchanged)
and computing that conv's function with its pruned weights at zero. Their convolution replaces
the innermost conv function of the conv they come from and keeps every wrapper around it (e.g.
SDGP's pruned data gradient), with the layer's key Variable:

* :class:`PatternConv`: the paper's fine-grained pattern-sparse conv on a fixed layout
  (:func:`~jaxprune.clicktrain.execution.pattern_conv.pattern_conv`);
* :class:`AlignedConv`: the aligned (group-shared) layout as slices and one batched matrix
  product (:func:`~jaxprune.clicktrain.execution.aligned_conv.aligned_conv`).

:mod:`jaxprune.clicktrain.execution.conversion` decides which layer each pruned conv becomes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxprune._conv_args import canonical_padding
from jaxprune.clicktrain.execution.aligned_conv import AlignedConvFn, check_columns
from jaxprune.clicktrain.execution.aligned_layout import AlignedLayout
from jaxprune.clicktrain.execution.pattern_conv import check_backend, pattern_conv
from jaxprune.clicktrain.execution.pattern_layout import PatternLayout
from jaxprune.models import PluggableConv, base_function, conv_sharing_variables, with_base

__all__ = ["AlignedConv", "PatternConv", "check_convertible"]


class _StaticLayout:
  """Holds a layout as a static (graph-definition) attribute: never a state leaf."""

  def __init__(self, layout: PatternLayout):
    self.layout = layout

  def __repr__(self) -> str:
    return f"PatternLayout(kernel_shape={self.layout.kernel_shape}, width={self.layout.width})"


def _conv_padding(conv: nnx.Conv, name: str):
  try:
    return canonical_padding(conv.padding)
  except ValueError as err:
    raise ValueError(f"{name}: {err} (PatternConv)") from None


def check_convertible(conv: nnx.Conv, name: str) -> None:
  """Raises ``ValueError`` naming ``name`` unless the sparse layers can run ``conv``.

  They run a 2-D, ungrouped, undilated conv with SAME / VALID / explicit padding and no weight mask
  of its own.
  """
  if len(conv.kernel_size) != 2:
    raise ValueError(f"{name}: PatternConv handles 2-D convolutions, got {conv.kernel_size}")
  if conv.feature_group_count != 1:
    raise ValueError(f"{name}: grouped convolutions are not supported by PatternConv")
  for attr in ("input_dilation", "kernel_dilation"):
    value = getattr(conv, attr)
    if value not in (None, 1) and tuple(np.broadcast_to(value, (2,))) != (1, 1):
      raise ValueError(f"{name}: {attr} {value!r} is not supported by PatternConv")
  if conv.mask is not None:
    raise ValueError(f"{name}: a conv with its own weight mask is not supported by PatternConv")
  _conv_padding(conv, name)


@dataclasses.dataclass(frozen=True)
class _PatternConvFunction:
  """:func:`pattern_conv` on a fixed layout as a conv function of the shared protocol
  (:mod:`jaxprune.models.pluggable_conv`): the innermost function of a ``PatternConv``, under
  any wrapper its conv had (e.g. SDGP's pruned data gradient)."""

  holder: _StaticLayout
  backend: str

  def __call__(self, lhs, rhs, window_strides, padding, **geometry) -> jax.Array:
    # Dilation, groups and layout are checked once, when the conv is converted
    # (`_check_convertible`); pattern_conv is NHWC × HWIO without them.
    del geometry
    return pattern_conv(
      lhs, rhs, self.holder.layout, strides=window_strides, padding=padding, backend=self.backend
    )


class PatternConv(PluggableConv):
  """``nnx.Conv`` whose kernel is pattern-sparse on a fixed layout (ClickTrain §5.2).

  Same parameters (``kernel``, ``bias``: the very Variables of the conv it replaces) and the
  same function as that conv with its pruned weights at zero; the convolution runs
  :func:`~jaxprune.clicktrain.execution.pattern_conv.pattern_conv` with ``backend``.

  The sparse convolution replaces the innermost conv function of the conv it comes from
  (:func:`jaxprune.models.with_base`) and keeps every wrapper around it, with the layer's
  key Variable: converted from an SDGP conv, it keeps SDGP's backward pass (the weight
  gradient from the dense output gradient, the data gradient from the N:M-pruned one, both
  through the sparse path) without this package knowing SDGP.

  Build it with :meth:`from_conv`; :func:`to_sparse_layers` does it for a whole model.
  """

  @classmethod
  def from_conv(
    cls, conv: nnx.Conv, layout: PatternLayout, *, backend: str = "reference", name: str = "conv"
  ) -> PatternConv:
    """A ``PatternConv`` sharing ``conv``'s Variables, running on ``layout``.

    Raises:
      ValueError: an unknown backend (or ``"pallas"`` without Pallas's Triton backend), a
        layout of another kernel shape, or a conv that the sparse path cannot run (grouped,
        dilated, circular padding, its own mask).
    """
    check_backend(backend)
    return _replacing(cls, conv, layout, _PatternConvFunction(_StaticLayout(layout), backend), name)

  @property
  def layout(self) -> PatternLayout:
    return base_function(self.conv_general_dilated).holder.layout

  @property
  def backend(self) -> str:
    return base_function(self.conv_general_dilated).backend


class AlignedConv(PluggableConv):
  """``nnx.Conv`` whose kernel is pruned on an aligned layout (ClickTrain's aligned mode).

  The convolution is :class:`~jaxprune.clicktrain.execution.aligned_conv.AlignedConvFn` on the
  layout, put under every wrapper the conv had (as :class:`PatternConv`). Build it with
  :meth:`from_conv`; :func:`~jaxprune.clicktrain.execution.conversion.to_sparse_layers` with
  ``filter_groups`` does it for a whole model.
  """

  @classmethod
  def from_conv(
    cls, conv: nnx.Conv, layout: AlignedLayout, *, name: str = "conv", columns: str = "per_group"
  ) -> AlignedConv:
    """An ``AlignedConv`` sharing ``conv``'s Variables, running on ``layout``.

    Its columns are made per group or shared
    (:func:`~jaxprune.clicktrain.execution.aligned_conv.aligned_conv`).

    Raises:
      ValueError: a layout of another kernel shape, a conv that is already sparse, one the
        aligned path cannot run (grouped, dilated, circular padding, its own mask), or bad
        ``columns``.
    """
    check_columns(columns)
    return _replacing(cls, conv, layout, AlignedConvFn(layout, columns), name)

  @property
  def layout(self) -> AlignedLayout:
    return base_function(self.conv_general_dilated).layout

  @property
  def columns(self) -> str:
    return base_function(self.conv_general_dilated).columns


def _replacing(cls, conv: nnx.Conv, layout, base, name: str):
  """A ``cls`` sharing ``conv``'s Variables whose innermost conv function is ``base`` (every
  wrapper of ``conv``'s kept), after checking that ``conv`` can be replaced by it."""
  if isinstance(conv, (PatternConv, AlignedConv)):
    raise ValueError(f"{name}: conv is already a {type(conv).__name__}")
  check_convertible(conv, name)
  if tuple(layout.kernel_shape) != tuple(conv.kernel.shape):
    raise ValueError(
      f"{name}: layout kernel shape {layout.kernel_shape} != conv kernel {conv.kernel.shape}"
    )
  return conv_sharing_variables(
    cls, conv, conv_general_dilated=with_base(conv.conv_general_dilated, base)
  )
