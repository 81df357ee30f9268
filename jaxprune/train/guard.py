"""A non-finite guard for hand-written loops: the ``Trainer``'s step skips a train step whose
loss or gradients are not finite; a loop of one's own gets the same from :func:`skip_nonfinite`.

One NaN gradient applied makes every parameter NaN at the next step through the momentum, and
the library's transforms keep per-parameter state (ClickTrain's scores and votes, PruneTrain's
group-lasso coefficient, the inner optimizer's moments) that a NaN would poison as well.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxprune.train import _checks
from jaxprune.train._nonfinite import skip_if_nonfinite

__all__ = ["SkipNonFiniteState", "skip_nonfinite"]


class SkipNonFiniteState(NamedTuple):
  """State of :func:`skip_nonfinite`.

  The inner transform's state as of the last finite step, and the steps skipped (int32), in all
  and in a row.
  """

  inner_state: Any
  skipped: jax.Array
  skipped_in_a_row: jax.Array


def skip_nonfinite(
  inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Wraps ``inner`` so that a step whose gradients, or loss, are not finite changes nothing.

  At such a step the update is zero and ``inner``'s state stays exactly as it was: its moments,
  its step count, and for the library's transforms their own state (ClickTrain's scores,
  votes and stage, PruneTrain's coefficient). The loss is read from the ``value`` extra
  argument when it is given (``optimizer.update(model, grads, value=loss)``), as the library's
  transforms take it. Like ``optax.apply_if_finite``, but it passes extra arguments on and
  wraps any transform, the library's included. The guard keeps params and optimizer state; a
  model's BatchNorm running statistics are updated by the forward pass, outside any
  transform: in a loop of one's own, keep them from a non-finite batch yourself (the
  ``Trainer`` does both).

  Args:
    inner: the transform to guard (``clicktrain(optax.sgd(...))``, ``with_group_lasso(...)``,
      any Optax transform).

  Returns:
    The guarded transform; its state is a :class:`SkipNonFiniteState`.

  Example:
    >>> tx = skip_nonfinite(clicktrain(optax.sgd(0.1), steps_per_epoch=390))  # doctest: +SKIP
    >>> optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # doctest: +SKIP

  References:
    Optax's ``apply_if_finite`` (optax/transforms/_conditionality.py).
  """
  inner = optax.with_extra_args_support(inner)

  def init(params):
    zero = jnp.zeros([], jnp.int32)
    return SkipNonFiniteState(inner.init(params), zero, zero)

  def update(updates, state, params=None, **extra_args):
    finite = _checks.tree_all_finite(extra_args.get("value"), updates)
    new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra_args)
    inner_state = skip_if_nonfinite(finite, new_inner, state.inner_state)
    out = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
    skipped = (~finite).astype(jnp.int32)
    in_a_row = jnp.where(finite, 0, state.skipped_in_a_row + 1).astype(jnp.int32)
    return out, SkipNonFiniteState(inner_state, state.skipped + skipped, in_a_row)

  return optax.GradientTransformationExtraArgs(init, update)
