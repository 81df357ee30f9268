"""Host-side hooks of :class:`jaxprune.train.Trainer`: the :class:`Callback` base class and
:class:`TrainerLike`, what a hook may use of the trainer it is given.

A hook may replace the model and optimizer state (PruneTrain's reconfiguration), change the
batch size (PruneTrain's dynamic mini-batch), add entries to the epoch's JSON record, and keep
its own state in the checkpoints for exact resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import optax
from flax import nnx

__all__ = ["Callback", "TrainerLike", "as_callbacks"]


class TrainerLike(Protocol):
  """What a hook may use of the trainer it is given (:class:`jaxprune.train.Trainer` is one).

  The members the library's hooks use (ClickTrain's, PruneTrain's and the experiments'),
  plus ``tx``, ``lr`` and ``lr_scale``, which a hook that builds a new optimizer state or
  scales the LR itself needs. Naming them here keeps hooks off the trainer's internals and
  ``callbacks`` free of an import of the trainer; a test checks that the trainer has every
  member and that the library's hooks use no other.
  """

  lr_scale: float | None  # the multiplier on the optimizer's LR; settable
  train_loader: Any  # the training loader of the current fit (None before the first)

  # The trained state, read-only: a lasting change goes through replace(), an evaluation of
  # other arrays through evaluate(loader, params=..., rest=...).
  @property
  def params(self) -> Any:
    """The trained parameters."""

  @property
  def rest(self) -> Any:
    """The model's other variables (BatchNorm statistics, RNG streams)."""

  @property
  def opt_state(self) -> Any:
    """The optimizer state."""

  @property
  def model(self) -> nnx.Module:
    """The live model, synced from the trained state."""

  @property
  def tx(self) -> optax.GradientTransformation:
    """The optimizer (``tx.init`` makes an optimizer state for a new model)."""

  @property
  def epoch(self) -> int:
    """Epochs completed."""

  @property
  def step(self) -> int:
    """Optimizer steps completed."""

  @property
  def history(self) -> list[dict[str, Any]]:
    """The records of the epochs completed."""

  @property
  def batch_size(self) -> int | None:
    """The training loader's batch size this epoch."""

  @property
  def reference_batch_size(self) -> int | None:
    """The training loader's batch size when the run started."""

  @property
  def num_devices(self) -> int:
    """Devices the global batch is split over (1 without a mesh)."""

  @property
  def lr(self) -> float | None:
    """The LR the last step applied (``None`` if the optimizer does not expose it)."""

  def replace(self, model: nnx.Module | None = None, opt_state: Any | None = None) -> None:
    """Installs a new model and/or optimizer state."""

  def evaluate(
    self, loader: Iterable, *, params: Any = None, rest: Any = None
  ) -> dict[str, float]:
    """Test loss and accuracy over ``loader`` with the trained state.

    Or with ``params`` / ``rest`` in its place.
    """

  def set_batch_size(self, batch_size: int, *, scale_lr: bool = True) -> None:
    """Changes the training batch size from the next epoch on."""

  def step_memory(
    self, batch_size: int, image_shape: tuple[int, ...], **kwargs: Any
  ) -> dict[str, int]:
    """Memory statistics of the compiled train step at ``batch_size`` (bytes)."""


class Callback:
  """Base class of host-side hooks (override what you need).

  Each gets the trainer as a :class:`TrainerLike`: a hook that keeps to its members runs on any
  trainer that has them.

  Attributes:
    every_steps: if set, :meth:`on_step` runs after every ``every_steps`` optimizer steps.
  """

  every_steps: int | None = None

  def on_fit_start(self, trainer: TrainerLike) -> None:
    """Runs when :meth:`jaxprune.train.Trainer.fit` starts.

    It runs after a checkpoint was restored (a hook that changes the model's structure once, e.g.
    ClickTrain's sparse execution, re-applies it to a resumed run here).
    """
    del trainer

  def on_train_epoch_end(self, trainer: TrainerLike, epoch: int, train_loader: Iterable) -> None:
    """Runs after epoch ``epoch`` (1-based) was trained, before it is evaluated.

    May change the model's non-trained state for evaluation (e.g. re-estimate BatchNorm statistics
    from ``train_loader``, :func:`jaxprune.train.recompute_batch_stats`).
    """
    del trainer, epoch, train_loader

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> Mapping[str, Any] | None:
    """Runs after epoch ``epoch`` (1-based) was trained and evaluated.

    It runs before the checkpoint. Return a dict to add entries to the epoch's JSON record.
    """
    del trainer, epoch
    return None

  def on_step(self, trainer: TrainerLike, step: int) -> None:
    """Runs after optimizer step ``step`` (1-based, global) when ``every_steps`` divides it."""
    del trainer, step

  def after_epoch(self, trainer: TrainerLike, record: Mapping[str, Any]) -> None:
    """Runs after the epoch's record was logged and the checkpoint written (reporting)."""
    del trainer, record

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state saved in checkpoints (for exact resume)."""
    return {}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    del state


class _FunctionCallback(Callback):
  def __init__(self, fn: Callable[[TrainerLike, int], Mapping[str, Any] | None]):
    self._fn = fn

  def on_epoch_end(self, trainer, epoch):
    return self._fn(trainer, epoch)


def as_callbacks(
  callbacks: Sequence[Callback | Callable[[TrainerLike, int], Any]],
) -> list[Callback]:
  """``callbacks`` as :class:`Callback` objects.

  A function ``(trainer, epoch) -> dict | None`` becomes an ``on_epoch_end`` hook.

  Raises:
    ValueError: a callback's ``every_steps`` is set and < 1.
  """
  out = [c if isinstance(c, Callback) else _FunctionCallback(c) for c in callbacks]
  for c in out:
    if c.every_steps is not None and c.every_steps < 1:
      raise ValueError(f"callbacks: every_steps must be >= 1, got {c.every_steps}")
  return out
