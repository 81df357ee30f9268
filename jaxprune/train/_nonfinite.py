"""The train step's non-finite bookkeeping: its own named state, as ``optax.apply_if_finite``
keeps ``notfinite_count`` beside the inner state.

A train step whose loss **or gradients** are not finite adds nothing to the running sums and
leaves params, optimizer state and BatchNorm's running statistics as they were (one NaN
gradient applied makes every parameter NaN at the next step through the momentum, and a NaN
in ``params`` never leaves). :class:`NonFiniteState` counts such steps, says why (non-finite
inputs, class ids out of range) for the trainer's warning, and tracks runs of consecutive
non-finite steps for its stop (``max_nonfinite_steps`` of :class:`~jaxprune.train.Trainer`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxprune.train import _checks

__all__ = [
  "NonFiniteState",
  "count_step",
  "keep_state_if_finite",
  "skip_if_nonfinite",
  "step_finite",
]


class NonFiniteState(NamedTuple):
  """Device-side counters of non-finite train steps (float32 scalars)."""

  nonfinite: jax.Array  # train steps with a NaN / Inf loss or gradient, left out of the sums
  steps: jax.Array  # train steps seen
  nonfinite_inputs: jax.Array  # train steps whose images (or soft labels) hold NaN / Inf
  first_nonfinite_input: jax.Array  # 1-based step (of ``steps``) of the first of them; 0: none
  labels_out_of_range: jax.Array  # non-finite train steps with class ids outside [0, classes)
  num_classes: jax.Array  # the model's outputs (the logits' last axis); 0 before a train step
  # Consecutive non-finite steps ending at the latest step (optax's ``notfinite_count``); the
  # trainer starts an epoch with the previous epoch's, so a run spans epochs.
  nonfinite_run: jax.Array
  run_start: jax.Array  # 1-based step where that run began; 0: no run, or an earlier epoch
  max_nonfinite: jax.Array  # the run length that stops the run (set by the trainer); 0: none
  limit_reached: jax.Array  # 1 once a run reached ``max_nonfinite`` (0 before)
  limit_run_start: jax.Array  # ``run_start`` of the first such run (0: an earlier epoch)

  @classmethod
  def zeros(cls, *, nonfinite_run: float = 0, max_nonfinite: float = 0) -> "NonFiniteState":
    """No step seen; a run of ``nonfinite_run`` carried over, stopping at ``max_nonfinite``."""
    # One buffer per field: the step donates them, and one buffer cannot be donated twice.
    return cls(*(jnp.zeros([], jnp.float32) for _ in cls._fields))._replace(
      nonfinite_run=jnp.float32(nonfinite_run), max_nonfinite=jnp.float32(max_nonfinite)
    )


def step_finite(loss: jax.Array, grads: Any) -> jax.Array:
  """Whether a train step is finite: its loss **and** every gradient entry (one decision)."""
  return _checks.tree_all_finite(loss, grads)


def count_step(
  state: NonFiniteState, finite: jax.Array, flags: _checks.BatchFlags, num_classes: int
) -> NonFiniteState:
  """``state`` after one train step.

  The step counted and the causes of a non-finite step (:class:`~jaxprune.train._checks.BatchFlags`)
  recorded.
  """
  bad_inputs = flags.inputs_nonfinite
  first = jnp.where(
    (state.first_nonfinite_input == 0) & bad_inputs, state.steps + 1, state.first_nonfinite_input
  )
  # Runs of consecutive non-finite steps: a stop needs the first batch of the run named.
  run = jnp.where(finite, 0.0, state.nonfinite_run + 1)
  begins = ~finite & (state.nonfinite_run == 0)
  run_start = jnp.where(finite, 0.0, jnp.where(begins, state.steps + 1, state.run_start))
  hit = (state.limit_reached == 0) & (state.max_nonfinite > 0) & (run >= state.max_nonfinite)
  return NonFiniteState(
    nonfinite=state.nonfinite + (~finite).astype(jnp.float32),
    steps=state.steps + 1,
    nonfinite_inputs=state.nonfinite_inputs + bad_inputs.astype(jnp.float32),
    first_nonfinite_input=first,
    labels_out_of_range=state.labels_out_of_range
    + (flags.labels_out_of_range & ~finite).astype(jnp.float32),
    num_classes=jnp.full([], num_classes, jnp.float32),
    nonfinite_run=run,
    run_start=run_start,
    max_nonfinite=state.max_nonfinite,
    limit_reached=jnp.where(hit, 1.0, state.limit_reached),
    limit_run_start=jnp.where(hit, run_start, state.limit_run_start),
  )


def skip_if_nonfinite(finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the step was finite, else ``old``, for every leaf.

  Every leaf: params, the optimizer state with its momentum and step count. A non-finite step leaves
  no trace in them.

  A select, not a ``lax.cond``: both branches are already computed, and a select keeps the
  fused steps of a ``lax.scan`` free of control flow.
  """
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def keep_state_if_finite(finite: jax.Array, new_rest: Any, rest: Any) -> Any:
  """``new_rest`` where the step was finite, else the floating leaves of ``rest``.

  A non-finite batch would otherwise write NaN into BatchNorm's running statistics even when
  its update is skipped, and every later eval would be NaN; counters and keys advance either
  way.
  """
  return jax.tree.map(
    lambda new, old: jnp.where(finite, new, old) if jnp.issubdtype(new.dtype, jnp.inexact) else new,
    new_rest,
    rest,
  )
