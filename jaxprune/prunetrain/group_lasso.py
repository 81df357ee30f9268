"""Channel group lasso (PruneTrain Eq. 2) as Optax gradient transformations.

PruneTrain (Lym et al., SC'19, §4.1) sparsifies whole channels with an
unweighted group lasso: every output channel and every input channel of every
convolution, and every input column of every fully-connected layer, is one
group, penalised by its L2 norm with a single global coefficient λ.  The
network's input channels (the stem conv's 3 colour channels) and the logits
(the classifier's outputs) are never penalised, because "the input data and
output predictions of a CNN have logical significance and should always be
dense" (§4.1).  BatchNorm parameters and biases are not penalised.

λ is set once, at the first step, from a *penalty ratio* r (§4.1, Eq. 3):
λ·GL₀ / (CE₀ + λ·GL₀) = r, where CE₀ is the first mini-batch loss and GL₀ the
penalty of the freshly initialised weights; it stays fixed afterwards.  A step
with a non-finite loss does not count as the first: λ waits for a finite CE₀.

Groups are found on any parameter pytree (Flax NNX ``State`` or Linen dicts):
4-D leaves are HWIO conv kernels, 2-D leaves are dense kernels ``(in, out)``.
Two predicates, both overridable, say which conv reads the image and which
dense layer is the classifier.

Example::

  >>> import jax.numpy as jnp, optax
  >>> from jaxprune.prunetrain import add_group_lasso
  >>> params = {"stem": {"kernel": jnp.ones((3, 3, 3, 8))},
  ...           "conv": {"kernel": jnp.ones((3, 3, 8, 8))},
  ...           "head": {"kernel": jnp.ones((8, 10))}}
  >>> tx = optax.chain(add_group_lasso(1e-4), optax.sgd(0.1))
  >>> state = tx.init(params)
  >>> updates, state = tx.update(params, state, params)

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax

from jaxprune.paths import param_path
from jaxprune.prunetrain.penalised import KernelAxes, PenalisedAxes, check_default_rule

__all__ = [
  "EPSILON",
  "GroupLassoState",
  "GroupLassoRatioState",
  "LeafGroups",
  "coefficient_from_ratio",
  "default_is_classifier",
  "default_is_input_conv",
  "add_group_lasso",
  "check_default_rule",
  "group_lasso_from_ratio",
  "group_shrink",
  "leaf_groups",
  "penalty",
  "penalty_gradient",
  "set_coefficient_once",
]

# PruneTrain's group norm is sqrt(Σw² + ε): ε keeps the gradient finite at a
# group that has reached exactly zero (the authors' code uses the same 1e-8).
EPSILON = 1e-8

KeyPath = tuple[Any, ...]
# predicate(names, leaf, kernels) -> bool.  ``names`` is the
# leaf's path as plain names (str / int), ``kernels`` the (names, ndim) of every
# 2-D/4-D leaf in flatten order (lets a rule say "the first" / "the last").
PathPredicate = Callable[[tuple, Any, Sequence[tuple]], bool]


def _is_kernel(leaf: Any) -> bool:
  return hasattr(leaf, "ndim") and leaf.ndim in (2, 4)


def _names_input_conv(names: tuple) -> bool:
  return (
    "stem" in names
    or names[:2] == ("features", 0)
    or names[:2] == ("features", "0")
    or names[:1] == ("Conv_0",)
  )


def default_is_classifier(names: tuple, leaf: Any, kernels: Sequence[tuple]) -> bool:
  """Whether a 2-D kernel is the classifier (its outputs are the logits).

  The classifier is the last dense kernel in flatten order (``head`` in the
  jaxprune ResNets, the last ``classifier`` entry in the VGGs).

  Args:
    names: the leaf's path names.
    leaf: the kernel.
    kernels: ``(names, ndim)`` of every 2-D / 4-D leaf, in flatten order.

  Returns:
    True if the kernel's output columns must not be penalised.
  """
  del leaf
  dense = [p for p, ndim in kernels if ndim == 2]
  return bool(dense) and names == dense[-1]


@dataclasses.dataclass(frozen=True)
class LeafGroups:
  """Which channel groups a kernel leaf contributes (static, not a pytree).

  Attributes:
    output_axis: axis indexing the output channels whose groups are penalised
      (3 for HWIO conv, 1 for dense), or None.
    input_axis: axis indexing the penalised input channels (2 / 0), or None.
  """

  output_axis: Optional[int]
  input_axis: Optional[int]

  def group_sum_squares(self, leaf: jax.Array, *, keepdims: bool = False) -> list[jax.Array]:
    """Σw² per group.

    One vector per penalised axis (output first), or with ``keepdims`` one array that broadcasts
    against ``leaf``.
    """
    sums = []
    for axis in (self.output_axis, self.input_axis):
      if axis is not None:
        other = tuple(a for a in range(leaf.ndim) if a != axis)
        sums.append(jnp.sum(jnp.square(leaf), axis=other, keepdims=keepdims))
    return sums

  def shrink(self, leaf: jax.Array, threshold: jax.Array) -> jax.Array:
    """Group soft-thresholding, output groups first, then input groups (:func:`group_shrink`)."""
    for axis in (self.output_axis, self.input_axis):
      if axis is None:
        continue
      other = tuple(a for a in range(leaf.ndim) if a != axis)
      norm = jnp.sqrt(jnp.sum(jnp.square(leaf.astype(jnp.float32)), axis=other, keepdims=True))
      # max(0, 1 − t/‖g‖), written so that a zero group gives 0, not 0/0
      scale = jnp.maximum(norm - threshold, 0.0) / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny)
      leaf = (leaf * scale).astype(leaf.dtype)
    return leaf


_LAYOUTS = (LeafGroups, KernelAxes)


def _is_layout_leaf(x: Any) -> bool:
  return x is None or isinstance(x, _LAYOUTS)


def leaf_groups(
  params: Any,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> Any:
  """The group layout of every leaf of a parameter pytree.

  Args:
    params: a parameter pytree.
    is_input_conv: predicate ``(names, leaf, kernels) -> bool`` for convs whose
      input channels are not grouped; default :func:`default_is_input_conv`.
    is_classifier: predicate for the dense layer whose outputs are not grouped;
      default :func:`default_is_classifier`.  ``kernels`` holds
      ``(names, ndim)`` pairs for both predicates.
    penalised: the kernel axes read off the model's channel graph
      (:func:`jaxprune.prunetrain.penalised_axes`); when given, it alone decides, by
      structure, and the two predicates must not be given.

  Returns:
    A pytree of ``params``' structure with a :class:`LeafGroups` (a
    :class:`~jaxprune.prunetrain.penalised.KernelAxes` with ``penalised``), or None for
    leaves without groups (biases, BatchNorm, scalars), at every leaf.

  Raises:
    ValueError: ``penalised`` together with a predicate.
  """
  if penalised is not None and not penalised.bound:
    penalised = None  # not bound yet (no callback in this loop): the shape rule decides
  if penalised is not None:
    if is_input_conv is not None or is_classifier is not None:
      raise ValueError(
        "penalised: the graph's penalised axes decide the input conv and the classifier by "
        "structure; pass either penalised or is_input_conv / is_classifier"
      )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    layout = [penalised.of(param_path(path)) for path, _ in flat]
    return jax.tree_util.tree_unflatten(treedef, layout)
  is_input_conv = is_input_conv or default_is_input_conv
  is_classifier = is_classifier or default_is_classifier
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  kernels = [(param_path(p), leaf.ndim) for p, leaf in flat if _is_kernel(leaf)]
  layout = []
  for path, leaf in flat:
    names = param_path(path)
    if not _is_kernel(leaf):
      layout.append(None)
    elif leaf.ndim == 4:
      skip_inputs = is_input_conv(names, leaf, kernels)
      layout.append(LeafGroups(output_axis=3, input_axis=None if skip_inputs else 2))
    else:
      skip_outputs = is_classifier(names, leaf, kernels)
      layout.append(LeafGroups(output_axis=None if skip_outputs else 1, input_axis=0))
  return jax.tree_util.tree_unflatten(treedef, layout)


def default_is_input_conv(names: tuple, leaf: Any, kernels: Sequence[tuple]) -> bool:
  """Whether a 4-D kernel is the conv that reads the image (no input groups).

  By name: a path through ``stem`` (jaxprune ResNets), ``features/0`` (jaxprune
  VGGs) or a top-level ``Conv_0`` (Linen).  A tree with none of those names
  falls back to the first conv kernel in flatten order.  Names, not shapes:
  after a reconfiguration an inner conv may have as few channels as the image.

  Args:
    names: the leaf's path names.
    leaf: the kernel.
    kernels: ``(names, ndim)`` of every 2-D / 4-D leaf, in flatten order.

  Returns:
    True if the kernel's input channels must not be penalised.
  """
  del leaf
  conv_paths = [p for p, ndim in kernels if ndim == 4]
  if any(_names_input_conv(p) for p in conv_paths):
    return _names_input_conv(names)
  return bool(conv_paths) and names == conv_paths[0]


def penalty(
  params: Any,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> jax.Array:
  """The unweighted channel group lasso Σ_g sqrt(Σ_{w∈g} w² + ε) (PruneTrain Eq. 2).

  Args:
    params: a parameter pytree (HWIO conv kernels, ``(in, out)`` dense kernels).
    is_input_conv: see :func:`leaf_groups`.
    is_classifier: see :func:`leaf_groups`.
    penalised: see :func:`leaf_groups`.

  Returns:
    A float32 scalar (0 for a tree without kernels).
  """
  layout = leaf_groups(
    params, is_input_conv=is_input_conv, is_classifier=is_classifier, penalised=penalised
  )
  total = jnp.zeros((), jnp.float32)
  for groups, leaf in zip(
    jax.tree.leaves(layout, is_leaf=lambda x: x is None), jax.tree.leaves(params)
  ):
    if groups is None:
      continue
    for sums in groups.group_sum_squares(leaf):
      total = total + jnp.sum(jnp.sqrt(sums.astype(jnp.float32) + EPSILON))
  return total


def coefficient_from_ratio(ratio: float, loss: Any, penalty: Any) -> jax.Array:
  """λ such that λ·penalty / (loss + λ·penalty) = ratio (PruneTrain Eq. 3).

  Solving for λ: λ = ratio·loss / ((1 − ratio)·penalty).

  Args:
    ratio: the group-lasso share of the total loss, in (0, 1) (paper: 0.2–0.25).
    loss: the classification loss at the first step (CE₀), ≥ 0.
    penalty: the group lasso of the initial weights (GL₀), > 0.

  Returns:
    λ as a float32 scalar array.  Concrete inputs are validated; traced ones
    (inside ``jit``) are not.

  Raises:
    ValueError: ``ratio`` outside (0, 1), ``penalty`` ≤ 0 or ``loss`` < 0 (or
      non-finite).
  """
  if not isinstance(ratio, jax.core.Tracer):
    ratio_value = float(ratio)
    if not 0.0 < ratio_value < 1.0:
      raise ValueError(f"ratio must lie in (0, 1), got {ratio_value}")
  if not isinstance(penalty, jax.core.Tracer):
    penalty_value = float(penalty)
    if not (math.isfinite(penalty_value) and penalty_value > 0.0):
      raise ValueError(f"penalty must be a positive finite number, got {penalty_value}")
  if not isinstance(loss, jax.core.Tracer):
    loss_value = float(loss)
    if not (math.isfinite(loss_value) and loss_value >= 0.0):
      raise ValueError(f"loss must be a non-negative finite number, got {loss_value}")
  ratio = jnp.asarray(ratio, jnp.float32)
  return (
    ratio * jnp.asarray(loss, jnp.float32) / ((1.0 - ratio) * jnp.asarray(penalty, jnp.float32))
  )


def group_shrink(
  params: Any,
  threshold: Any,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> Any:
  """Group soft-thresholding: the proximal step of ``threshold``·GL (PruneTrain Eq. 2).

  Every group ``g`` becomes ``g·max(0, 1 − threshold/‖g‖)``: groups with norm at most
  ``threshold`` are set to exactly zero, the others shrink by ``threshold`` in norm.  A
  kernel in both an output and an input family (every inner conv) is shrunk by its output
  groups first, then by its input groups.  The groups overlap, so this sequence is an
  approximation of the proximal operator of the summed penalty, the usual one in proximal
  training of overlapping group lasso; each step is exact for its own family, and a group
  already at zero stays at zero.

  Args:
    params: a parameter pytree.
    threshold: η·λ (step size times coefficient), a non-negative scalar.
    is_input_conv: see :func:`leaf_groups`.
    is_classifier: see :func:`leaf_groups`.
    penalised: see :func:`leaf_groups`.

  Returns:
    ``params`` with every penalised group shrunk; other leaves unchanged.
  """
  layout = leaf_groups(
    params, is_input_conv=is_input_conv, is_classifier=is_classifier, penalised=penalised
  )
  threshold = jnp.asarray(threshold, jnp.float32)

  def shrink(groups: Any, leaf: Any) -> Any:
    return leaf if groups is None else groups.shrink(leaf, threshold)

  return jax.tree.map(shrink, layout, params, is_leaf=_is_layout_leaf)


class GroupLassoState(NamedTuple):
  """Stateless: :func:`add_group_lasso` keeps no statistics."""


def penalty_gradient(
  params: Any,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> Any:
  """∇GL(params) of :func:`penalty`, written out (PruneTrain Eq. 2).

  Each group ``g`` contributes ``w_g / sqrt(Σ_{w∈g} w² + ε)``.

  Equal to ``jax.grad(penalty)``, but computed as one norm per group family and one product
  per kernel.  Autodiff of the summed penalty compiles to about twice as many small fused
  ops (the forward sums, their reverse broadcasts and the per-family adds, per kernel); on a
  CPU each is a separate dispatch, and a ResNet-32 step has ~30 kernels.

  Args:
    params: a parameter pytree.
    is_input_conv: see :func:`leaf_groups`.
    is_classifier: see :func:`leaf_groups`.
    penalised: see :func:`leaf_groups`.

  Returns:
    A pytree like ``params``: the gradient, zero for leaves without groups.
  """
  layout = leaf_groups(
    params, is_input_conv=is_input_conv, is_classifier=is_classifier, penalised=penalised
  )

  def gradient(groups: Any, leaf: Any) -> Any:
    if groups is None:
      return jnp.zeros_like(leaf)
    w = leaf.astype(jnp.float32)
    sums = groups.group_sum_squares(w, keepdims=True)
    inverse_norms = sum(jax.lax.rsqrt(s + EPSILON) for s in sums)
    return (w * inverse_norms).astype(leaf.dtype)

  return jax.tree.map(gradient, layout, params, is_leaf=_is_layout_leaf)


def _add_penalty_gradient(
  updates: Any, params: Any, coefficient: jax.Array, is_input_conv, is_classifier, penalised
) -> Any:
  grads = penalty_gradient(
    params, is_input_conv=is_input_conv, is_classifier=is_classifier, penalised=penalised
  )
  return jax.tree.map(lambda u, g: u + (coefficient * g).astype(u.dtype), updates, grads)


def add_group_lasso(
  coefficient: float,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> optax.GradientTransformationExtraArgs:
  """Adds λ·∇GL(params) to the gradient, GL the channel group lasso (PruneTrain Eq. 2).

  Place it before the optimizer (like ``optax.add_decayed_weights``) so that
  the penalty gradient goes through momentum, as with a penalty in the loss.

  Args:
    coefficient: λ ≥ 0.
    is_input_conv: see :func:`leaf_groups`.
    is_classifier: see :func:`leaf_groups`.
    penalised: see :func:`leaf_groups`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``.

  Raises:
    ValueError: a concrete ``coefficient`` that is negative, infinite, NaN or a bool.

  Example::

    tx = optax.chain(add_group_lasso(1e-4), optax.sgd(0.1, momentum=0.9))
  """
  if not isinstance(coefficient, jax.core.Tracer) and (
    isinstance(coefficient, bool)
    or not math.isfinite(float(coefficient))
    or not float(coefficient) >= 0.0
  ):
    raise ValueError(f"coefficient must be a finite number >= 0, got {coefficient!r}")

  def init_fn(params):
    if penalised is None:
      check_default_rule(params)
    return GroupLassoState()

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError("add_group_lasso needs params: call update(updates, state, params)")
    return _add_penalty_gradient(
      updates,
      params,
      jnp.asarray(coefficient, jnp.float32),
      is_input_conv,
      is_classifier,
      penalised,
    ), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class GroupLassoRatioState(NamedTuple):
  """State of :func:`group_lasso_from_ratio`.

  Attributes:
    coefficient: λ, 0 until the first update with a finite loss sets it (then fixed).
    initialized: whether λ has been set.
  """

  coefficient: jax.Array
  initialized: jax.Array


def group_lasso_from_ratio(
  penalty_ratio: float = 0.2,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> optax.GradientTransformationExtraArgs:
  """Group lasso whose λ is set at the first step from a penalty ratio (PruneTrain §4.1).

  At the first ``update`` λ = r·CE₀ / ((1 − r)·GL₀) with CE₀ = ``value`` (the
  loss passed as an extra argument) and GL₀ the penalty of ``params`` (the
  initial weights); an update with a NaN / Inf loss leaves λ unset (no penalty)
  and the next finite one sets it.  λ then stays fixed, also across reconfigurations (only
  parameter-shaped state is sliced).  Every update adds λ·∇GL(params).

  Args:
    penalty_ratio: r in (0, 1); the paper uses 0.2 (0.25 for stronger pruning).
    is_input_conv: see :func:`leaf_groups`.
    is_classifier: see :func:`leaf_groups`.
    penalised: see :func:`leaf_groups`.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` needs ``params``
    and ``value=loss``.

  Raises:
    ValueError: ``penalty_ratio`` outside (0, 1).

  Example::

    tx = optax.chain(group_lasso_from_ratio(0.2), optax.sgd(0.1, momentum=0.9))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, grads, value=loss)
  """
  if not 0.0 < float(penalty_ratio) < 1.0:
    raise ValueError(f"penalty_ratio must lie in (0, 1), got {penalty_ratio}")

  def init_fn(params):
    if penalised is None:
      check_default_rule(params)
    return GroupLassoRatioState(
      coefficient=jnp.zeros((), jnp.float32), initialized=jnp.zeros((), jnp.bool_)
    )

  def update_fn(updates, state, params=None, *, value=None, **extra_args):
    del extra_args
    state = set_coefficient_once(
      state,
      penalty_ratio,
      params,
      value,
      is_input_conv=is_input_conv,
      is_classifier=is_classifier,
      penalised=penalised,
    )
    updates = _add_penalty_gradient(
      updates, params, state.coefficient, is_input_conv, is_classifier, penalised
    )
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def set_coefficient_once(
  state: GroupLassoRatioState,
  penalty_ratio: float,
  params: Any,
  value: Any,
  *,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> GroupLassoRatioState:
  """λ of :func:`group_lasso_from_ratio`'s state, set once.

  Set from (``value``, ``params``) at the first call whose loss is finite (Eq. 3), unchanged
  afterwards.  Shared with PruneTrain's proximal form, which needs λ but not the penalty gradient.

  A step with a NaN / Inf loss (or, under ``jit``, a non-finite λ) leaves λ unset (0: no
  penalty): CE₀ is then unknown, and a λ fixed from it would be NaN for the rest of the run.

  Raises:
    ValueError: ``params`` or ``value`` (the loss) is None.
  """
  if params is None:
    raise ValueError("params: λ from the penalty ratio needs update(updates, state, params)")
  if value is None:
    raise ValueError("value: λ from the penalty ratio needs the loss, update(..., value=loss)")

  def first() -> jax.Array:
    return coefficient_from_ratio(
      penalty_ratio,
      value,
      penalty(
        params, is_input_conv=is_input_conv, is_classifier=is_classifier, penalised=penalised
      ),
    )

  if isinstance(state.initialized, jax.core.Tracer) or isinstance(value, jax.core.Tracer):
    # Under jit the step is compiled once for all steps: a conditional, so that the penalty
    # of every kernel is computed until λ is set only, not at each step.
    coefficient = jax.lax.cond(
      state.initialized, lambda: jnp.asarray(state.coefficient, jnp.float32), first
    )
    initialized = state.initialized | jnp.isfinite(coefficient)
    coefficient = jnp.where(initialized, coefficient, jnp.zeros((), jnp.float32))
    return GroupLassoRatioState(coefficient=coefficient, initialized=initialized)
  if bool(state.initialized) or not math.isfinite(float(value)):
    return state
  return GroupLassoRatioState(coefficient=first(), initialized=jnp.ones((), jnp.bool_))
