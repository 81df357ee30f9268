"""One training of a table row, the same pipeline for every table command.

A row spec (:class:`RowSpec`) says what differs between rows (the model, the method, the inner
optimizer, the data and batch, the callbacks, the result's fields); :func:`run_row` does the
rest once: loaders, optimizer, model, the method's transform, the ``Trainer``, ``--resume``,
the fit inside the command's time box, the result with its loader and provenance, saving it,
and deleting the row's checkpoints once it is saved.

    spec = RowSpec(label="vgg11 dense", model=build, method=methods.get("dense"), ...)
    record = run_row(spec, args.options)   # None: stopped at --max-seconds, checkpoint kept

A run that several tables train alike (a model's dense baseline at one budget) is trained
once: its spec names a :class:`SharedRun`, whose record the first table to train it saves and
every later table with the same settings takes (:func:`run_row`).

PruneTrain's ``--paired`` runs alternate epochs: they use :func:`build_row`,
:meth:`Row.advance` and :func:`row_record`, the parts :func:`run_row` is made of.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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
    shared: the run is one that other tables train alike (:class:`SharedRun`): taken from
      there when saved, saved there once trained.
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
  shared: SharedRun | None = None


# What a shared run keeps: what its training gave (the rest of a table's record is read off the
# model's structure, the same for every table that trains it).
_SHARED_FIELDS = (
  "history",
  "train_acc",
  "test_gain_last_quarter",
  "wall_time_s",
  "host_steal_s",
  "loader",
  "machine",
  "date",
)


@dataclasses.dataclass(frozen=True)
class SharedRun:
  """A run that several tables train alike, such as a model's dense baseline at one budget:
  the first table to train it saves what the training gave to ``folder``, and every table
  whose run has the same ``settings`` takes it from there instead of training it again.

  Only a run whose record is its history, its fit figures and what the model's structure
  gives can be shared: a dense run (the tables' other records read the trained parameters).

  Attributes:
    folder: where shared runs are saved (:func:`experiments.common.pages.shared_dir`).
    name: the run's readable name (``"fit_clicktrain-vgg11_seed0"``); the file adds a digest
      of ``settings``, so runs of other settings never meet.
    settings: everything the training depends on (model, width, data, schedule, augmentation,
      seed, dtype, loader, evaluation cadence), JSON-serialisable.
  """

  folder: Path
  name: str
  settings: Mapping[str, Any]

  @property
  def path(self) -> Path:
    """The run's file: ``<folder>/<name>_<digest of the settings>.json``."""
    text = json.dumps(self.settings, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return Path(self.folder) / f"{self.name}_{digest}.json"

  def load(self) -> dict[str, Any] | None:
    """The saved run (``settings``, ``trained_by``, ``command`` and the shared record fields),
    or None if no table trained it yet."""
    if not self.path.exists():
      return None
    saved = json.loads(self.path.read_text())
    if saved.get("settings") != json.loads(json.dumps(self.settings, default=str)):
      raise ValueError(f"shared run {self.path}: saved under other settings than its digest says")
    return saved

  def save(self, label: str, record: Mapping[str, Any]) -> None:
    """Saves the finished run whose record is ``record`` (trained by the row ``label``)."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    saved = {
      "settings": self.settings,
      "trained_by": label,
      "command": record.get("command"),
      **{k: record[k] for k in _SHARED_FIELDS if k in record},
    }
    self.path.write_text(json.dumps(saved, indent=1, default=float))


# The step-budget settings a dense run's training depends on (the method settings do not).
_DENSE_BUDGET_FIELDS = ("train_subset", "test_subset", "epochs", "batch_size", "lr", "milestones")
# Augmentation presets that are the same transform under two names (jaxprune.data.augment):
# ClickTrain's and PruneTrain's 4-pixel pad-crop + flip.
_SAME_AUGMENTATION = {"clicktrain": "crop_flip", "prunetrain": "crop_flip"}


def dense_settings(
  model: str,
  width: float,
  budget: Mapping[str, Any],
  options: RunOptions,
  *,
  augment: str,
  seed: int,
  dtype: str,
  momentum: float = 0.9,
  weight_decay: float = 5e-4,
  model_overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
  """The settings a dense SGD run's training depends on, for :class:`SharedRun`: the model and
  its width (and constructor ``model_overrides``), the step budget's data and schedule, the
  loader and evaluation cadence of ``options``, the augmentation (presets that are one
  transform under two names count as one), the seed, the dtype, SGD's momentum and weight
  decay. Two tables whose dense runs have equal settings train the same run.

  Args:
    model: the registry name (``"clicktrain-vgg11"``).
    width: its width multiplier.
    budget: a :class:`~experiments.common.budgets.StepBudget`.
    options: the command's run options.
    augment: the training augmentation preset.
    seed: the model's and the loader's seed.
    dtype: the compute dtype's name (``"fp32"``).
    momentum: SGD's momentum.
    weight_decay: SGD's weight decay.
    model_overrides: other keywords of ``models.create``.
  """
  from experiments.common import budgets

  saved = budgets.as_saved(budget)
  return {
    "model": model,
    "width": float(width),
    "model_overrides": dict(model_overrides or {}),
    **{k: saved[k] for k in _DENSE_BUDGET_FIELDS},
    "loader": options.loader,
    "steps_per_dispatch": options.steps_per_dispatch,
    "eval_every": options.eval_every,
    "augment": _SAME_AUGMENTATION.get(augment, augment),
    "seed": seed,
    "dtype": dtype,
    "momentum": momentum,
    "weight_decay": weight_decay,
  }


def shared_dense_run(
  budget_name: str,
  model: str,
  width: float,
  budget: Mapping[str, Any],
  options: RunOptions,
  *,
  publish: bool,
  out: str | None,
  seed: int,
  dtype: str,
  **recipe: Any,
) -> SharedRun:
  """The :class:`SharedRun` of ``model``'s dense run at budget ``budget_name``: named
  ``<budget>[_<dtype>]_<model>_seed<S>`` in :func:`experiments.common.pages.shared_dir`, with the
  settings of :func:`dense_settings` (``recipe``: its other keywords), so every table and probe
  that trains the same run finds the same file."""
  from experiments.common import cli, pages

  return SharedRun(
    pages.shared_dir(publish, out),
    f"{budget_name}{cli.dtype_suffix(dtype)}_{model}_seed{seed}",
    dense_settings(model, width, budget, options, seed=seed, dtype=dtype, **recipe),
  )


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


def last_quarter_gain(history: Sequence[Mapping[str, Any]]) -> float | None:
  """How much the test accuracy rose over the last quarter of a run, as a fraction: the last
  evaluation's ``test_acc`` less the first one inside the quarter (the first evaluated epoch
  after ``round(0.75 * E)`` of ``E`` epochs). The papers' schedules drop the LR for the last
  time at 75% of the run, so the quarter is the final LR's phase: a run that plateaued gains
  little there, one cut short is still climbing (the jump at the drop itself is not counted).
  None when the quarter holds fewer than two evaluations.

  Args:
    history: the trainer's per-epoch records (``epoch``, and ``test_acc`` where evaluated).
  """
  evaluated = [r for r in history if r.get("test_acc") is not None]
  if not evaluated:
    return None
  start = round(0.75 * evaluated[-1]["epoch"])
  quarter = [r for r in evaluated if r["epoch"] > start]
  if len(quarter) < 2:
    return None
  return float(quarter[-1]["test_acc"] - quarter[0]["test_acc"])


def fit_figures(row: Row, options: RunOptions) -> dict[str, float | None]:
  """Whether the finished run fit its data: ``train_acc``, the accuracy on the very training
  images it trained on (eval mode: running BatchNorm statistics, no dropout, no training
  augmentation), and ``test_gain_last_quarter`` (:func:`last_quarter_gain`)."""
  loader = run_options.test_loader(
    options, row.spec.train_set, min(_TEST_BATCH, len(row.spec.train_set))
  )
  return {
    "train_acc": float(row.trainer.evaluate(loader)["test_acc"]),
    "test_gain_last_quarter": last_quarter_gain(row.trainer.history),
  }


def row_record(row: Row, options: RunOptions) -> dict[str, Any]:
  """The finished row's record: the spec's result with the fit figures (:func:`fit_figures`),
  the loader and where and when it was trained (:func:`run_options.provenance`); its per-epoch
  ``history`` stays last."""
  record = row.spec.result(row)
  history = record.pop("history", None)
  record.update(fit_figures(row, options))
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
  if spec.shared is not None and (saved := spec.shared.load()) is not None:
    return _shared_record(spec, options, saved)
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
  if spec.shared is not None:
    spec.shared.save(spec.label, record)
  if spec.save is not None:
    spec.save(record)
  if spec.checkpoint_dir is not None:
    shutil.rmtree(spec.checkpoint_dir, ignore_errors=True)
  return record


def _shared_record(spec: RowSpec, options: RunOptions, saved: Mapping[str, Any]) -> dict[str, Any]:
  """This table's record of a shared run that another table trained (``saved``): the spec's
  result, computed on the fresh model with the saved history (a shared run's record reads only
  the history and the model's structure), with the saved fit figures, wall time and
  provenance; nothing is trained."""
  row = build_row(dataclasses.replace(spec, checkpoint_dir=None), options)
  row.trainer.history = [dict(r) for r in saved["history"]]
  row.trainer.epoch = int(saved["history"][-1]["epoch"])
  row.trainer.step = int(saved["history"][-1].get("step", 0))
  row.wall_s, row.steal_s = saved.get("wall_time_s", 0.0), saved.get("host_steal_s")
  record = spec.result(row)
  history = record.pop("history", None)
  record.update({k: saved[k] for k in _SHARED_FIELDS if k in saved and k != "history"})
  if saved.get("command") is not None:
    record["command"] = saved["command"]
  record["shared_from"] = {"trained_by": saved["trained_by"], "file": spec.shared.path.name}
  if spec.log_path is not None:  # this table's link to the run's epochs
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    spec.log_path.write_text("".join(json.dumps(r) + "\n" for r in saved["history"]))
  if history is not None:
    record["history"] = history
  print(
    f"{spec.label}: taken from the shared run {spec.shared.path} (trained by "
    f"{saved['trained_by']}), not trained again",
    flush=True,
  )
  if spec.save is not None:
    spec.save(record)
  return record
