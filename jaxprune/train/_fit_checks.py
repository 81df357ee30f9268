"""Checks of the :class:`~jaxprune.train.Trainer`'s arguments and of ``fit``'s start.

The constructor's settings, ``fit``'s arguments, and the training loader against the epoch
length the optimizer was built for.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxprune.train import _loaders
from jaxprune.train.optim import find_epoch_lengths

__all__ = ["check_arguments", "check_settings", "json_run_config", "warn_epoch_length"]


def check_settings(
  label_smoothing: float, checkpoint_every: Any, eval_every: Any, max_nonfinite_steps: Any
) -> None:
  """The checks of the :class:`~jaxprune.train.Trainer`'s numeric settings (named)."""
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
  for name, value, least in (
    ("checkpoint_every", checkpoint_every, 0),
    ("eval_every", eval_every, 1),
    # None: never stop on non-finite steps.
    ("max_nonfinite_steps", 1 if max_nonfinite_steps is None else max_nonfinite_steps, 1),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
      raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def json_run_config(run_config: Mapping[str, Any] | None) -> dict[str, Any] | None:
  """``run_config`` as the checkpoint stores it (``None`` when empty).

  Round-tripped through JSON so the comparison on resume sees what the checkpoint stores
  (tuples become lists); unserialisable values fail here, not at the first save.

  Raises:
    ValueError: ``run_config`` is not JSON-serialisable.
  """
  try:
    return json.loads(json.dumps(dict(run_config))) if run_config else None
  except TypeError as e:
    raise ValueError(f"run_config must be JSON-serialisable: {e}") from None


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
  """Warns when ``loader``'s batches per epoch differ from a transform's epoch length.

  That is, when they are not the steps per epoch a transform of ``opt_state`` was told
  (:func:`~jaxprune.train.find_epoch_lengths`).

  Checked while the loader is at the run's reference batch size (a grown batch takes fewer
  steps per epoch by design) and when it has a length.
  """
  told = find_epoch_lengths(opt_state)
  size = _loaders.batch_size(loader)
  if not told or (size is not None and reference_batch_size not in (None, size)):
    return
  steps = _loaders.length(loader)
  if steps is None or told == [steps]:
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
