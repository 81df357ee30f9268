"""Checks at the start of :meth:`Trainer.fit <jaxprune.train.Trainer.fit>`.

Its arguments, and the training loader against the epoch length the optimizer was built for.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from jaxprune.train import _loaders
from jaxprune.train.optim import find_epoch_lengths

__all__ = ["check_arguments", "warn_epoch_length"]


def check_arguments(
  epochs: Any, resume: bool, overwrite: bool, max_seconds: Any, must_finish: bool
) -> None:
  """The argument checks of :meth:`Trainer.fit` (see its Raises)."""
  # bool is an int subclass: epochs=True would silently train one epoch.
  if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
    raise ValueError(f"epochs must be a positive int, got {epochs!r}")
  if overwrite and resume:
    raise ValueError("overwrite=True deletes the checkpoints: it needs resume=False")
  if max_seconds is not None and not (isinstance(max_seconds, (int, float)) and max_seconds > 0):
    raise ValueError(f"max_seconds must be a positive number of seconds, got {max_seconds!r}")
  if must_finish and max_seconds is None:
    raise ValueError("must_finish=True needs max_seconds")


def warn_epoch_length(opt_state: Any, loader: Any, reference_batch_size: int | None) -> None:
  """Warns when ``loader``'s batches per epoch are not the steps per epoch a transform of
  ``opt_state`` was told (:func:`~jaxprune.train.find_epoch_lengths`).

  Checked while the loader is at the run's reference batch size (a grown batch takes fewer
  steps per epoch by design) and when it has a length.
  """
  told = find_epoch_lengths(opt_state)
  size = _loaders.batch_size(loader)
  if not told or (size is not None and reference_batch_size not in (None, size)):
    return
  try:
    steps = len(loader)
  except TypeError:
    return
  if told == [steps]:
    return
  numbers = " and ".join(map(str, told))
  warnings.warn(
    f"train_loader has {steps} batches per epoch but the optimizer was built for "
    f"steps_per_epoch={numbers} (e.g. clicktrain(steps_per_epoch=...)): its epoch settings "
    "(ClickTrain's stages and hard prune) would fall at other epochs than the trainer's; "
    "build it with steps_per_epoch=len(train_loader)",
    UserWarning,
    stacklevel=4,
  )
