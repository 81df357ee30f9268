"""Learning-rate schedules expressed per optimizer step.

Every schedule is a function ``step -> lr`` (an ``optax.Schedule``). ``step`` may be a
float: with PruneTrain's dynamic mini-batch (PruneTrain §4.3) the trainer advances the
schedule by the run's first batches per epoch over the current ones per step (and starts
each epoch on its boundary), so milestones given in epochs stay on the trainer's epochs
after the batch grows.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import optax


def _check_steps_per_epoch(steps_per_epoch: int) -> None:
  if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
    raise ValueError(f"steps_per_epoch must be a positive int, got {steps_per_epoch!r}")


def step_schedule(
  base_lr: float, steps_per_epoch: int, milestones: Sequence[float], factor: float = 0.1
) -> optax.Schedule:
  """Piecewise-constant schedule: multiply the LR by ``factor`` at each milestone epoch.

  PruneTrain's CIFAR recipe: ``step_schedule(0.1, 391, [91, 136])``.

  Args:
    base_lr: LR before the first milestone.
    steps_per_epoch: optimizer steps in one epoch (at the reference batch size).
    milestones: strictly increasing, non-negative epochs at which the LR drops.
    factor: positive multiplier applied at each milestone (0.1 in PruneTrain).

  Returns:
    ``step -> base_lr * factor ** (number of milestones reached)``.

  Example:
    >>> sched = step_schedule(0.1, steps_per_epoch=10, milestones=[2, 3])
    >>> [round(float(sched(s)), 6) for s in (0, 19, 20, 30)]
    [0.1, 0.1, 0.01, 0.001]
  """
  _check_steps_per_epoch(steps_per_epoch)
  milestones = list(milestones)
  if any(m < 0 for m in milestones):
    raise ValueError(f"milestones must be non-negative epochs, got {milestones}")
  if any(b <= a for a, b in zip(milestones, milestones[1:])):
    raise ValueError(f"milestones must be strictly increasing, got {milestones}")
  if factor <= 0:
    raise ValueError(f"factor must be positive, got {factor}")
  boundaries = jnp.asarray([m * steps_per_epoch for m in milestones], jnp.float32)

  def schedule(step):
    reached = jnp.sum(jnp.asarray(step, jnp.float32) >= boundaries)
    return base_lr * jnp.asarray(factor, jnp.float32) ** reached

  return schedule


def triangular_schedule(
  peak_lr: float,
  steps_per_epoch: int,
  peak_epoch: float,
  total_epochs: float,
  start_lr: float = 0.0,
  end_lr: float = 0.0,
) -> optax.Schedule:
  """One-cycle / triangular schedule.

  Linear from ``start_lr`` to ``peak_lr`` at ``peak_epoch``, then linear to ``end_lr`` at
  ``total_epochs`` (held there after).

  This is the ffcv CIFAR schedule used by SDGP (peak 0.5 at epoch 2 of 150):
  ``np.interp(step, [0, peak*spe, total*spe], [0, peak_lr, 0])``.

  Args:
    peak_lr: LR at the peak.
    steps_per_epoch: optimizer steps per epoch.
    peak_epoch: epoch of the peak, ``0 <= peak_epoch <= total_epochs``.
    total_epochs: epoch at which ``end_lr`` is reached, > 0.
    start_lr: LR at step 0.
    end_lr: LR at ``total_epochs`` and after.

  Returns:
    A schedule ``step -> lr``.

  Example:
    >>> sched = triangular_schedule(1.0, steps_per_epoch=10, peak_epoch=1, total_epochs=3)
    >>> [round(float(sched(s)), 6) for s in (0, 5, 10, 20, 30, 40)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
  """
  _check_steps_per_epoch(steps_per_epoch)
  if total_epochs <= 0:
    raise ValueError(f"total_epochs must be positive, got {total_epochs}")
  if not 0 <= peak_epoch <= total_epochs:
    raise ValueError(f"peak_epoch must be in [0, total_epochs={total_epochs}], got {peak_epoch}")
  xs = jnp.asarray([0.0, peak_epoch * steps_per_epoch, total_epochs * steps_per_epoch], jnp.float32)
  ys = jnp.asarray([start_lr, peak_lr, end_lr], jnp.float32)

  def schedule(step):
    return jnp.interp(jnp.asarray(step, jnp.float32), xs, ys)

  return schedule


def with_warmup(
  schedule: optax.ScalarOrSchedule, warmup_steps: int, start_factor: float = 0.0
) -> optax.Schedule:
  """Linear warmup multiplied onto any schedule.

  ``lr(t) = schedule(t) * (start_factor + (1 - start_factor) * min(1, t / warmup_steps))``,
  so the warmup ramps into whatever the wrapped schedule does (constant, step or
  triangular) without shifting it.

  Args:
    schedule: a schedule or a constant LR.
    warmup_steps: number of steps of the ramp (0 = no warmup).
    start_factor: multiplier at step 0, in ``[0, 1]``.

  Returns:
    The warmed-up schedule.

  Example:
    >>> sched = with_warmup(0.4, warmup_steps=4)
    >>> [round(float(sched(s)), 6) for s in (0, 1, 4, 9)]
    [0.0, 0.1, 0.4, 0.4]
  """
  if not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"warmup_steps must be a non-negative int, got {warmup_steps!r}")
  if not 0.0 <= start_factor <= 1.0:
    raise ValueError(f"start_factor must be in [0, 1], got {start_factor}")
  base = schedule if callable(schedule) else (lambda step: jnp.asarray(schedule, jnp.float32))

  def warmed(step):
    step = jnp.asarray(step, jnp.float32)
    if warmup_steps == 0:
      return base(step)
    ramp = jnp.minimum(1.0, step / warmup_steps)
    return base(step) * (start_factor + (1.0 - start_factor) * ramp)

  return warmed


def with_rewind(
  schedule: optax.ScalarOrSchedule,
  steps_per_epoch: int,
  *,
  prune_epoch: int,
  rewind_epoch: int,
  total_epochs: int,
) -> optax.Schedule:
  """Learning-rate rewinding after a prune, inside the run's own length.

  Until the end of ``prune_epoch`` the schedule is ``schedule``; the remaining
  ``total_epochs - prune_epoch`` epochs then replay it from ``rewind_epoch`` to
  ``total_epochs``, stretched or compressed to fit: the network pruned at ``prune_epoch``
  heals with the larger learning rates of an earlier epoch and still ends on the schedule's
  last value. Renda et al. retrain for extra epochs; a run of fixed length replays the same
  stretch of the schedule instead.

  Args:
    schedule: a schedule or a constant LR.
    steps_per_epoch: optimizer steps per epoch (at the reference batch size).
    prune_epoch: the epoch whose end prunes (ClickTrain's ``hard_prune_epoch``).
    rewind_epoch: the epoch of the schedule the LR goes back to, ``0 <= rewind_epoch <=
      prune_epoch``.
    total_epochs: the run's length, ``> prune_epoch``.

  Returns:
    The schedule with the rewind.

  Raises:
    ValueError: epochs out of order.

  Example:
    >>> sched = with_rewind(triangular_schedule(1.0, 10, 0, 4), 10, prune_epoch=2,
    ...                     rewind_epoch=0, total_epochs=4)
    >>> [round(float(sched(s)), 3) for s in (0, 10, 19, 20, 30, 40)]
    [1.0, 0.75, 0.525, 1.0, 0.5, 0.0]

  References:
    Renda et al., "Comparing Rewinding and Fine-tuning in Neural Network Pruning", ICLR 2020.
  """
  _check_steps_per_epoch(steps_per_epoch)
  for name, value in (("prune_epoch", prune_epoch), ("rewind_epoch", rewind_epoch)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
      raise ValueError(f"{name} must be a non-negative int, got {value!r}")
  if rewind_epoch > prune_epoch:
    raise ValueError(f"rewind_epoch ({rewind_epoch}) must be <= prune_epoch ({prune_epoch})")
  if isinstance(total_epochs, bool) or not isinstance(total_epochs, int):
    raise ValueError(f"total_epochs must be an int, got {total_epochs!r}")
  if total_epochs <= prune_epoch:
    raise ValueError(f"total_epochs ({total_epochs}) must be > prune_epoch ({prune_epoch})")
  base = schedule if callable(schedule) else (lambda step: jnp.asarray(schedule, jnp.float32))
  prune, rewind = prune_epoch * steps_per_epoch, rewind_epoch * steps_per_epoch
  stretch = (total_epochs - rewind_epoch) / (total_epochs - prune_epoch)

  def rewound(step):
    step = jnp.asarray(step, jnp.float32)
    replay = rewind + (step - prune) * stretch
    return base(jnp.where(step < prune, step, replay))

  return rewound
