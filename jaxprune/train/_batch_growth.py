"""Batch-size changes between epochs with linear LR scaling (PruneTrain §4.3 dynamic
mini-batch), and the memory probe of the compiled step that sizes them: one part of
:class:`~jaxprune.train.Trainer`, held in its ``_batches`` field.

:class:`BatchGrowth` writes the batch sizes it tracks and its memo of step memories; the LR
scale and schedule increment it changes live in the optimizer state, which it edits through
the :class:`~jaxprune.train._placement.Placement` that owns it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxprune.train import _loaders
from jaxprune.train._placement import Placement
from jaxprune.train.compiled import train_step_memory
from jaxprune.train.optim import schedule_step, set_schedule_step

__all__ = ["BatchGrowth"]


class BatchGrowth:
  """The training batch size, a requested change of it, and the step's memory.

  Attributes:
    batch_size: the training loader's batch size this epoch (``None`` before the first).
    reference_batch_size: the loader's batch size when the run started.
    reference_steps: the loader's batches per epoch when the run started (``None``: it has no
      length); schedules set in epochs count in these steps, so after a batch change one step
      advances them by ``reference_steps / len(loader)`` and an epoch of the grown batch ends
      where the trainer's epoch ends (PruneTrain §4.3 keeps the schedule in epochs).
    anchor: ``(epoch, schedule position)`` at the first batch change, or ``None``; from then
      on each epoch starts at ``position + (epoch - anchor epoch) * reference_steps``.
    pending: ``(batch size, scale the LR)`` requested for the next epoch, or ``None``.
  """

  def __init__(self, placement: Placement):
    self._placement = placement
    self.batch_size: int | None = None
    self.reference_batch_size: int | None = None
    self.reference_steps: int | None = None
    self.anchor: tuple[int, float] | None = None
    self.pending: tuple[int, bool] | None = None
    self._memory_cache: dict[Any, dict[str, int]] = {}

  def set_batch_size(self, batch_size: int, *, scale_lr: bool = True) -> None:
    """:meth:`Trainer.set_batch_size <jaxprune.train.Trainer.set_batch_size>`.

    Requests ``batch_size`` (a multiple of the devices) for the next epoch.
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    devices = self._placement.num_devices
    if batch_size % devices:
      raise ValueError(
        f"batch_size {batch_size} is not divisible by the {devices} devices of the "
        "data-parallel mesh"
      )
    self.pending = (int(batch_size), scale_lr)

  def start_fit(self, loader: Any) -> None:
    """A run's first fit takes the loader's batch size as the reference."""
    if self.reference_batch_size is None:
      self.reference_batch_size = _loaders.batch_size(loader)
      self.reference_steps = _loaders.length(loader)

  def start_epoch(self, loader: Any, epoch: int) -> None:
    """Applies a requested batch size to ``loader`` before epoch ``epoch`` (epochs done).

    It also applies the LR scale and schedule increment to the optimizer state, puts the schedules
    on the epoch's start once the batch has changed, and records the epoch's batch size.
    """
    self._apply_pending(loader, epoch)
    if self.anchor is not None and self.reference_steps:
      anchor_epoch, anchor_step = self.anchor
      start = anchor_step + (epoch - anchor_epoch) * self.reference_steps
      self._placement.opt_state = set_schedule_step(self._placement.opt_state, start)
    self.record_batch_size(loader)

  def record_batch_size(self, loader: Any) -> None:
    """The epoch trains at ``loader``'s batch size (``None``: it has none)."""
    self.batch_size = _loaders.batch_size(loader)

  def _apply_pending(self, loader: Any, epoch: int) -> None:
    if self.pending is None:
      return
    new_size, scale_lr = self.pending
    self.pending = None
    old_size = _loaders.batch_size(loader)
    if old_size is None:
      raise ValueError("train_loader has no batch_size attribute; cannot change it")
    _loaders.set_batch_size(loader, new_size)
    placement = self._placement
    if scale_lr and new_size != old_size:
      placement.lr_scale = (placement.lr_scale or 1.0) * new_size / old_size
    steps = _loaders.length(loader)
    if self.reference_steps and steps:
      placement.set_step_increment(self.reference_steps / steps)
      if self.anchor is None and new_size != old_size:
        position = schedule_step(placement.opt_state)
        self.anchor = None if position is None else (int(epoch), position)
    elif self.reference_batch_size:  # a loader without a length: the samples per step
      placement.set_step_increment(new_size / self.reference_batch_size)

  def state_dict(self) -> dict[str, Any]:
    """The checkpoint's entries of this part."""
    return {
      "reference_batch_size": self.reference_batch_size,
      "reference_steps": self.reference_steps,
      "schedule_anchor": list(self.anchor) if self.anchor else None,
      # A batch change requested by an epoch-end hook applies at the next epoch.
      "pending_batch_size": list(self.pending) if self.pending else None,
    }

  def load_state_dict(self, meta: Mapping[str, Any]) -> None:
    """Takes this part's entries from a checkpoint's metadata."""
    self.reference_batch_size = meta.get("reference_batch_size")
    self.reference_steps = meta.get("reference_steps")
    anchor = meta.get("schedule_anchor")
    self.anchor = (int(anchor[0]), float(anchor[1])) if anchor else None
    pending = meta.get("pending_batch_size")
    self.pending = (int(pending[0]), bool(pending[1])) if pending else None

  def step_memory(
    self, batch_size: int, image_shape: tuple[int, ...], **kwargs: Any
  ) -> dict[str, int]:
    """:meth:`Trainer.step_memory <jaxprune.train.Trainer.step_memory>`, memoised.

    Memoised per model/optimizer shapes, since each analysis compiles the step.
    """
    p = self._placement
    shapes = tuple(np.shape(x) for x in jax.tree.leaves((p.params, p.rest, p.opt_state)))
    key = (
      id(p.steps),
      shapes,
      int(batch_size),
      tuple(image_shape),
      tuple(sorted(kwargs.items())),
    )
    if key not in self._memory_cache:
      self._memory_cache[key] = train_step_memory(
        p.steps, p.params, p.rest, p.opt_state, image_shape, batch_size, **kwargs
      )
    return dict(self._memory_cache[key])
