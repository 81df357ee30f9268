"""Re-estimating the BatchNorm running statistics at ClickTrain's hard prune.

The hard prune (ClickTrain §4.4) zeroes, in one step, every weight outside the final patterns
and every pruned kernel: about half of each pruned conv's weights at once. Training normalises
with each batch's own statistics and does not notice, but evaluation reads the running averages
(momentum 0.9: about the last ten steps), which still describe the dense weights of the steps
before. Right after the prune, eval-mode accuracy can then collapse while training accuracy
holds (measured in docs/design.md, "BatchNorm at the hard prune").
:class:`HardPruneBatchNorm` replaces the running statistics
with those of the pruned weights, measured on a few training batches
(:func:`jaxprune.train.recompute_batch_stats`), at the epoch end where the prune happened,
before that epoch is evaluated. Training never reads running statistics: the trained weights
are the same with or without it; only evaluation (and the checkpointed statistics) change.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
  Izmailov et al., "Averaging Weights Leads to Wider Optima and Better Generalization",
  UAI 2018 (``bn_update``: re-estimating BatchNorm statistics after the weights jumped).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxprune.clicktrain.readouts import find_state, stage_name
from jaxprune.clicktrain.schedule import Schedule
from jaxprune.train import Callback, TrainerLike, epoch_batches, recompute_batch_stats

__all__ = ["DEFAULT_BATCHES", "HardPruneBatchNorm", "HardPruneCheck"]

# Enough batches for a stable mean / variance per channel (10 x 64 images on the quickstart,
# 10 x 128 on CIFAR); a forward pass each, once per run.
DEFAULT_BATCHES = 10


class _PruneEdge:
  """Finds the epoch end at which ClickTrain's stage first reads ``"pruned"`` (the hard prune).

  The stage a fit starts in counts as seen (:meth:`start`), so a run resumed after the prune
  does not find it again. Shared by the hooks that act on, or mark, that epoch.
  """

  def __init__(self):
    self.pruned = False  # the stage read "pruned" at the last check

  def start(self, opt_state: Any) -> None:
    self.pruned = stage_name(opt_state) == "pruned"

  def check(self, opt_state: Any) -> tuple[str, bool]:
    """The stage now, and whether this is the first check that finds it ``"pruned"``."""
    stage = stage_name(opt_state)
    first = stage == "pruned" and not self.pruned
    self.pruned = stage == "pruned"
    return stage, first


class HardPruneBatchNorm(Callback):
  """Trainer hook: re-estimate the BatchNorm running statistics when ClickTrain hard-prunes.

  At the first epoch end where ClickTrain's stage is ``"pruned"`` (the epoch whose last step
  zeroed the pruned weights), before that epoch is evaluated, it re-estimates every
  BatchNorm's running mean and variance from ``num_batches`` batches of the epoch just trained
  (``loader.iter_epoch``, with the pruned weights; the loader's position is left alone). The
  stage seen when a fit starts counts as seen, so a run resumed after the prune does not
  re-estimate again, and a run resumed before it re-estimates from the same batches. The
  ClickTrain preset (``methods.get("clicktrain")``) adds it by default.

  Args:
    num_batches: training batches to average over (a positive int).

  Attributes:
    recomputed_at: the epoch whose end re-estimated the statistics in this fit (None before).

  Raises:
    ValueError: ``num_batches`` not a positive int; from the hooks, an optimizer state
      without exactly one ClickTrain state (``clicktrain.stage_name``).

  Example::

    trainer = train.Trainer(model, clicktrain.clicktrain(inner, ...),
                            callbacks=[clicktrain.HardPruneBatchNorm(num_batches=10)])
  """

  def __init__(self, num_batches: int = DEFAULT_BATCHES):
    if (
      isinstance(num_batches, bool)
      or not isinstance(num_batches, (int, np.integer))
      or num_batches < 1
    ):
      raise ValueError(f"num_batches must be a positive int, got {num_batches!r}")
    self.num_batches = int(num_batches)
    self.recomputed_at: int | None = None
    self._edge = _PruneEdge()

  def on_fit_start(self, trainer: TrainerLike) -> None:
    self._edge.start(trainer.opt_state)

  def on_train_epoch_end(self, trainer: TrainerLike, epoch: int, train_loader: Any) -> None:
    if self._edge.check(trainer.opt_state)[1]:
      model = trainer.model
      recompute_batch_stats(model, epoch_batches(train_loader, epoch), self.num_batches)
      trainer.replace(model)
      self.recomputed_at = epoch

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> Mapping[str, Any] | None:
    del trainer
    # Present in every record (a JSON-lines reader gets even columns); True at the prune.
    return {"ct_bn_recomputed": epoch == self.recomputed_at}


class HardPruneCheck(Callback):
  """Trainer hook: marks ClickTrain's hard prune in the records.

  It also warns when the run's last epoch ends before the hard prune.

  Every epoch's record gets ``ct_stage`` (the stage at the epoch's end,
  :func:`~jaxprune.clicktrain.stage_name`) and ``ct_hard_prune``: True in the one record whose
  epoch ended with the hard prune, which is epoch ``hard_prune_epoch`` (records count epochs
  from 1, and the schedule's epoch settings count completed epochs: the same number) unless a
  late trigger moved it. The loss jump of the prune shows in the next record, the first
  epoch trained pruned. A fit that starts already pruned (a resume) marks nothing again.

  A run whose loss-derivative trigger (§4.1) fires late moves its hard prune later (the pool
  and finalization stages are never cut short), possibly past the end of the run: it then ends
  dense, in its pool, finalization or regularization stage, and its records look like any
  other run's. At the epoch end that completes ``epochs`` epochs, if ClickTrain's stage is not
  ``"pruned"``, this hook says so (a ``RuntimeWarning``, once). The ClickTrain preset adds it
  with the run's length.

  Args:
    epochs: the planned length of the run (``methods.Run.epochs``), a positive int.

  Raises:
    ValueError: ``epochs`` not a positive int; from the hook, an optimizer state without
      exactly one ClickTrain state (``clicktrain.stage_name``).
  """

  def __init__(self, epochs: int):
    if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
      raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    self.epochs = int(epochs)
    self._edge = _PruneEdge()

  def on_fit_start(self, trainer: TrainerLike) -> None:
    self._edge.start(trainer.opt_state)

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> Mapping[str, Any]:
    del epoch
    stage, first = self._edge.check(trainer.opt_state)
    return {"ct_stage": stage, "ct_hard_prune": first}

  def after_epoch(self, trainer: TrainerLike, record: Mapping[str, Any]) -> None:
    del record
    if trainer.epoch != self.epochs:
      return
    stage = stage_name(trainer.opt_state)
    if stage != "pruned":
      warnings.warn(
        f"clicktrain: the run ended after {self.epochs} epochs before the hard prune, in "
        f"stage {stage!r}: the model is dense (compression 1.0); "
        + _why_not_pruned(find_state(trainer.opt_state).schedule, self.epochs),
        RuntimeWarning,
        stacklevel=2,
      )


def _why_not_pruned(schedule: Schedule, epochs: int) -> str:
  """The cause of a run that ended before its hard prune, by schedule: only the paper mode
  without ``pool_start_epoch`` waits for the loss-derivative trigger (§4.1)."""
  if schedule.mode == "paper" and schedule.pool_start_epoch is None:
    return (
      "the loss-derivative trigger fired too late, or not at all, for pool_epochs + "
      "finalize_epochs + 1 epochs before the end (set pool_start_epoch, shorten the stages or "
      "train longer)"
    )
  if schedule.mode == "paper":
    fixed = f"pool_start_epoch={schedule.pool_start_epoch} (a fixed schedule)"
  else:
    fixed = f"mode={schedule.mode!r} (a fixed schedule)"
  earliest = schedule.earliest_hard_prune()
  if earliest > epochs:
    return (
      f"with {fixed} the hard prune comes after {earliest} epochs at the earliest, later than "
      "the run's end (lower hard_prune_epoch, shorten the stages or train longer)"
    )
  return (
    f"with {fixed} the hard prune was due after {earliest} epochs, so a stage was extended: "
    "a stage whose epochs feed no importance scores (every step non-finite or skipped) goes "
    "on for another epoch (check the run's non-finite steps)"
  )
