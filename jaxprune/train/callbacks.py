"""Host-side hooks of :class:`jaxprune.train.Trainer`: the :class:`Callback` base class.

A hook may replace the model and optimizer state (PruneTrain's reconfiguration), change the
batch size (PruneTrain's dynamic mini-batch), add entries to the epoch's JSON record, and keep
its own state in the checkpoints for exact resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
  from jaxprune.train.trainer import Trainer

__all__ = ["Callback", "as_callbacks"]


class Callback:
  """Base class of host-side hooks (override what you need).

  Attributes:
    every_steps: if set, :meth:`on_step` runs after every ``every_steps`` optimizer steps.
  """

  every_steps: int | None = None

  def on_fit_start(self, trainer: "Trainer") -> None:
    """Runs when :meth:`Trainer.fit` starts, after a checkpoint was restored (a hook that
    changes the model's structure once, e.g. ClickTrain's sparse execution, re-applies it
    to a resumed run here)."""
    del trainer

  def on_train_epoch_end(self, trainer: "Trainer", epoch: int, train_loader: Iterable) -> None:
    """Runs after epoch ``epoch`` (1-based) was trained, before it is evaluated; may change
    the model's non-trained state for evaluation (e.g. re-estimate BatchNorm statistics
    from ``train_loader``, :func:`jaxprune.train.recompute_batch_stats`)."""
    del trainer, epoch, train_loader

  def on_epoch_end(self, trainer: "Trainer", epoch: int) -> Mapping[str, Any] | None:
    """Runs after epoch ``epoch`` (1-based) was trained and evaluated, before the
    checkpoint. Return a dict to add entries to the epoch's JSON record."""
    del trainer, epoch
    return None

  def on_step(self, trainer: "Trainer", step: int) -> None:
    """Runs after optimizer step ``step`` (1-based, global) when ``every_steps`` divides it."""
    del trainer, step

  def after_epoch(self, trainer: "Trainer", record: Mapping[str, Any]) -> None:
    """Runs after the epoch's record was logged and the checkpoint written (reporting)."""
    del trainer, record

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state saved in checkpoints (for exact resume)."""
    return {}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    del state


class _FunctionCallback(Callback):
  def __init__(self, fn: Callable[["Trainer", int], Mapping[str, Any] | None]):
    self._fn = fn

  def on_epoch_end(self, trainer, epoch):
    return self._fn(trainer, epoch)



def as_callbacks(callbacks: Sequence[Callback | Callable[["Trainer", int], Any]]) -> list[Callback]:
  """``callbacks`` as :class:`Callback` objects (a function ``(trainer, epoch) -> dict | None``
  becomes an ``on_epoch_end`` hook).

  Raises:
    ValueError: a callback's ``every_steps`` is set and < 1.
  """
  out = [c if isinstance(c, Callback) else _FunctionCallback(c) for c in callbacks]
  for c in out:
    if c.every_steps is not None and c.every_steps < 1:
      raise ValueError(f"callbacks: every_steps must be >= 1, got {c.every_steps}")
  return out
