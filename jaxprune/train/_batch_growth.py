"""Batch-size changes between epochs with linear LR scaling (PruneTrain §4.3 dynamic
mini-batch), and the memory probe of the compiled step that sizes them."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxprune.train import _loaders, optim
from jaxprune.train.step import train_step_memory

__all__ = ["BatchGrowth"]


class BatchGrowth:
  """LR scale, batch size and step memory of :class:`~jaxprune.train.Trainer` (a mixin of it:
  ``opt_state``, ``params``, ``rest``, ``num_devices`` and the step are the trainer's)."""

  @property
  def lr_scale(self) -> float | None:
    """Multiplier on the LR of every ``scale_by_lr`` in the optimizer (``None`` if none)."""
    return optim.get_lr_scale(self.opt_state)

  @lr_scale.setter
  def lr_scale(self, value: float) -> None:
    self.opt_state = optim.set_lr_scale(self.opt_state, value)

  @property
  def lr(self) -> float | None:
    """LR applied by the last step (``None`` if the optimizer does not expose it)."""
    return optim.get_lr(self.opt_state)

  def set_batch_size(self, batch_size: int, *, scale_lr: bool = True) -> None:
    """Change the training batch size from the next epoch on (PruneTrain §4.3).

    With ``scale_lr`` the LR multiplier grows by ``new / old`` (linear scaling rule).
    Schedules advance by ``batch_size / reference_batch_size`` per step so epoch
    milestones stay put.
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if batch_size % self.num_devices:
      raise ValueError(
        f"batch_size {batch_size} is not divisible by the {self.num_devices} devices of the "
        "data-parallel mesh"
      )
    self._pending_batch_size = (int(batch_size), scale_lr)

  def _apply_pending_batch_size(self, loader: Any) -> None:
    if self._pending_batch_size is None:
      return
    new_size, scale_lr = self._pending_batch_size
    self._pending_batch_size = None
    old_size = _loaders.batch_size(loader)
    if old_size is None:
      raise ValueError("train_loader has no batch_size attribute; cannot change it")
    _loaders.set_batch_size(loader, new_size)
    if scale_lr and new_size != old_size:
      self.lr_scale = (self.lr_scale or 1.0) * new_size / old_size
    if self.reference_batch_size:
      self.opt_state = optim.set_step_increment(
        self.opt_state, new_size / self.reference_batch_size
      )

  def step_memory(
    self, batch_size: int, image_shape: tuple[int, ...], **kwargs: Any
  ) -> dict[str, int]:
    """XLA memory statistics of the compiled train step at ``batch_size`` (bytes).

    Memoised per model/optimizer shapes, since each analysis compiles the step."""
    shapes = tuple(np.shape(x) for x in jax.tree.leaves((self.params, self.rest, self.opt_state)))
    key = (
      id(self._steps),
      shapes,
      int(batch_size),
      tuple(image_shape),
      tuple(sorted(kwargs.items())),
    )
    if key not in self._memory_cache:
      self._memory_cache[key] = train_step_memory(
        self._steps, self.params, self.rest, self.opt_state, image_shape, batch_size, **kwargs
      )
    return dict(self._memory_cache[key])
