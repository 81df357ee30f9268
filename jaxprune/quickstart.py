"""Settings for a short run: every registered method configured for a few epochs on a small
data set, and the optimizer they train with.

The quickstart command (``python -m experiments.run quickstart``, scikit-learn's digits, 15
epochs) and the notebooks train with these, so their numbers compare. The paper presets place
their schedules for runs of a hundred epochs and more; here each method's stages are squeezed
into the run, and PruneTrain's penalty is raised so that channels die within it: its row uses
penalty ratio 0.9 and dead-channel threshold 1e-2, **not the paper's 0.2 and 1e-4**
(PruneTrain §4.1, §4.2), and reconfigures every ``epochs // 3`` epochs without the dynamic
mini-batch. :func:`departures` lists every such setting, for the results page.

``METHODS`` maps a row label to a registered method and its config as a function of the epoch
count::

    registered, config = METHODS["clicktrain"]
    method = jaxprune.methods.get(registered, **config(epochs))
    tx = method.make_tx(dense_tx(0.1, 5e-4, run.steps_per_epoch, run.epochs), run)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from jaxprune import train

__all__ = ["METHODS", "dense_tx", "departures"]

# The papers' settings the quickstart's rows change (PruneTrain §4.1, §4.2; ClickTrain Table 1).
_PAPER_PRUNETRAIN = {"penalty_ratio": 0.2, "threshold": 1e-4, "every_epochs": 10}


def dense_tx(
  lr: float, weight_decay: float, steps_per_epoch: int, epochs: int
) -> optax.GradientTransformationExtraArgs:
  """SGD momentum 0.9, coupled weight decay, triangular LR (peak at 20% of training)."""
  schedule = train.triangular_schedule(
    lr, steps_per_epoch, peak_epoch=max(1, epochs // 5), total_epochs=epochs
  )
  return train.sgd(schedule, momentum=0.9, weight_decay=weight_decay)


def _clicktrain_config(epochs: int) -> dict[str, Any]:
  # The paper's stages compressed into the budget: pool generation from 20% of the run,
  # finalization after it, hard prune at 2/3 (ClickTrain §4.1-4.4).
  epoch = max(1, epochs // 5)
  return {
    "hard_prune_epoch": max(3 * epoch + 1, (2 * epochs) // 3),
    "pool_start_epoch": epoch,
    "pool_epochs": epoch,
    "finalize_epochs": epoch,
    "kernel_prune_ratio": 0.5,
  }


def _clicktrain_one_shot_config(epochs: int) -> dict[str, Any]:
  # The released code's rule: masks from one batch at 20% of the run, hard prune at 2/3.
  one_shot = max(1, epochs // 5)
  return {
    "one_shot_epoch": one_shot,
    "hard_prune_epoch": max(one_shot + 1, (2 * epochs) // 3),
    "kernel_prune_ratio": 0.5,
  }


def _prunetrain_config(epochs: int) -> dict[str, Any]:
  # A short run needs a larger penalty share than the paper's 0.2 for channels to die within
  # the budget (PruneTrain §4.1 sets λ from this ratio at the first step), and a threshold
  # above 1e-4; it looks for dead channels three times in the run. That penalty shrinks
  # channels faster than BatchNorm's running averages follow (about ten steps, of 22 per
  # epoch), so evaluation re-estimates them from 10 training batches first.
  return {
    "penalty_ratio": 0.9,
    "every_epochs": max(1, epochs // 3),
    "threshold": 1e-2,
    "dynamic_batch": False,
    "recompute_batchnorm": 10,
  }


def _sdgp_config(method: str) -> Callable[[int], dict[str, Any]]:
  return lambda epochs: {"n": 2, "m": 4, "method": method}


# Row label -> (registered method, config as a function of the number of epochs).
METHODS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
  "dense": ("dense", lambda epochs: {}),
  "sdgp rescaled 2:4": ("sdgp", _sdgp_config("rescaled_magnitude")),
  "sdgp mvue 2:4": ("sdgp", _sdgp_config("mvue")),
  "prunetrain": ("prunetrain", _prunetrain_config),
  "clicktrain": ("clicktrain", _clicktrain_config),
  "clicktrain-one-shot": ("clicktrain-one-shot", _clicktrain_one_shot_config),
  "prunetrain+sdgp": (
    "prunetrain+sdgp",
    lambda epochs: {**_prunetrain_config(epochs), **_sdgp_config("rescaled_magnitude")(epochs)},
  ),
  "clicktrain+sdgp": (
    "clicktrain+sdgp",
    lambda epochs: {**_clicktrain_config(epochs), **_sdgp_config("rescaled_magnitude")(epochs)},
  ),
}


def departures(epochs: int) -> list[str]:
  """Where the quickstart's rows differ from the papers' settings, one sentence each.

  Built from the configs above, so the results page says what the rows ran.

  Args:
    epochs: the run's epoch count (some settings are placed by it).

  Returns:
    Sentences for the results page's notes.

  Example:
    >>> departures(15)[0].startswith("PruneTrain: penalty ratio 0.9")
    True
  """
  pt, paper, ct = _prunetrain_config(epochs), _PAPER_PRUNETRAIN, _clicktrain_config(epochs)
  prunetrain_note = (
    f"PruneTrain: penalty ratio {pt['penalty_ratio']:g} and dead-channel threshold "
    f"{pt['threshold']:g}, not the paper's {paper['penalty_ratio']:g} and "
    f"{paper['threshold']:g}, so that channels die within {epochs} epochs; reconfiguration "
    f"every {pt['every_epochs']} epochs (the paper: {paper['every_epochs']}), no dynamic "
    "mini-batch."
  )
  clicktrain_note = (
    f"ClickTrain: the paper's stages squeezed into the run: pool generation from epoch "
    f"{ct['pool_start_epoch']}, {ct['pool_epochs']} + {ct['finalize_epochs']} epochs of pool "
    f"and finalization, the hard prune after epoch {ct['hard_prune_epoch']}; kernel-prune "
    f"ratio {ct['kernel_prune_ratio']:g} in every pruned layer (the paper: 90-98 of 190 "
    "epochs, per-layer ratios)."
  )
  return [prunetrain_note, clicktrain_note]
