"""PruneTrain's optimizer wrapper: the inner optimizer plus the channel group lasso (PruneTrain §4.1).

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxprune.prunetrain.group_lasso import (
  GroupLassoRatioState,
  PathPredicate,
  group_lasso_from_ratio,
  group_shrink,
  set_coefficient_once,
)
from jaxprune.prunetrain.penalised import PenalisedAxes
from jaxprune.train.optim import find_lr_states

__all__ = ["PruneTrainState", "with_group_lasso"]


class PruneTrainState(NamedTuple):
  """State of :func:`with_group_lasso`.

  Attributes:
    group_lasso: λ (set at the first update, then fixed) and whether it is set.
    inner: the wrapped optimizer's state.
    count: updates so far (the proximal step's ``learning_rate`` schedule position).
  """

  group_lasso: GroupLassoRatioState
  inner: Any
  count: Any = None


def _applied_lr(inner_state: Any) -> Optional[jax.Array]:
  """The LR the inner optimizer's :func:`jaxprune.train.scale_by_lr` just applied, if any."""
  lr_states = find_lr_states(inner_state)
  return lr_states[0].lr if lr_states else None


def with_group_lasso(
  inner: optax.GradientTransformation,
  *,
  penalty_ratio: float = 0.2,
  proximal: bool = False,
  learning_rate: Optional[optax.ScalarOrSchedule] = None,
  is_input_conv: Optional[PathPredicate] = None,
  is_classifier: Optional[PathPredicate] = None,
  penalised: Optional[PenalisedAxes] = None,
) -> optax.GradientTransformationExtraArgs:
  """PruneTrain's optimizer: ``inner`` with the channel group lasso λ·GL (§4.1).

  λ is computed at the first update from the loss (``value=``) and the group lasso of the
  initial params so that λ·GL₀ / (CE₀ + λ·GL₀) = ``penalty_ratio`` (Eq. 3), then fixed; an
  update with a non-finite loss leaves λ unset (no penalty) until the first finite loss.
  :func:`reconfigure` slices ``inner``'s parameter-shaped state and keeps λ.

  Two ways to apply the penalty:

  * ``proximal=False`` (the paper's): ``inner`` is applied to ``grad + λ·∇GL(params)``, so
    the penalty gradient goes through ``inner`` (momentum included), as a loss term would.
    Groups then oscillate around zero with an amplitude of about lr·λ and reach the
    paper's 1e-4 threshold only after many epochs.
  * ``proximal=True`` (an extension, not in the paper): ``inner`` sees the loss gradient
    only and the new parameters are group-soft-thresholded,
    ``p ← shrink(p + u, η·λ)`` (:func:`jaxprune.prunetrain.group_lasso.group_shrink`), η the step's
    learning rate.  A group whose norm after the step is at most η·λ becomes *exactly* zero,
    so a reconfiguration with the paper's 1e-4 threshold removes only channels that carry
    nothing.  Whether groups get there within a short run depends on λ: a zero group still
    receives loss gradients, so it stays at zero only while η·λ exceeds what ``inner``
    adds to it: on the digits quickstart a ratio near 1 zeroes some channels within a few epochs,
    0.9 none, and one too close to 1 every group (measured in ``docs/design.md``, "PruneTrain").
    η is ``learning_rate`` when given, else the LR that ``inner``'s
    :func:`jaxprune.train.scale_by_lr` just applied (schedule and the dynamic mini-batch's
    linear scaling included: build ``inner`` with :func:`jaxprune.train.sgd`).  Momentum
    does not amplify the proximal step, so a given shrink speed needs a λ about
    1/(1 − momentum) times larger than with ``proximal=False``.

  Args:
    inner: the optimizer, e.g. ``optax.sgd(lr, momentum=0.9)``.
    penalty_ratio: group-lasso share of the initial total loss, in (0, 1); paper 0.2.
    proximal: apply the penalty as a proximal step after ``inner`` (see above).
    learning_rate: η of the proximal step (a constant or a schedule of the update count);
      only with ``proximal=True``.
    is_input_conv: see :func:`jaxprune.prunetrain.group_lasso.leaf_groups`.
    is_classifier: see :func:`jaxprune.prunetrain.group_lasso.leaf_groups`.
    penalised: the penalised kernel axes read off the model's channel graph
      (:func:`jaxprune.prunetrain.penalised_axes`, or an unbound
      :class:`~jaxprune.prunetrain.PenalisedAxes` that :class:`PruneTrainCallback` binds when
      ``fit`` starts). Without it the group lasso goes by shape and name (every 2-D / 4-D leaf
      a kernel, the last 2-D one the classifier), which holds for the papers' CNNs; a tree it
      does not fit (a transformer's positional embedding, 3-D attention kernels) is refused
      at ``init`` by name. :func:`jaxprune.prunetrain.method` passes one always.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs ``params`` and
    ``value=loss``; other extra args are forwarded to ``inner``.

  Raises:
    ValueError: ``penalty_ratio`` outside (0, 1); ``learning_rate`` without
      ``proximal=True``; with ``proximal=True``, no ``learning_rate`` and no
      ``scale_by_lr`` in ``inner`` (raised at ``init``).

  Example::

    tx = with_group_lasso(optax.sgd(0.1, momentum=0.9), penalty_ratio=0.2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    optimizer.update(model, grads, value=loss)

    # groups at exactly zero within a few epochs (the ratio the measurement above needed);
    # the step size comes from train.sgd's scale_by_lr
    tx = with_group_lasso(train.sgd(schedule, momentum=0.9), penalty_ratio=0.99, proximal=True)
  """
  if learning_rate is not None and not proximal:
    raise ValueError("learning_rate is the proximal step size: pass it with proximal=True")
  regularizer = group_lasso_from_ratio(
    penalty_ratio, is_input_conv=is_input_conv, is_classifier=is_classifier, penalised=penalised
  )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    inner_state = inner.init(params)
    if proximal and learning_rate is None and _applied_lr(inner_state) is None:
      raise ValueError(
        "learning_rate: proximal=True needs the step size; pass learning_rate or build "
        "inner with jaxprune.train.sgd / scale_by_lr"
      )
    return PruneTrainState(
      regularizer.init(params), inner_state, jnp.zeros([], jnp.int32) if proximal else None
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not proximal:
      updates, lasso_state = regularizer.update(updates, state.group_lasso, params, **extra_args)
      updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
      return updates, PruneTrainState(lasso_state, inner_state, state.count)
    # λ only: the proximal form does not add the penalty gradient.
    lasso_state = set_coefficient_once(
      state.group_lasso,
      penalty_ratio,
      params,
      extra_args.get("value"),
      is_input_conv=is_input_conv,
      is_classifier=is_classifier,
      penalised=penalised,
    )
    updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
    if learning_rate is None:
      step_size = _applied_lr(inner_state)
    elif callable(learning_rate):
      step_size = learning_rate(state.count)
    else:
      step_size = learning_rate
    moved = optax.apply_updates(params, updates)
    shrunk = group_shrink(
      moved,
      jnp.asarray(step_size, jnp.float32) * lasso_state.coefficient,
      is_input_conv=is_input_conv,
      is_classifier=is_classifier,
      penalised=penalised,
    )
    # Leaves without groups come back from group_shrink as the very same array: keep their
    # update exactly as ``inner`` made it instead of the rounded (p + u) − p.
    updates = jax.tree.map(
      lambda new, before, old, u: u if new is before else (new - old).astype(u.dtype),
      shrunk,
      moved,
      params,
      updates,
    )
    return updates, PruneTrainState(lasso_state, inner_state, state.count + 1)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
