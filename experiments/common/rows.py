"""One training of a table row, the same pipeline for every table command.

A row spec (:class:`RowSpec`) says what differs between rows (the model, the method, the inner
optimizer, the data and batch, the callbacks, the result's fields); :func:`run_row` does the
rest once: loaders, optimizer, model, the method's transform, the ``Trainer``, ``--resume``,
the fit inside the command's time box, the result with its loader and provenance, saving it,
and deleting the row's checkpoints once it is saved.

    spec = RowSpec(label="vgg11 dense", model=build, method=methods.get("dense"), ...)
    record = run_row(spec, args.options)   # None: stopped at --max-seconds, checkpoint kept

PruneTrain's ``--paired`` runs alternate epochs: they use :func:`build_row`,
:meth:`Row.advance` and :func:`row_record`, the parts :func:`run_row` is made of.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.common import run_options
from experiments.common.machine import host_steal_seconds, steal_since
from experiments.common.run_options import RunOptions

# Largest evaluation batch: every table evaluates its test set in batches of at most this.
_TEST_BATCH = 500


@dataclasses.dataclass(frozen=True)
class RowSpec:
  """What one row's training is made of (everything else is :func:`run_row`'s).

  Attributes:
    label: names the run in messages (``"vgg11 dense"``).
    model: builds the row's fresh model.
    method: the :class:`jaxprune.methods.Method` of the row: its ``convert`` is applied to
      the model, its ``make_tx`` wraps ``optimizer``.
    optimizer: the inner optimizer, given the training loader's steps per epoch.
    train_set: the training data set.
    test_set: the evaluation data set.
    batch_size: the training batch.
    augment: the training loader's augmentation.
    epochs: the run's length.
    seed: the training loader's shuffling seed.
    result: the row's record, given the trained :class:`Row` (the loader and provenance are
      added by :func:`row_record`).
    callbacks: the ``Trainer`` callbacks, given the test loader and the method's
      :class:`jaxprune.methods.Run`.
    metrics: the ``Trainer``'s per-epoch metrics.
    trainer_options: other ``Trainer`` arguments (``label_smoothing``, ``flip_tta``, ...).
    log_path: the per-epoch log, or None.
    checkpoint_dir: where the run checkpoints (None: it keeps none, so a stopped run is lost).
    run_config: the settings a resume is checked against (a resume under others is refused).
    measure: read off the fresh model before training (kept as :attr:`Row.measured`).
    switch: ``(done, augment)``: train epoch by epoch until ``done(trainer)``, then go on with
      the training augmentation ``augment`` (ClickTrain's one-shot mixup after its prune).
    save: writes the finished record (its JSON or page) before the checkpoints are deleted.
  """

  label: str
  model: Callable[[], Any]
  method: Any
  optimizer: Callable[[int], Any]
  train_set: Any
  test_set: Any
  batch_size: int
  augment: str
  epochs: int
  seed: int
  result: Callable[[Row], dict[str, Any]]
  callbacks: Callable[[Any, Any], Sequence[Any]] = lambda test_loader, run: ()
  metrics: Mapping[str, Callable[[Any], Any]] | None = None
  trainer_options: Mapping[str, Any] | None = None
  log_path: Path | None = None
  checkpoint_dir: Path | None = None
  run_config: Mapping[str, Any] | None = None
  measure: Callable[[Any], Any] | None = None
  switch: tuple[Callable[[Any], bool], str] | None = None
  save: Callable[[dict[str, Any]], None] | None = None


@dataclasses.dataclass
class Row:
  """One row's training in progress: its trainer and loaders, and the wall and host steal
  seconds its fits took (steal None once unknown: a resumed run's earlier parts)."""

  spec: RowSpec
  trainer: Any
  train_loader: Any
  test_loader: Any
  callbacks: list[Any]
  measured: Any = None
  wall_s: float = 0.0
  steal_s: float | None = 0.0

  @property
  def method(self) -> str:
    """The name of the row's method."""
    return self.spec.method.name

  def advance(self, epochs: int, **fit_kwargs: Any) -> None:
    """Train until ``epochs`` epochs are complete (or the time box of ``fit_kwargs`` stops
    it), adding the wall and steal time taken.

    Args:
      epochs: the epoch to reach; nothing is done if the run is already there (resumed past
        it).
      **fit_kwargs: ``Trainer.fit``'s time box (:func:`run_options.fit_kwargs`).
    """
    if self.trainer.epoch >= epochs:
      return
    steal_start = host_steal_seconds()
    start = time.perf_counter()
    self.trainer.fit(
      self.train_loader, self.test_loader, epochs=epochs, resume=False, overwrite=True, **fit_kwargs
    )
    self.wall_s += time.perf_counter() - start
    steal = steal_since(steal_start)
    self.steal_s = None if steal is None or self.steal_s is None else self.steal_s + steal


def build_row(spec: RowSpec, options: RunOptions) -> Row:
  """The row's loaders, model, transform and trainer, restored from its checkpoint under
  ``options.resume``.

  Args:
    spec: the row.
    options: the command's run options.

  Returns:
    The :class:`Row`, at epoch 0 or at its checkpoint's epoch.
  """
  from jaxprune import methods, train

  train_loader = run_options.train_loader(
    options, spec.train_set, spec.batch_size, spec.augment, spec.seed
  )
  test_loader = run_options.test_loader(
    options, spec.test_set, min(_TEST_BATCH, len(spec.test_set))
  )
  model = spec.method.convert(spec.model())
  measured = spec.measure(model) if spec.measure is not None else None
  run = methods.Run.from_loader(train_loader, epochs=spec.epochs)
  tx = spec.method.make_tx(spec.optimizer(len(train_loader)), run)
  callbacks = list(spec.callbacks(test_loader, run))
  trainer = train.Trainer(
    model,
    tx,
    callbacks=callbacks,
    metrics=spec.metrics,
    log_path=spec.log_path,
    checkpoint_dir=spec.checkpoint_dir,
    run_config=spec.run_config,
    **{"progress": False, **run_options.trainer_kwargs(options), **(spec.trainer_options or {})},
  )
  row = Row(spec, trainer, train_loader, test_loader, callbacks, measured)
  if spec.checkpoint_dir is not None and run_options.start_or_resume(
    trainer, train_loader, options.resume
  ):
    # Wall time of the earlier parts as the trainer kept it; their steal time is unknown.
    row.wall_s, row.steal_s = trainer.history[-1]["wall_time_s"], None
  return row


def row_record(row: Row, options: RunOptions) -> dict[str, Any]:
  """The finished row's record: the spec's result with the loader and where and when it was
  trained (:func:`run_options.provenance`); its per-epoch ``history`` stays last."""
  record = row.spec.result(row)
  history = record.pop("history", None)
  record.update(loader=options.loader, **run_options.provenance())
  if history is not None:
    record["history"] = history
  return record


def run_row(spec: RowSpec, options: RunOptions) -> dict[str, Any] | None:
  """Trains one row to its last epoch and saves it.

  Builds the row (:func:`build_row`: resumed under ``options.resume``), trains it inside the
  command's time box, and, if it finished, makes its record (:func:`row_record`), saves it
  (``spec.save``) and deletes its checkpoints: nothing is left to resume.

  Args:
    spec: the row.
    options: the command's run options.

  Returns:
    The record, or None if the run stopped at the time box (said on stdout; its checkpoint
    stays for ``--resume``).
  """
  row = build_row(spec, options)
  if spec.switch is not None:
    done, augment = spec.switch
    while row.trainer.epoch < spec.epochs and not done(row.trainer):
      row.advance(row.trainer.epoch + 1)
    row.train_loader = run_options.train_loader(
      options, spec.train_set, spec.batch_size, augment, spec.seed
    )
  row.advance(spec.epochs, **run_options.fit_kwargs(options))
  if run_options.stopped(row.trainer, spec.label):
    return None
  record = row_record(row, options)
  if spec.save is not None:
    spec.save(record)
  if spec.checkpoint_dir is not None:
    shutil.rmtree(spec.checkpoint_dir, ignore_errors=True)
  return record
