"""Ready-made host-side callbacks for :class:`jaxprune.train.Trainer`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from jaxprune.train.trainer import Callback, Trainer, grow_batch_size

ReconfigureFn = Callable[[nnx.Module, Any], tuple[nnx.Module, Any, Any]]


class Reconfigure(Callback):
  """Periodically replace the model by a smaller one, optionally growing the mini-batch.

  PruneTrain §3.3 reconfigures the network every ``every_epochs`` epochs (10 on CIFAR);
  §4.3 then grows the mini-batch, in multiples of ``granularity`` (32), to fill the memory
  the smaller model freed, and scales the LR by the same factor (linear scaling rule).
  The memory is XLA's analysis of the compiled train step (:meth:`Trainer.step_memory`):
  the budget is what the model needed at the batch size of the first reconfiguration
  (the dense model's memory), kept in the checkpointed state; the batch grows by
  :func:`jaxprune.train.grow_batch_size`.

  Args:
    reconfigure: ``(model, opt_state) -> (new_model, new_opt_state, report)``, e.g.
      ``jaxprune.prunetrain.reconfigure``.
    every_epochs: run after every this many epochs.
    image_shape: one example's shape; required with ``grow_batch``.
    grow_batch: grow the batch into the freed memory (PruneTrain's dynamic mini-batch).
    granularity: batch sizes grow in steps of this.
    max_batch_size: upper bound of the grown batch (e.g. the data set size); ``None`` = none.
    report_metrics: ``report -> dict`` of entries for the epoch's JSON line, for a
      reconfiguration that is installed.
    changed: ``report -> bool``; when it says False the model is kept (no recompilation,
      no batch growth) and the record says only ``reconfigured: False``.  Default: always
      True.

  Attributes:
    reports: the ``report`` of every reconfiguration so far.

  Example:
    >>> from jaxprune import prunetrain  # doctest: +SKIP
    >>> hook = Reconfigure(prunetrain.reconfigure, every_epochs=10, image_shape=(32, 32, 3),
    ...                    grow_batch=True)  # doctest: +SKIP
  """

  def __init__(
    self,
    reconfigure: ReconfigureFn,
    every_epochs: int,
    *,
    image_shape: tuple[int, ...] | None = None,
    grow_batch: bool = False,
    granularity: int = 32,
    max_batch_size: int | None = 8192,
    report_metrics: Callable[[Any], Mapping[str, Any]] | None = None,
    changed: Callable[[Any], bool] | None = None,
  ):
    if every_epochs < 1:
      raise ValueError(f"every_epochs must be >= 1, got {every_epochs}")
    if grow_batch and image_shape is None:
      raise ValueError("image_shape is required when grow_batch=True")
    if granularity < 1 or (max_batch_size is not None and max_batch_size < granularity):
      raise ValueError(f"granularity must be in [1, max_batch_size], got {granularity}")
    self.reconfigure = reconfigure
    self.every_epochs = every_epochs
    self.image_shape = tuple(image_shape) if image_shape is not None else None
    self.grow_batch = grow_batch
    self.granularity = granularity
    self.max_batch_size = max_batch_size
    self.report_metrics = report_metrics
    self.changed = changed
    self.reports: list[Any] = []
    self.budget_bytes: int | None = None

  def state_dict(self) -> dict[str, Any]:
    return {"budget_bytes": self.budget_bytes}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.budget_bytes = state.get("budget_bytes")

  def on_epoch_end(self, trainer: Trainer, epoch: int) -> Mapping[str, Any] | None:
    if epoch % self.every_epochs:
      return None
    batch = trainer.batch_size
    if self.grow_batch and batch and self.budget_bytes is None:
      self.budget_bytes = trainer.step_memory(batch, self.image_shape)["total"]
    new_model, new_opt_state, report = self.reconfigure(trainer.model, trainer.opt_state)
    self.reports.append(report)
    if self.changed is not None and not self.changed(report):
      return {"reconfigured": False}
    metrics: dict[str, Any] = {"reconfigured": True}
    if self.report_metrics is not None:
      metrics.update(self.report_metrics(report))
    trainer.replace(new_model, new_opt_state)
    if self.grow_batch and batch:
      new_batch = grow_batch_size(
        lambda size: trainer.step_memory(size, self.image_shape)["total"],
        batch,
        self.budget_bytes,
        granularity=self.granularity,
        max_batch_size=self.max_batch_size,
      )
      if new_batch > batch:
        trainer.set_batch_size(new_batch, scale_lr=True)  # linear LR scaling (§4.3)
      metrics["next_batch_size"] = new_batch
    return metrics
