"""What ClickTrain's hard prune will cost, read out at the epoch end just before it.

ClickTrain trains with a modified group lasso that pushes every weight outside the chosen
pattern and every weight of a pruned kernel toward zero (ClickTrain §4.4), so that the hard
prune, which zeroes them all in one step, removes little. Whether it did is visible only
before the prune: afterwards those weights are zero. :class:`HardPruneReadout` takes the
reading at the epoch end after which the next epoch's last step prunes (the masks are final
then): the share of the pruned layers' squared norm the masks remove
(:func:`~jaxprune.clicktrain.readouts.removed_norm_fraction`), and the test accuracy of the
model as it is and of a masked copy, with and without BatchNorm statistics re-estimated for the
masked weights (:func:`jaxprune.train.recompute_batch_stats`, as
:class:`~jaxprune.clicktrain.HardPruneBatchNorm` does at the prune). A large removed share and
an accuracy that collapses when masked say the group lasso was too weak or too short; a
collapse that the re-estimated statistics undo says only the running averages were stale.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flax import nnx

from jaxprune import masking
from jaxprune.clicktrain.prune_batchnorm import DEFAULT_BATCHES, _PruneEdge
from jaxprune.clicktrain.readouts import find_state, masks, removed_norm_fraction
from jaxprune.train import (
  Callback,
  TrainerLike,
  epoch_batches,
  recompute_batch_stats,
  split_model,
)

__all__ = ["HardPruneReadout"]


def _positive_int(name: str, v: Any) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
    raise ValueError(f"{name} must be a positive int, got {v!r}")
  return int(v)


def _check_loader(name: str, loader: Any) -> None:
  if loader is None or isinstance(loader, (str, bytes)) or not hasattr(loader, "__iter__"):
    raise ValueError(f"{name} must be an iterable of (images, labels) batches, got {loader!r}")


def _test_acc(trainer: TrainerLike, params: Any, rest: Any, loader: Iterable) -> float:
  """``trainer.evaluate(loader)``'s accuracy for ``params`` / ``rest`` in place of the
  trainer's (its eval step, flip TTA and padding)."""
  return float(trainer.evaluate(loader, params=params, rest=rest)["test_acc"])


class HardPruneReadout(Callback):
  """Trainer hook: at the epoch end just before ClickTrain's hard prune, what the prune removes.

  It fires once, at the end of the epoch ``e`` where ClickTrain's stage is ``"regularize"``
  (the masks are final) and ``e + 1 >= hard_prune_epoch``: the transform prunes at the last
  step of the first such epoch ``e + 1`` (its ``hard_prune_epoch`` counts the epochs done
  before it, so with epochs counted from 1 as the trainer does, the prune ends epoch
  ``hard_prune_epoch`` and the reading is taken at the end of epoch ``hard_prune_epoch - 1``,
  or later if the masks became final later). That epoch's record gets:

  * ``hard_prune_removed_norm_fraction``: ``Σ‖W⊙(1−M)‖² / Σ‖W‖²`` over the layers ClickTrain
    prunes, and ``hard_prune_removed_norm_fraction_by_layer``: ``{kernel path: ratio}``
    (:func:`~jaxprune.clicktrain.readouts.removed_norm_fraction`);
  * ``hard_prune_test_acc_before``: test accuracy of the model as trained;
  * ``hard_prune_test_acc_after_no_bn``: of a copy with the masks applied, the BatchNorm
    running statistics as training left them;
  * ``hard_prune_test_acc_after``: of that copy with the running statistics re-estimated on
    ``bn_batches`` training batches of the epoch just trained
    (:func:`jaxprune.train.recompute_batch_stats`; the same as ``_no_bn`` for a model
    without BatchNorm).

  The hook reads the trainer's state and changes none of it: the masked model is a copy,
  evaluated with the trainer's eval step, so training, the epoch's own evaluation and the
  checkpoints are the same with or without it. It costs three passes over ``test_loader``
  and ``bn_batches`` forward passes, once per run. (The "before" accuracy is evaluated again
  rather than read from the epoch's record, which hooks do not see; with ``fit``'s own test
  loader it is that record's ``test_acc``.)

  ``hard_prune_epoch`` is the transform's, read from its state's schedule when the fit starts
  (``find_state(opt_state).schedule``), unless given. Where the prune comes at another epoch
  end, or when the masks become final within the epoch that
  prunes (``mode="one_shot"`` with ``hard_prune_epoch == one_shot_epoch + 1``: no epoch end
  sees final, unpruned masks), a ``UserWarning`` says so and nothing is recorded. A fit that
  starts after the prune records nothing.

  Args:
    test_loader: the evaluation batches ``(images, labels)``, e.g. ``fit``'s ``test_loader``.
    hard_prune_epoch: the epoch the prune is expected to end (an int >= 0); ``None``
      (default): the transform's.
    train_loader: the batches to re-estimate BatchNorm statistics from (``iter_epoch`` of the
      epoch just trained when it has one, :func:`jaxprune.train.epoch_batches`); ``None``:
      ``fit``'s training loader.
    bn_batches: how many of them (a positive int).

  Attributes:
    fired_at: the epoch whose end took the reading (None before).

  Raises:
    ValueError: a bad argument (named); from ``on_fit_start``, an optimizer state without
      exactly one ClickTrain state (a dense run: a readout of a prune that never comes).

  Example::

    readout = clicktrain.HardPruneReadout(test_loader)
    trainer = train.Trainer(model, clicktrain.clicktrain(inner, ..., hard_prune_epoch=95),
                            callbacks=[readout])
    trainer.fit(loader, test_loader, epochs=190)
    trainer.history[93]["hard_prune_test_acc_after"]  # the record of epoch 94
  """

  def __init__(
    self,
    test_loader: Iterable,
    *,
    hard_prune_epoch: int | None = None,
    train_loader: Iterable | None = None,
    bn_batches: int = DEFAULT_BATCHES,
  ):
    _check_loader("test_loader", test_loader)
    if train_loader is not None:
      _check_loader("train_loader", train_loader)
    if hard_prune_epoch is not None and (
      isinstance(hard_prune_epoch, bool)
      or not isinstance(hard_prune_epoch, (int, np.integer))
      or hard_prune_epoch < 0
    ):
      raise ValueError(f"hard_prune_epoch must be an int >= 0, got {hard_prune_epoch!r}")
    self.test_loader = test_loader
    self.train_loader = train_loader
    self._given = None if hard_prune_epoch is None else int(hard_prune_epoch)
    self.hard_prune_epoch = self._given
    self.bn_batches = _positive_int("bn_batches", bn_batches)
    self.fired_at: int | None = None
    self._fit_loader: Iterable | None = None  # fit's training loader, seen at each epoch end
    self._edge = _PruneEdge()

  def on_fit_start(self, trainer: TrainerLike) -> None:
    try:
      self._edge.start(trainer.opt_state)
      if self._given is None:
        self.hard_prune_epoch = find_state(trainer.opt_state).schedule.hard_prune_epoch
    except ValueError as e:
      raise ValueError(
        f"HardPruneReadout reads ClickTrain's masks, but the trainer's {e} (a dense run has "
        "no hard prune: leave the hook out)"
      ) from None

  def on_train_epoch_end(self, trainer: TrainerLike, epoch: int, train_loader: Iterable) -> None:
    del trainer, epoch
    self._fit_loader = train_loader

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> Mapping[str, Any] | None:
    stage, first = self._edge.check(trainer.opt_state)
    pruned = stage == "pruned"
    if first and self.fired_at != epoch - 1:
      warnings.warn(
        f"HardPruneReadout: the hard prune ended epoch {epoch} but no reading was taken at the "
        f"end of epoch {epoch - 1} (fired at {self.fired_at}): hard_prune_epoch="
        f"{self.hard_prune_epoch} is not the transform's, or the masks became final in the "
        "epoch that pruned (one_shot_epoch + 1 == hard_prune_epoch)",
        stacklevel=2,
      )
    if self.fired_at is not None and self.fired_at == epoch - 1 and not pruned:
      warnings.warn(
        f"HardPruneReadout: the reading at the end of epoch {self.fired_at} expected the hard "
        f"prune to end epoch {epoch}, but the stage is {stage!r}: hard_prune_epoch="
        f"{self.hard_prune_epoch} is not the transform's",
        stacklevel=2,
      )
    # The transform prunes at the first epoch end in REGULARIZE whose count of epochs done
    # reaches hard_prune_epoch (ClickTrain §4.4, the stage machine's next_state).
    if self.fired_at is not None or stage != "regularize" or epoch + 1 < self.hard_prune_epoch:
      return None
    self.fired_at = epoch
    return self._readout(trainer, epoch)

  def _readout(self, trainer: TrainerLike, epoch: int) -> dict[str, Any]:
    """The record entries (see the class docstring), from copies of the trainer's state."""
    params = trainer.params
    total, by_layer = removed_norm_fraction(trainer.opt_state, params)
    out: dict[str, Any] = {
      "hard_prune_removed_norm_fraction": total,
      "hard_prune_removed_norm_fraction_by_layer": by_layer,
      "hard_prune_test_acc_before": _test_acc(trainer, params, trainer.rest, self.test_loader),
    }
    # The copy the prune will leave: the masked weights, then their BatchNorm statistics.
    work = nnx.clone(trainer.model)
    nnx.update(work, masking.apply_masks(params, masks(trainer.opt_state, params)))
    _, _, masked, rest = split_model(work)
    out["hard_prune_test_acc_after_no_bn"] = _test_acc(trainer, masked, rest, self.test_loader)
    loader = self.train_loader if self.train_loader is not None else self._fit_loader
    if recompute_batch_stats(work, epoch_batches(loader, epoch), self.bn_batches):
      _, _, masked, rest = split_model(work)
      out["hard_prune_test_acc_after"] = _test_acc(trainer, masked, rest, self.test_loader)
    else:  # no BatchNorm: nothing to re-estimate
      out["hard_prune_test_acc_after"] = out["hard_prune_test_acc_after_no_bn"]
    return out

  def state_dict(self) -> dict[str, Any]:
    return {"fired_at": self.fired_at}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.fired_at = state.get("fired_at")
