"""Which kernel axes the channel group lasso penalises, read off the model's channel graph.

PruneTrain's penalty (§4.1, Eq. 2) groups every channel that a convolution or a dense layer
writes or reads, except the network's input channels and its output predictions, which "have
logical significance and should always be dense". On a parameter pytree alone those have to be
guessed: :func:`jaxprune.prunetrain.group_lasso.leaf_groups` takes every 2-D / 4-D leaf for a
kernel and the last 2-D one for the classifier, which holds for the CNNs of the papers and not
for a transformer, whose positional embedding and ``(heads, head_dim)`` biases are 2-D too and
whose classifier need not come last in flatten order.

The traced channel graph (:func:`jaxprune.prunetrain.channel_graph`) knows both facts by
structure: a *kernel* is a variable that a convolution or a ``dot_general`` uses as its
weight, and the groups that meet the model's input or output are blocked. So the penalised
axes are the kernel axes of the groups a reconfiguration could remove: every group that is not
blocked (the image's channels, the logits, a LayerNorm'd residual stream, anything the graph
cannot follow), each kernel's channels on that axis one group. A flattened axis (a feature map
flattened into a dense layer, the heads of a ``(features, heads * head_dim)`` projection) groups
the positions of each channel together, so a head is one group across its ``head_dim`` columns.

Example::

  penalised = prunetrain.penalised_axes(model, input_shape=(1, 32, 32, 3))
  tx = prunetrain.with_group_lasso(optax.adamw(1e-3), penalised=penalised)

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxprune.paths import ParamPath, param_path
from jaxprune.prunetrain.graph import channel_graph

__all__ = ["AxisGroups", "KernelAxes", "PenalisedAxes", "check_default_rule", "penalised_axes"]


@dataclasses.dataclass(frozen=True, eq=False)
class AxisGroups:
  """One family of channel groups on one axis of a kernel.

  Attributes:
    axis: the kernel axis.
    coords: the channel of each position of the axis (-1: a position of another family), or
      None when position ``i`` is channel ``i`` (then valid at any width).
    width: the number of channels (groups) when ``coords`` is given.
  """

  axis: int
  coords: Optional[np.ndarray] = None
  width: int = 0

  def check(self, path: ParamPath, leaf: Any) -> None:
    if self.coords is not None and leaf.shape[self.axis] != self.coords.shape[0]:
      raise ValueError(
        f"penalised: {'/'.join(map(str, path))} has {leaf.shape[self.axis]} positions on axis "
        f"{self.axis}, the graph it was bound to had {self.coords.shape[0]}; bind it again to "
        "the reconfigured model (penalised.bind(model)), as PruneTrainCallback does"
      )

  def sum_squares(self, leaf: jax.Array, *, keepdims: bool = False) -> jax.Array:
    """Σw² per channel.

    A ``(width,)`` vector, or with ``keepdims`` one that broadcasts against ``leaf`` (a position
    outside the family gets +inf, so its inverse norm is 0).
    """
    other = tuple(a for a in range(leaf.ndim) if a != self.axis)
    per_position = jnp.sum(jnp.square(leaf), axis=other)
    if self.coords is None:
      return jnp.expand_dims(per_position, other) if keepdims else per_position
    valid = self.coords >= 0
    segments = np.where(valid, self.coords, self.width)
    sums = jax.ops.segment_sum(per_position, segments, num_segments=self.width + 1)[:-1]
    if not keepdims:
      return sums
    spread = jnp.where(valid, sums[np.minimum(segments, self.width - 1)], jnp.inf)
    return jnp.expand_dims(spread, other)


@dataclasses.dataclass(frozen=True, eq=False)
class KernelAxes:
  """The penalised families of one kernel (the structural counterpart of ``LeafGroups``).

  Attributes:
    path: the kernel's parameter path.
    families: one :class:`AxisGroups` per penalised (axis, channel group) pair.
  """

  path: ParamPath
  families: tuple[AxisGroups, ...]

  def group_sum_squares(self, leaf: jax.Array, *, keepdims: bool = False) -> list[jax.Array]:
    """Σw² per group, one array per family (see :meth:`AxisGroups.sum_squares`)."""
    for family in self.families:
      family.check(self.path, leaf)
    return [f.sum_squares(leaf, keepdims=keepdims) for f in self.families]

  def shrink(self, leaf: jax.Array, threshold: jax.Array) -> jax.Array:
    """Group soft-thresholding, one family after the other (as ``LeafGroups.shrink``)."""
    for family in self.families:
      family.check(self.path, leaf)
      norm = jnp.sqrt(family.sum_squares(leaf.astype(jnp.float32), keepdims=True))
      # max(0, 1 − t/‖g‖); a zero group gives 0, not 0/0; a position outside the family
      # (norm +inf) keeps its value
      scale = jnp.maximum(norm - threshold, 0.0) / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)
      scale = jnp.where(jnp.isinf(norm), 1.0, scale)
      leaf = (leaf * scale).astype(leaf.dtype)
    return leaf


class PenalisedAxes:
  """The kernel axes PruneTrain's group lasso penalises, by structure (module docstring).

  Built unbound and bound to a model (``bind``), or bound at once by :func:`penalised_axes`.
  The group-lasso transforms look the kernels up by parameter path when they are traced;
  :class:`jaxprune.prunetrain.PruneTrainCallback` binds the one it is given at the start of
  ``fit`` and again after every installed reconfiguration (a removed head changes the
  positions of a flattened axis).

  Args:
    model: the model to bind to now (optional).
    input_shape: the shape of one input batch for tracing (default: a
      :mod:`jaxprune.models` network's image).
    input_dtype: that input's dtype (default float32; ``jnp.int32`` for token ids).
  """

  def __init__(
    self,
    model: Any = None,
    input_shape: Optional[Sequence[int]] = None,
    *,
    input_dtype: Any = None,
  ):
    self._kernels: Optional[dict[ParamPath, KernelAxes]] = None
    self.input_shape = None if input_shape is None else tuple(int(d) for d in input_shape)
    self.input_dtype = input_dtype
    if model is not None:
      self.bind(model, input_shape)

  @property
  def bound(self) -> bool:
    return self._kernels is not None

  def bind(
    self, model: Any, input_shape: Optional[Sequence[int]] = None, *, graph: Any = None
  ) -> PenalisedAxes:
    """Reads the penalised axes off ``model``'s channel graph; returns ``self``.

    ``graph``: the model's :func:`~jaxprune.prunetrain.channel_graph` when the caller traced
    it already (for ``input_shape``), so it is not traced twice.

    Raises:
      ValueError: no input shape for a model without a width spec, or a model whose graph
        has no kernel to penalise.
    """
    if input_shape is not None:
      self.input_shape = tuple(int(d) for d in input_shape)
    if graph is None:
      graph = channel_graph(model, self.input_shape, input_dtype=self.input_dtype)
    self.input_shape, self.input_dtype = graph.input_shape, graph.input_dtype
    families: dict[ParamPath, list[AxisGroups]] = {}
    for group in graph.groups:
      if group.blocked:
        continue
      for use in group.kernels:
        n = use.coords.shape[0]
        identity = group.width == n and np.array_equal(use.coords, np.arange(n))
        family = (
          AxisGroups(use.axis)
          if identity
          else AxisGroups(use.axis, np.asarray(use.coords, np.int32), group.width)
        )
        families.setdefault(tuple(use.path), []).append(family)
    if not families:
      raise ValueError(
        f"model: {type(model).__name__} has no kernel channel that PruneTrain could remove, "
        "so its group lasso would penalise nothing"
      )
    self._kernels = {
      path: KernelAxes(path, tuple(sorted(f, key=lambda a: a.axis, reverse=True)))
      for path, f in families.items()
    }
    return self

  @property
  def kernels(self) -> dict[ParamPath, KernelAxes]:
    """Kernel path -> its penalised families (bound only)."""
    if self._kernels is None:
      raise ValueError(
        "penalised: not bound to a model yet; call penalised.bind(model, input_shape) or "
        "give it to PruneTrainCallback(penalised=...), which binds it when fit starts"
      )
    return self._kernels

  def of(self, path: ParamPath) -> Optional[KernelAxes]:
    """The families of the leaf at ``path`` (None: not penalised)."""
    return self.kernels.get(tuple(path))

  def summary(self) -> str:
    """One line per penalised kernel: its path and penalised axes."""
    lines = []
    for path, kernel in self.kernels.items():
      axes = ", ".join(
        str(f.axis) if f.coords is None else f"{f.axis} ({f.width} groups)" for f in kernel.families
      )
      lines.append(f"{'/'.join(map(str, path))}: axes {axes}")
    return "\n".join(lines)


def penalised_axes(
  model: Any, input_shape: Optional[Sequence[int]] = None, *, input_dtype: Any = None
) -> PenalisedAxes:
  """The group lasso's penalised kernel axes of ``model``, read off its channel graph.

  Args:
    model: any NNX model called as ``model(x)``.
    input_shape: the shape of one input batch, e.g. ``(1, 32, 32, 3)``; default the image of
      a :mod:`jaxprune.models` network.
    input_dtype: that input's dtype: float32 by default, ``jnp.int32`` for a language
      model's token ids (``penalised_axes(lm, (1, 128), input_dtype=jnp.int32)``).

  Returns:
    A bound :class:`PenalisedAxes`, for ``with_group_lasso(..., penalised=...)``.

  Raises:
    ValueError: see :meth:`PenalisedAxes.bind`.

  Example::

    penalised = prunetrain.penalised_axes(vit, input_shape=(1, 32, 32, 3))
    print(penalised.summary())
  """
  return PenalisedAxes(model, input_shape, input_dtype=input_dtype)


def check_default_rule(params: Any) -> None:
  """Refuses a tree that the shape rule of :func:`leaf_groups` would penalise wrongly.

  The rule takes every 2-D / 4-D leaf for a kernel.  In a tree whose layers name their
  weights ``kernel`` (Flax NNX and Linen), a 2-D / 4-D leaf of another name (a positional
  embedding, a ``(heads, head_dim)`` bias) would be penalised as a kernel, and a ``kernel`` of
  another rank (a ``LinearGeneral`` or 1-D conv kernel) would be skipped: both are transformer
  or non-CNN layouts, where the structural layout is the right one.

  Raises:
    ValueError: naming the leaves and pointing at :func:`jaxprune.prunetrain.penalised_axes`.
  """
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  named = [(param_path(p), leaf) for p, leaf in flat if hasattr(leaf, "ndim")]
  if not any(names and names[-1] == "kernel" for names, _ in named):
    return  # a tree of other names: the shape rule is all there is
  wrong = [
    "/".join(map(str, names))
    + (
      " (not a kernel)"
      if (hasattr(leaf, 'ndim') and leaf.ndim in (2, 4))
      else f" (a {leaf.ndim}-D kernel)"
    )
    for names, leaf in named
    if (hasattr(leaf, 'ndim') and leaf.ndim in (2, 4)) != (bool(names) and names[-1] == "kernel")
  ]
  if wrong:
    shown = ", ".join(wrong[:4]) + (f" and {len(wrong) - 4} more" if len(wrong) > 4 else "")
    raise ValueError(
      f"penalised: the default rule (every 2-D / 4-D leaf a kernel, the last 2-D one the "
      f"classifier) does not fit this model: {shown}; pass "
      "penalised=prunetrain.penalised_axes(model, input_shape), which reads the kernels and "
      "the classifier off the traced graph"
    )
