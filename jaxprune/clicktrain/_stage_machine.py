"""ClickTrain's stage machine (ClickTrain Fig. 4): where a step sits in the pruning schedule,
which stage work (:mod:`jaxprune.clicktrain._stage_work`) it runs, and the state it leaves.

Transitions happen at epoch ends, inside ``jit``: the stage, step and loss statistics live in
the state, and the importance work and mask choice of a stage run under one ``lax.switch`` /
``lax.cond``, so a stage neither computes nor copies what it does not use.
"""

from __future__ import annotations

import warnings
import jax
import jax.numpy as jnp

from jaxprune.clicktrain import _stage_work
from jaxprune.clicktrain import patterns as _pat
from jaxprune.clicktrain._plan import Plan
from jaxprune.clicktrain.config import Config
from jaxprune.clicktrain.schedule import Clock
from jaxprune.clicktrain.state import (
  FINALIZE,
  POOL,
  REGULARIZE,
  WARMUP,
  ClickTrainState,
)

__all__ = [
  "next_state",
  "one_shot_step",
  "paper_step",
  "penalty_ramp",
  "step_clock",
  "warn_unreachable",
  "warn_when",
  "window_ratio",
]


def step_clock(cfg: Config, state: ClickTrainState, loss) -> Clock:
  """The :class:`~jaxprune.clicktrain.schedule.Clock` of the step that takes ``state`` on.

  The step takes ``state`` on with ``loss``; the schedule's epochs advance by the learning rate's
  step increment.
  """
  return cfg.schedule.clock(state.epoch_length, state.epoch_loss_sum, loss)


def penalty_ramp(cfg: Config, state: ClickTrainState, clock: Clock) -> jax.Array:
  """The share of λ this step's group lasso applies (``group_lasso_ramp``).

  1 held (the paper), or growing with ``t``, the share of the regularize stage done, from the epoch
  it began to ``hard_prune_epoch`` (a stage that runs past it, after a late trigger, stays at 1).
  """
  if cfg.group_lasso_ramp == "constant":
    return jnp.ones([], jnp.float32)
  # The stage's first epoch: held in the state, or this step's (the one-shot pick enters it).
  start = jnp.where(state.stage == REGULARIZE, state.stage_start_epoch, clock.epochs_done)
  done = clock.step / cfg.schedule.steps_per_epoch - start
  length = jnp.maximum(cfg.schedule.hard_prune_epoch - start, 1)
  t = jnp.clip(done / length, 0.0, 1.0)
  if cfg.group_lasso_ramp == "linear":
    return t
  return 1.0 - (1.0 - t) ** 3


def window_ratio(cfg: Config, state: ClickTrainState, clock: Clock) -> jax.Array:
  """How much of a dropped weight this step keeps in the soft prune's window.

  The share the schedule leaves after the step over the share before it (0 once nothing is left).
  """
  sch = cfg.schedule
  before = sch.kept_fraction(state.epoch_length.step)
  after = sch.kept_fraction(clock.step)
  return jnp.where(before > 0, after / jnp.where(before > 0, before, 1.0), 0.0)


def next_state(
  cfg: Config, state: ClickTrainState, clock: Clock, stage, moved, layers, inner_state
) -> ClickTrainState:
  """The state after this step, with the epoch's loss bookkeeping.

  Stage + 1 where a transition (or the hard prune, from ``hard_prune_epoch`` at the end of
  REGULARIZE) ends this step.
  """
  moved = moved | ((stage == REGULARIZE) & cfg.schedule.prune_due(clock))
  return ClickTrainState(
    count=state.count + 1,
    stage=stage + moved.astype(jnp.int32),
    # A stage entered at this step (the one-shot pick enters REGULARIZE mid-epoch) starts here.
    stage_start_epoch=jnp.where(
      moved | (stage != state.stage), clock.epochs_done, state.stage_start_epoch
    ),
    epoch_loss_sum=jnp.where(clock.epoch_end, 0.0, clock.loss_sum),
    prev_epoch_loss=jnp.where(clock.epoch_end, clock.mean, state.prev_epoch_loss),
    # A non-finite loss is no reference for the next batch's margin test (§4.3).
    last_loss=jnp.where(jnp.isfinite(clock.loss), clock.loss, state.last_loss),
    layers=layers,
    inner_state=inner_state,
    epoch_length=state.epoch_length._replace(step=clock.step),
    schedule=state.schedule,
    pruned_step=state.pruned_step,
  )


def warn_when(pred: jax.Array, message: str, epoch: jax.Array, **values: jax.Array) -> None:
  """A ``RuntimeWarning`` from inside ``jit`` when ``pred`` holds.

  ``{epoch}`` in ``message`` is filled with ``epoch``, and each ``{name}`` with the int of
  ``values[name]``. A no-op step otherwise (one scalar ``cond``).
  """

  def warn(e, v):
    warnings.warn(message.format(epoch=int(e), **{k: int(x) for k, x in v.items()}), RuntimeWarning)

  jax.lax.cond(pred, lambda: jax.debug.callback(warn, epoch, values), lambda: None)


def warn_unreachable(cfg: Config) -> None:
  """Warns when a run ends before its earliest possible hard prune.

  A ``RuntimeWarning`` when ``clicktrain()`` is built for a run (``total_epochs``) that ends before
  its earliest possible hard prune (:meth:`Config.earliest_hard_prune`): such a run ends dense, in
  its pool, finalization or regularization stage.
  """
  sch = cfg.schedule
  if sch.total_epochs is None or sch.earliest_hard_prune() <= sch.total_epochs:
    return
  if sch.mode != "paper":
    why = f"hard_prune_epoch={sch.hard_prune_epoch}"
  else:
    start = (
      "the loss-derivative trigger fires at the end of epoch 2 at the earliest"
      if sch.pool_start_epoch is None
      else f"pool_start_epoch={sch.pool_start_epoch}"
    )
    why = (
      f"hard_prune_epoch={sch.hard_prune_epoch}; {start}, then pool_epochs + finalize_epochs"
      f" = {sch.pool_epochs} + {sch.finalize_epochs} and one regularized epoch"
    )
  warnings.warn(
    f"clicktrain: the run of total_epochs={sch.total_epochs} ends before its hard prune, "
    f"which comes after {sch.earliest_hard_prune()} epochs at the earliest ({why}): the run "
    "would end dense; train longer, or shorten pool_epochs / finalize_epochs / "
    "hard_prune_epoch",
    RuntimeWarning,
    stacklevel=3,
  )


def paper_step(cfg: Config, plan: Plan, state: ClickTrainState, clock: Clock, w, g):
  """Paper mode, stages 2 and 3, in ONE ``lax.switch`` on the stage.

  The per-batch importance work, then (at the stage's last step) pool selection / finalization.

  Returns the new per-layer states and whether this step ends WARMUP, POOL or FINALIZE.
  """
  stage, sch = state.stage, cfg.schedule
  to_pool = clock.epoch_end & (stage == WARMUP) & sch.pool_due(clock, state.prev_epoch_loss)
  # Only the data-driven trigger can leave the run in warmup at the hard prune epoch (a set
  # pool_start_epoch that late is a ValueError in clicktrain()): say so once, or the run
  # ends dense without a word.
  warn_when(
    clock.epoch_end
    & (stage == WARMUP)
    & ~to_pool
    & (clock.epochs_done == max(sch.hard_prune_epoch, 1)),
    "clicktrain: still in warmup after {epoch} epochs (hard_prune_epoch="
    f"{sch.hard_prune_epoch}): the loss-derivative trigger (|change of the epoch mean loss| "
    f"< loss_derivative_threshold={sch.loss_derivative_threshold}) has not fired, so nothing "
    "is pruned yet; pool generation starts when it fires and the hard prune comes "
    "pool_epochs + finalize_epochs + 1 epochs later (set pool_start_epoch for a fixed "
    "schedule)",
    clock.epochs_done,
  )
  # A trigger that fires too late to fit pool generation, finalization and one regularized
  # epoch (§4.1-§4.4) before hard_prune_epoch does not cut those stages short: the hard prune
  # moves later, to the first epoch end in regularization (next_state). Say when.
  late = sch.pool_start_epoch is None and sch.mode == "paper"
  stages = sch.pool_epochs + sch.finalize_epochs + 1
  warn_when(
    to_pool & late & (clock.epochs_done + stages > sch.hard_prune_epoch),
    "clicktrain: the loss-derivative trigger fired after {epoch} epochs, too late for "
    f"pool_epochs + finalize_epochs + 1 = {stages} epochs before hard_prune_epoch="
    f"{sch.hard_prune_epoch}: the stages run in full and the hard prune moves to the end of "
    "epoch {prune_epoch}, if the run lasts that long (otherwise it ends dense)",
    clock.epochs_done,
    prune_epoch=clock.epochs_done + stages,
  )
  in_stage = clock.epochs_done - state.stage_start_epoch
  to_final = (stage == POOL) & sch.stage_done(clock, in_stage, finalize=False)
  to_reg = (stage == FINALIZE) & sch.stage_done(clock, in_stage, finalize=True)
  paper = cfg.paper
  counted = _pat.loss_margin_ok(state.last_loss, clock.loss, paper.loss_margin, paper.margin_rule)
  counted = counted | jnp.isnan(state.last_loss)
  do_importance = (state.count % cfg.importance_every) == 0

  # The finiteness check runs inside the POOL / FINALIZE branches only (one pass over the
  # gradients), so the other stages do not pay for it. A stage that fed no scores (every
  # batch non-finite or skipped) does not end: it goes on for another epoch, as one_shot
  # defers its pick, instead of choosing the pool / masks from all-zero scores by index.
  def pool_branch(ls):
    run = do_importance & _stage_work.all_finite(clock.loss, plan, w, g)
    ls = jax.lax.cond(run, lambda x: _stage_work.pool_step(x, plan, w, g), lambda x: x, ls)
    end = to_final & _stage_work.scored(ls, plan, POOL)
    ls = jax.lax.cond(
      end, lambda x: _stage_work.select_pools(x, plan, cfg.paper.pool_size), lambda x: x, ls
    )
    return ls, end

  def finalize_branch(ls):
    run = do_importance & _stage_work.all_finite(clock.loss, plan, w, g)
    ls = jax.lax.cond(
      run, lambda x: _stage_work.finalize_step(x, plan, w, g, counted), lambda x: x, ls
    )
    end = to_reg & _stage_work.scored(ls, plan, FINALIZE)
    return jax.lax.cond(end, lambda x: _stage_work.finalize_masks(x, plan), lambda x: x, ls), end

  branch = jnp.where(stage == POOL, 1, jnp.where(stage == FINALIZE, 2, 0))
  layers, ended = jax.lax.switch(
    branch, [lambda x: (x, jnp.bool_(False)), pool_branch, finalize_branch], state.layers
  )
  warn_when(
    (to_final | to_reg) & ~ended,
    "clicktrain: no batch of the pool generation / finalization stage ending after "
    "{epoch} epochs fed its scores (every one non-finite, skipped by importance_every or failing "
    "the loss-margin test): the stage goes on for another epoch instead of choosing patterns "
    "and kernels from all-zero scores",
    clock.epochs_done,
  )
  return layers, to_pool | ended


def one_shot_step(cfg: Config, plan: Plan, state: ClickTrainState, clock: Clock, w, g):
  """One-shot mode: masks from the first batch of ``one_shot_epoch``, then REGULARIZE.

  The step goes straight to REGULARIZE. A non-finite batch defers the pick to the next finite one
  (NaN scores must not pick).

  Returns the new per-layer states and the stage.
  """
  due = (state.stage == WARMUP) & cfg.schedule.one_shot_due(state.epoch_length)
  # The soft prune's window picks again at each of its epoch ends: the masks are still free.
  due = due | ((state.stage == REGULARIZE) & cfg.schedule.in_window(clock))
  pick = jax.lax.cond(
    due, lambda: _stage_work.all_finite(clock.loss, plan, w, g), lambda: jnp.bool_(False)
  )
  layers = jax.lax.cond(
    pick,
    lambda ls: _stage_work.one_shot_masks(ls, plan, w, g, cfg.one_shot.patterns),
    lambda ls: ls,
    state.layers,
  )
  return layers, jnp.where(pick, REGULARIZE, state.stage)
