"""Optimizer helpers: PyTorch-style SGD with coupled weight decay and an LR multiplier.

The LR lives in :func:`scale_by_lr`, whose state carries

* ``step``: the schedule position (a float; see ``schedules``),
* ``step_increment``: how far one update advances it (reference steps per epoch / steps per
  epoch at the current batch size),
* ``lr_scale``: a multiplier the trainer sets on the host, used for PruneTrain's linear
  LR scaling when the mini-batch grows (PruneTrain §4.3),
* ``lr``: the LR applied by the last update, for logging.

Because the multiplier sits *inside* the inner optimizer, a wrapper transform that
controls the final update (ClickTrain's hard masks emit ``mask * (p + u) - p``) still
sees a correctly scaled ``u``; scaling the wrapper's output instead would break it.
The trainer finds every :class:`ScaleByLrState` anywhere in an optimizer state tree
(:func:`set_lr_scale`), so any wrapper around a chain containing it keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class ScaleByLrState(NamedTuple):
  """State of :func:`scale_by_lr`."""

  step: jax.Array  # float32 schedule position
  step_increment: jax.Array  # float32 added to ``step`` per update
  lr_scale: jax.Array  # float32 multiplier set on the host
  lr: jax.Array  # float32 LR applied by the last update


def scale_by_lr(learning_rate: optax.ScalarOrSchedule) -> optax.GradientTransformationExtraArgs:
  """Scale updates by ``-learning_rate(step) * lr_scale`` (descent direction).

  Args:
    learning_rate: a constant or a schedule ``step -> lr``; ``step`` is a float.

  Returns:
    A transform whose state is :class:`ScaleByLrState`; change ``lr_scale`` and
    ``step_increment`` with :func:`set_lr_scale` / :func:`set_step_increment`.

  Example:
    >>> tx = optax.chain(optax.trace(0.9), scale_by_lr(0.1))
    >>> params = {"w": jnp.ones(3)}
    >>> state = set_lr_scale(tx.init(params), 2.0)
    >>> updates, state = tx.update({"w": jnp.ones(3)}, state, params)
    >>> updates["w"]
    Array([-0.2, -0.2, -0.2], dtype=float32)
  """
  schedule = learning_rate if callable(learning_rate) else None

  def init_fn(params):
    del params
    lr0 = schedule(jnp.float32(0)) if schedule else learning_rate
    return ScaleByLrState(
      step=jnp.zeros([], jnp.float32),
      step_increment=jnp.ones([], jnp.float32),
      lr_scale=jnp.ones([], jnp.float32),
      lr=jnp.asarray(lr0, jnp.float32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    base = schedule(state.step) if schedule else learning_rate
    lr = jnp.asarray(base, jnp.float32) * state.lr_scale
    updates = jax.tree.map(lambda u: (-lr).astype(u.dtype) * u, updates)
    return updates, state._replace(step=state.step + state.step_increment, lr=lr)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _is_lr_state(node: Any) -> bool:
  return isinstance(node, ScaleByLrState)


def _replace_lr_states(opt_state: Any, types: tuple = (), **fields: float) -> tuple[Any, int]:
  """``opt_state`` with ``fields`` set in every :class:`ScaleByLrState` (and every state of
  ``types``); the number of LR states found."""
  found = 0

  def is_state(node):
    return isinstance(node, (ScaleByLrState, *types))

  def replace(node):
    nonlocal found
    if not is_state(node):
      return node
    found += _is_lr_state(node)
    return node._replace(**{k: jnp.asarray(v, jnp.float32) for k, v in fields.items()})

  new_state = jax.tree.map(replace, opt_state, is_leaf=is_state)
  return new_state, found


def set_lr_scale(opt_state: Any, lr_scale: float) -> Any:
  """Return ``opt_state`` with every :class:`ScaleByLrState` multiplier set to ``lr_scale``.

  Raises:
    ValueError: if ``lr_scale`` is not positive or the state has no ``scale_by_lr``
      (build the optimizer with :func:`sgd` or put :func:`scale_by_lr` in the chain).
  """
  if not lr_scale > 0:
    raise ValueError(f"lr_scale must be positive, got {lr_scale}")
  new_state, found = _replace_lr_states(opt_state, lr_scale=lr_scale)
  if not found:
    raise ValueError(
      "opt_state: no scale_by_lr state found; build the optimizer with "
      "jaxprune.train.sgd(...) or include jaxprune.train.scale_by_lr(...)"
    )
  return new_state


def set_step_increment(opt_state: Any, step_increment: float) -> Any:
  """Return ``opt_state`` whose schedules advance by ``step_increment`` per update.

  The learning rate's (every :class:`ScaleByLrState`) and the epoch clocks of transforms set in
  epochs (every :class:`EpochLengthState`, e.g. ClickTrain's stages).

  No-op (returns the state unchanged) when the optimizer has neither.
  """
  if not step_increment > 0:
    raise ValueError(f"step_increment must be positive, got {step_increment}")
  return _replace_lr_states(opt_state, (EpochLengthState,), step_increment=step_increment)[0]


def schedule_step(opt_state: Any) -> float | None:
  """The schedule position (reference steps done) of ``opt_state``.

  That of the first :class:`ScaleByLrState` or :class:`EpochLengthState` in ``opt_state`` (``None``
  when it has neither).
  """
  found = jax.tree.leaves(opt_state, is_leaf=_is_schedule_state)
  steps = [float(s.step) for s in found if _is_schedule_state(s)]
  return steps[0] if steps else None


def set_schedule_step(opt_state: Any, step: float) -> Any:
  """Return ``opt_state`` with every schedule position set to ``step``.

  Every :class:`ScaleByLrState` and :class:`EpochLengthState` ``step``.

  The trainer puts the position back on the epoch boundary at each epoch start once the batch
  has changed: an increment such as 8/5 is not exact in float32, and its rounding, the same
  at every step, would move the epoch ends of the schedules (ClickTrain's stages) off the
  trainer's epochs over a long run.
  """
  if not step >= 0:
    raise ValueError(f"step must be non-negative, got {step}")
  return _replace_lr_states(opt_state, (EpochLengthState,), step=step)[0]


def _is_schedule_state(node: Any) -> bool:
  return isinstance(node, (ScaleByLrState, EpochLengthState))


def find_lr_states(opt_state: Any) -> list[ScaleByLrState]:
  """Every :class:`ScaleByLrState` in an optimizer state tree, in flatten order.

  Works on traced states too (inside ``jit``): the tree structure is static.
  """
  return [s for s in jax.tree.leaves(opt_state, is_leaf=_is_lr_state) if _is_lr_state(s)]


def get_lr(opt_state: Any) -> float | None:
  """The LR applied by the last update, or ``None`` if the optimizer exposes none.

  The first ``scale_by_lr`` or ``inject_hyperparams`` ``learning_rate`` found.
  """
  lr_states = find_lr_states(opt_state)
  if lr_states:
    return float(lr_states[0].lr)
  try:
    value = optax.tree_utils.tree_get(opt_state, "learning_rate")
  except (KeyError, ValueError):
    return None
  return None if value is None else float(value)


def get_lr_scale(opt_state: Any) -> float | None:
  """The ``lr_scale`` of the first :class:`ScaleByLrState`, or ``None``."""
  lr_states = find_lr_states(opt_state)
  return float(lr_states[0].lr_scale) if lr_states else None


class EpochLengthState(NamedTuple):
  """The optimizer steps per epoch a transform's epoch settings were converted with.

  It also holds how far its epochs have run.
  """

  steps_per_epoch: jax.Array  # int32
  # Reference steps done: advanced by ``step_increment`` per update, the increment of the
  # learning rate's schedule (set_step_increment), so epochs of a grown batch end where the
  # trainer's do.
  step: jax.Array  # float32
  step_increment: jax.Array  # float32


def epoch_length_state(steps_per_epoch: int) -> EpochLengthState:
  """An :class:`EpochLengthState` to keep in a transform's state.

  A transform told its steps per epoch (ClickTrain's stages are set in epochs) keeps one in
  its state, so that :meth:`jaxprune.train.Trainer.fit` can name a training loader with
  another number of batches per epoch (:func:`find_epoch_lengths`) instead of letting every
  epoch setting fall at another epoch without a word.

  Args:
    steps_per_epoch: the optimizer steps per epoch the transform was built for.

  Returns:
    The state entry.
  """
  return EpochLengthState(
    jnp.asarray(steps_per_epoch, jnp.int32), jnp.zeros([], jnp.float32), jnp.ones([], jnp.float32)
  )


def _is_epoch_length(node: Any) -> bool:
  return isinstance(node, EpochLengthState)


def find_epoch_lengths(opt_state: Any) -> list[int]:
  """The distinct steps per epoch of every :class:`EpochLengthState` in ``opt_state``.

  Sorted; empty when no transform of it was told one.
  """
  found = jax.tree.leaves(opt_state, is_leaf=_is_epoch_length)
  return sorted({int(s.steps_per_epoch) for s in found if _is_epoch_length(s)})


def kernels_only(params: Any) -> Any:
  """Weight-decay mask: True for conv / dense kernels (ndim >= 2).

  False for biases and BatchNorm scale/shift.
  """
  return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


def sgd(
  learning_rate: optax.ScalarOrSchedule,
  momentum: float = 0.9,
  *,
  nesterov: bool = False,
  weight_decay: float = 0.0,
  decay_mask: Any | Callable[[Any], Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
  """SGD with momentum and *coupled* weight decay, exactly as ``torch.optim.SGD``.

  Per step (``dampening = 0``): ``d = g + wd * w``; ``buf = momentum * buf + d``;
  ``d = d + momentum * buf`` if nesterov else ``buf``; ``w -= lr * lr_scale * d``.
  This is the recipe of all three papers (PruneTrain, ClickTrain and SDGP train with
  PyTorch SGD, momentum 0.9, wd 5e-4).

  Args:
    learning_rate: constant or schedule (see ``jaxprune.train.schedules``).
    momentum: momentum coefficient in ``[0, 1)``; 0 disables the buffer.
    nesterov: Nesterov momentum (PyTorch's formulation).
    weight_decay: L2 coefficient added to the gradient before momentum.
    decay_mask: which params get weight decay: ``None`` = all (the papers' recipes),
      a pytree of bools, or a function ``params -> bool pytree`` such as
      :func:`kernels_only`.

  Returns:
    A ``GradientTransformationExtraArgs`` (so ``value=loss`` passes through).

  Example:
    >>> tx = sgd(step_schedule(0.1, 391, [91, 136]), momentum=0.9, weight_decay=5e-4)
  """
  if not 0.0 <= momentum < 1.0:
    raise ValueError(f"momentum must be in [0, 1), got {momentum}")
  if weight_decay < 0:
    raise ValueError(f"weight_decay must be non-negative, got {weight_decay}")
  if nesterov and momentum == 0:
    raise ValueError("nesterov=True requires momentum > 0")
  parts = []
  if weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay, mask=decay_mask))
  if momentum:
    parts.append(optax.trace(decay=momentum, nesterov=nesterov))
  parts.append(scale_by_lr(learning_rate))
  return optax.with_extra_args_support(optax.chain(*parts))
