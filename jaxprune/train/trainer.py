"""The training loop: ``Trainer`` and ``fit``.

The trainer runs epochs: train, hooks, evaluation, one JSON line, a checkpoint. It holds its
other jobs as parts, each a small class in a field of its own that writes only its own
attributes:

* ``_placement`` (:class:`~jaxprune.train._placement.Placement`): the model, the trained
  state (``params``, ``rest``, ``opt_state``) and the compiled step for its structure;
* ``_batches`` (:class:`~jaxprune.train._batch_growth.BatchGrowth`): ``batch_size``,
  ``reference_batch_size``, a requested batch change and the step-memory probe;
* ``_loop`` (:class:`~jaxprune.train._epoch.EpochLoop`): one training epoch, one evaluation
  and the checks of batches and non-finite steps;
* ``_checkpoints`` (:class:`~jaxprune.train._resume.Checkpoints`): ``store``, claiming it for
  one run, saving, and reading a checkpoint back.

The trainer itself writes the run's counters (``epoch``, ``step``, ``history``,
``stopped_early``) and its settings; an attribute that lives on a part is declared on the
class as ``Part("<field>")``, so the class body says where each one is kept. The JSON-lines
log is :mod:`~jaxprune.train._run_log`, the hooks :mod:`~jaxprune.train.callbacks`.

Host-side callbacks run at epoch end (and optionally every ``k`` steps). They may

* replace the model and optimizer state (PruneTrain §3.3 reconfiguration: the new
  shapes get a freshly traced step automatically),
* change the loader's batch size and scale the LR (PruneTrain §4.3 dynamic
  mini-batch with linear LR scaling), see :meth:`Trainer.set_batch_size`,
* return extra metrics for the epoch's JSON line (e.g. a compression ratio).

Exact resume needs (a) a loader whose order depends only on ``(seed, epoch)`` — the trainer
calls ``loader.set_epoch(epoch)`` before each epoch and saves ``loader.state()`` when the
loader has them (what it uses of a loader: :class:`~jaxprune.train.HostLoader`) — and (b) every
random stream of the model inside its NNX state (``nnx.Rngs``), which the checkpoint stores.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import optax
from flax import nnx

from jaxprune import masking
from jaxprune.linen_bridge import refuse_bridged
from jaxprune.state_slicing import applied_plans
from jaxprune.train import _fit_checks, _loaders, _run_log, data_parallel
from jaxprune.train._batch_growth import BatchGrowth
from jaxprune.train._epoch import EpochLoop
from jaxprune.train._placement import Placement
from jaxprune.train._resume import Checkpoints, model_spec
from jaxprune.train._settings import DERIVED, NEW_TRAINER, PLACED, STATE, Part
from jaxprune.train._time_box import TimeBox
from jaxprune.train.callbacks import Callback, TrainerLike, as_callbacks
from jaxprune.train.checkpoint import CheckpointStore
from jaxprune.train.step import PerExampleLoss, default_loss

__all__ = ["Callback", "Trainer", "fit"]


def _is_tty() -> bool:
  return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


class Trainer:
  """Train an NNX model with any Optax transform.

  Args:
    model: an NNX module with ``train()`` / ``eval()``; ``model(x)`` returns logits.
    tx: any Optax transform; ``GradientTransformationExtraArgs`` receive ``value=loss``.
      LR scaling (:attr:`lr_scale`, :meth:`set_batch_size`) needs a
      :func:`jaxprune.train.scale_by_lr` inside it (:func:`jaxprune.train.sgd` has one).
    label_smoothing: label smoothing of the default cross-entropy loss.
    loss_fn: optional ``(logits, labels) -> per-example loss [B]`` replacing the default.
    flip_tta: evaluate on the average logits of each image and its horizontal flip.
    callbacks: :class:`Callback` objects or functions ``(trainer, epoch) -> dict | None``
      run at epoch end.
    metrics: extra per-epoch metrics ``{name: fn(trainer) -> value}`` for the JSON lines.
    log_path: file that receives one JSON object per epoch (rewritten on resume).
    checkpoint_dir: orbax checkpoint directory; ``fit`` resumes from its latest checkpoint.
      A fresh start (``fit(resume=False)``) refuses a folder that holds another run's
      checkpoints unless ``overwrite=True`` (see :meth:`fit`), and a folder another live
      trainer holds is refused until that one is closed (see :meth:`close`).
    checkpoint_every: checkpoint every this many epochs (and after the last one); ``0``:
      only after the last epoch and when :meth:`fit` stops at ``max_seconds`` (a long run on
      an accelerator, where each save of a large state costs seconds).
    eval_every: evaluate ``test_loader`` every this many epochs; the last epoch of a
      :meth:`fit` (also one cut short by ``max_seconds``) is always evaluated. Records of
      the other epochs hold no ``test_*`` keys.
    max_to_keep: number of checkpoints kept.
    progress: ``None`` (default): a tqdm bar when stderr is a terminal, else one line per
      epoch on stdout (epoch, train loss and accuracy, test accuracy when evaluated, the
      epoch's seconds), for logs; ``True``: the bar always; ``False``: neither.
    model_builder: ``spec -> model`` used on resume when the checkpoint's
      ``model.spec`` differs from the current model's (a reconfigured model); default
      :func:`jaxprune.models.rebuild` (same class and classes, conversions re-applied).
    donate: donate state buffers to the jitted step (their memory is reused for the new
      state). State the trainer may share with someone else (the model it was given and its
      ``nnx.clone`` copies, :attr:`model` once synced, an optimizer state passed to
      :meth:`replace`) is copied once before the next step, so donation never deletes an
      array the caller still holds: a clone keeps the values it had when it was made.
    run_config: JSON-serialisable description of the run (epochs, schedule, seed, ...)
      stored with every checkpoint. Resuming from a checkpoint written with a different
      ``run_config`` raises ``ValueError`` instead of silently continuing another run
      (e.g. a 10-epoch schedule on top of a 3-epoch one).
    mesh: data parallelism (:mod:`jaxprune.train.data_parallel`). ``None`` (default): one
      device, the plain jitted step. ``"auto"``: every device (``jax.devices()``, all
      processes after ``jax.distributed.initialize``) on a mesh axis ``"batch"``. A
      ``jax.sharding.Mesh`` with a ``"batch"`` axis: that mesh. The loader's batch is then
      the global batch (on several processes, each process's loader yields its local part
      of it; a :class:`~jaxprune.data.DeviceLoader`'s data set is placed replicated on the
      mesh and each device makes its own shard), split evenly over the devices; params and
      optimizer state are replicated and
      the gradients averaged explicitly in the step — sparsely, over the kept entries only,
      once the optimizer state holds final masks (:func:`jaxprune.masking.find_masks`, e.g.
      after ClickTrain's hard prune; checked at every epoch start, so also on resume).
      A batch not divisible by the devices raises ``ValueError``.
    skip_nonfinite: skip a train step whose loss or gradients are not finite (NaN / Inf):
      params, optimizer state (momentum, step count) and BatchNorm's running statistics stay
      as they were, for any ``tx``. ``False`` applies the optimizer's update whatever it is
      (one NaN gradient then usually makes every parameter NaN); BatchNorm's statistics still
      skip the step. Either way such steps are left out of the train loss and counted in
      ``nonfinite_steps``, with a ``RuntimeWarning``.
    max_nonfinite_steps: stop with :class:`~jaxprune.train.NonFiniteError` once this many
      consecutive train steps (across epochs) were not finite; checked at each epoch end, so
      the epoch in which the run reached it is finished first. The error names the run's
      first batch (epoch and 1-based step). ``None``: never stop.
    sync_batchnorm: with a mesh, normalise with the global batch's BatchNorm statistics
      (moments averaged over the devices inside each BatchNorm). Default ``False``: each
      device uses its shard's statistics (as PyTorch data parallelism without
      SyncBatchNorm) and the running statistics are averaged over the devices after each
      step. Evaluation always uses those (replicated) running statistics.

  Example:
    >>> trainer = Trainer(  # doctest: +SKIP
    ...   model, sgd(0.1, 0.9, weight_decay=5e-4), label_smoothing=0.1
    ... )
    >>> history = trainer.fit(train_loader, test_loader, epochs=10)  # doctest: +SKIP

    Data parallel over every device (each loader batch split evenly over them)::

    >>> trainer = Trainer(model, tx, mesh="auto")  # doctest: +SKIP
    >>> trainer.num_devices  # doctest: +SKIP
    4

  Training raises ``ValueError`` naming ``labels`` when a batch's labels do not fit it (one
  integer class id or one float soft-label row per image) and warns once (``UserWarning``) when
  the images are integers (unnormalised pixels; :class:`jaxprune.data.Loader` normalises).

  Raises:
    ValueError: a bad argument (named in the message), ``sync_batchnorm`` without a mesh.
  """

  def __init__(
    self,
    model: nnx.Module,
    tx: optax.GradientTransformation,
    *,
    label_smoothing: float = 0.0,
    loss_fn: PerExampleLoss | None = None,
    flip_tta: bool = False,
    callbacks: Sequence[Callback | Callable[[TrainerLike, int], Any]] = (),
    metrics: Mapping[str, Callable[["Trainer"], Any]] | None = None,
    log_path: str | os.PathLike | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    eval_every: int = 1,
    max_to_keep: int | None = 2,
    progress: bool | None = None,
    model_builder: Callable[[Any], nnx.Module] | None = None,
    donate: bool = True,
    run_config: Mapping[str, Any] | None = None,
    mesh: Any = None,
    sync_batchnorm: bool = False,
    skip_nonfinite: bool = True,
    max_nonfinite_steps: int | None = 20,
  ):
    _fit_checks.check_settings(label_smoothing, checkpoint_every, eval_every, max_nonfinite_steps)
    refuse_bridged(
      model,
      only_stateful=True,
      what="a bridged Linen module updates its batch statistics only when called with "
      "mutable=, and the Trainer calls model(x), so Flax would stop the first step ('collection "
      "batch_stats is immutable')",
      instead="The Trainer trains a bridged model whose variables are all parameters; with "
      "BatchNorm, write the model with flax.nnx layers (nnx.BatchNorm), or call it as "
      "model(x, mutable=['batch_stats']) in a loop of your own",
    )
    self.eval_every = int(eval_every)
    self.callbacks: list[Callback] = as_callbacks(callbacks)
    self.metrics = dict(metrics or {})
    self.log_path = os.fspath(log_path) if log_path is not None else None
    self.checkpoint_every = checkpoint_every
    progress_bar = _is_tty() if progress is None else bool(progress)
    # Off a terminal (a log file, a job's output) a bar is noise: one line per epoch instead.
    self.epoch_lines = progress is None and not progress_bar
    resolved_mesh = data_parallel.resolve_mesh(mesh)
    if sync_batchnorm and resolved_mesh is None:
      raise ValueError("sync_batchnorm=True needs a mesh (data parallelism)")
    run_config = _fit_checks.json_run_config(run_config)

    self.epoch = 0  # completed epochs
    self.step = 0  # completed optimizer steps
    self.history: list[dict[str, Any]] = []
    # Why the last fit stopped before its epochs (None: it did not); see fit(max_seconds=...).
    self.stopped_early: str | None = None
    # The training loader of the current fit, for hooks that look at a batch when it starts.
    self.train_loader: Iterable | None = None
    self._elapsed_before = 0.0  # seconds of the run before this fit (restored on resume)
    self._refill_check = masking.RefillCheck()  # pruned weights re-filled at an epoch end

    # The parts (see the module docstring).
    tx = optax.with_extra_args_support(tx)
    self._placement = Placement(
      model,
      tx.init(nnx.as_pure(nnx.state(model, nnx.Param))),
      tx=tx,
      loss_fn=loss_fn if loss_fn is not None else default_loss(label_smoothing),
      flip_tta=flip_tta,
      donate=donate,
      skip_nonfinite=bool(skip_nonfinite),
      mesh=resolved_mesh,
      sync_batchnorm=bool(sync_batchnorm),
    )
    self._batches = BatchGrowth(self._placement)
    self._loop = EpochLoop(
      self._placement,
      progress=progress_bar,
      max_nonfinite_steps=None if max_nonfinite_steps is None else int(max_nonfinite_steps),
    )
    store = (
      CheckpointStore(checkpoint_dir, max_to_keep=max_to_keep)
      if checkpoint_dir is not None
      else None
    )
    self._checkpoints = Checkpoints(store, run_config, model_builder)

  # Kept by the placement part: the model, its trained state, the step and its settings. A
  # setting of the step takes effect by rebuilding the step; the optimizer and the mesh cannot
  # change under a state made for them.
  model = Part("_placement", fixed=f"{DERIVED}; {STATE}")
  params = Part("_placement", fixed=STATE)
  rest = Part("_placement", fixed=STATE)
  opt_state = Part("_placement", fixed=STATE)
  lr_scale = Part("_placement")
  lr = Part("_placement", fixed=DERIVED)
  steps = Part("_placement", fixed=DERIVED)
  num_devices = Part("_placement", fixed=DERIVED)
  reduction_indices = Part("_placement", fixed=DERIVED)
  tx = Part(
    "_placement",
    fixed="the optimizer state was made by it; build a new Trainer with the new transform",
  )
  loss_fn = Part("_placement", then="rebuild_step")
  flip_tta = Part("_placement", then="rebuild_step")
  donate = Part("_placement", then="rebuild_step")
  skip_nonfinite = Part("_placement", then="rebuild_step")
  mesh = Part("_placement", fixed=PLACED)
  sync_batchnorm = Part("_placement", fixed=PLACED)
  # Kept by the batch-growth part.
  batch_size = Part(
    "_batches", fixed="it is the loader's; Trainer.set_batch_size changes it from the next epoch"
  )
  reference_batch_size = Part("_batches")
  # Kept by the epoch loop (read at every epoch).
  progress = Part("_loop")
  max_nonfinite_steps = Part("_loop")
  # Kept by the checkpoint part.
  store = Part("_checkpoints", fixed=NEW_TRAINER)
  run_config = Part("_checkpoints", fixed=NEW_TRAINER)
  model_builder = Part("_checkpoints")

  def replace(self, model: nnx.Module | None = None, opt_state: Any | None = None) -> None:
    """Install a new model and/or optimizer state (e.g. after PruneTrain reconfiguration).

    A model with new shapes gets newly jitted steps. If only ``model`` is given the
    optimizer state must still match its params (same structure and shapes).
    """
    self._placement.replace(model, opt_state)

  def set_batch_size(self, batch_size: int, *, scale_lr: bool = True) -> None:
    """Change the training batch size from the next epoch on (PruneTrain §4.3).

    With ``scale_lr`` the LR multiplier grows by ``new / old`` (linear scaling rule).
    Schedules set in epochs (the LR's milestones, ClickTrain's stages) advance by the
    run's first batches per epoch over the loader's batches per epoch at the new size, and
    start each epoch on its boundary, so they keep to the trainer's epochs.
    """
    self._batches.set_batch_size(batch_size, scale_lr=scale_lr)

  def step_memory(
    self, batch_size: int, image_shape: tuple[int, ...], **kwargs: Any
  ) -> dict[str, int]:
    """XLA memory statistics of the compiled train step at ``batch_size`` (bytes).

    Memoised per model/optimizer shapes, since each analysis compiles the step."""
    return self._batches.step_memory(batch_size, image_shape, **kwargs)

  def train_epoch(self, loader: Iterable) -> dict[str, float]:
    """One pass over ``loader``; returns train loss / acc and throughput.

    Steps with a non-finite loss or gradient are skipped: params, optimizer state and
    BatchNorm's running statistics stay as they were (unless ``skip_nonfinite=False``, which
    applies their updates), they are left out of ``train_loss`` / ``train_acc`` and counted in
    ``nonfinite_steps``, with a ``RuntimeWarning`` that says when class ids outside the model's
    outputs were the cause (see :class:`~jaxprune.train.Metrics`). A batch whose images hold
    NaN / Inf is named in a ``RuntimeWarning`` too (once per trainer), and so are integer
    images (unnormalised pixels, a ``UserWarning``).

    Raises:
      ValueError: the loader yielded no batches, the images' channel count is not the
        model's (both named), or the labels' shape or dtype do not fit the batch (named).
      NonFiniteError: ``max_nonfinite_steps`` consecutive steps (counted across epochs) were
        not finite; raised at the end of the epoch in which the run reached the limit, naming
        the run's first batch.
    """
    due = [c for c in self.callbacks if c.every_steps]

    def step_done() -> None:
      self.step += 1
      for c in due:
        if self.step % c.every_steps == 0:
          c.on_step(self, self.step)

    loader = _loaders.LoaderView.of(loader)
    self._batches.record_batch_size(loader)
    return self._loop.train_epoch(
      loader, epoch=self.epoch + 1, step_done=step_done, per_step=bool(due)
    )

  def evaluate(self, loader: Iterable, *, params: Any = None, rest: Any = None) -> dict[str, float]:
    """Loss and accuracy over ``loader`` in eval mode.

    Eval mode uses BatchNorm's running statistics and no dropout, with flip TTA if enabled;
    short batches are zero-padded and masked.

    Args:
      loader: evaluation batches ``(images, labels)``.
      params: parameters to evaluate in place of the trained ones (the structure of
        :attr:`params`, e.g. a masked copy); the trainer's own state is not touched.
      rest: the model's other variables (BatchNorm statistics, ...) to evaluate with, in
        place of the trained ones (the structure of :attr:`rest`).

    Returns:
      ``{"test_loss": ..., "test_acc": ...}``.
    """
    return self._loop.evaluate(loader, params, rest)

  def save_checkpoint(self, loader: Any = None) -> None:
    """Write a checkpoint of the current state (no-op without ``checkpoint_dir``).

    Raises:
      ValueError: if ``checkpoint_dir`` holds another run's checkpoints (this trainer
        neither restored from it nor cleared it with ``fit(overwrite=True)``).
    """
    if self.store is None:
      return
    placement = self._placement
    arrays = {"params": placement.params, "rest": placement.rest, "opt_state": placement.opt_state}
    meta = {
      "epoch": self.epoch,
      "step": self.step,
      "batch_size": _loaders.batch_size(loader),
      **self._batches.state_dict(),
      "loader_state": _loaders.position(loader) if loader is not None else None,
      "model_spec": model_spec(placement.module),
      "surgery_plans": [p.to_json() for p in applied_plans(placement.module)],
      "callbacks": [c.state_dict() for c in self.callbacks],
      "elapsed_s": self._elapsed_before,
      "history": self.history,
    }
    self._checkpoints.save(placement.module, self.epoch, arrays, meta)

  def restore_checkpoint(self, loader: Any = None, step: int | None = None) -> bool:
    """Restore the latest (or given) checkpoint; returns False if there is none.

    A damaged latest checkpoint (files truncated or missing) is renamed to
    ``<step>.damaged`` with a ``UserWarning`` naming it, and the newest intact one is
    restored instead.

    Raises:
      DamagedCheckpointError: if the given ``step`` is damaged, or every checkpoint is (the
        message names each one's step and path).
      ValueError: if the checkpoint belongs to a differently configured run (its stored
        ``run_config`` and this trainer's, both named) or to a run that started from another
        model (class, width spec or parameter paths and shapes, both named), or does not fit
        the model.
    """

    def install(model: nnx.Module, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
      nnx.update(model, arrays["params"], arrays["rest"])
      self._placement.set_model(model, arrays["opt_state"])
      self.epoch, self.step = int(meta["epoch"]), int(meta["step"])
      self._batches.load_state_dict(meta)
      self.history = list(meta.get("history", []))
      self._elapsed_before = float(meta.get("elapsed_s", 0.0))
      for c, state in zip(self.callbacks, meta.get("callbacks", [])):
        c.load_state_dict(state)
      if loader is not None:
        view = _loaders.LoaderView.of(loader)
        if meta.get("batch_size") is not None and view.batch_size is not None:
          view.set_batch_size(int(meta["batch_size"]))
        if meta.get("loader_state") is not None:
          view.restore(meta["loader_state"])

    return self._checkpoints.restore(self._placement.module, self.tx, install, step)

  def close(self) -> None:
    """Lets ``checkpoint_dir`` go, so that another trainer may train on it.

    A live trainer holds its ``checkpoint_dir`` from its first ``fit`` (or restore) until
    this, until it is garbage collected, or until its process ends; another trainer that
    fits on the folder meanwhile is refused (``ValueError`` naming the folder). The trainer
    stays readable, and its next ``fit`` takes the folder again.
    """
    self._checkpoints.release()

  def _stop_early(self, train_loader: Iterable, test_loader: Iterable | None, epochs: int) -> None:
    """``fit`` stops at ``max_seconds``: the last record gets its evaluation if it had none,
    a checkpoint is saved, and a warning says where the run stands."""
    if self.history and test_loader is not None and "test_acc" not in self.history[-1]:
      t0 = time.perf_counter()
      self.history[-1].update(self.evaluate(test_loader))
      self.history[-1]["eval_time_s"] = time.perf_counter() - t0
      _run_log.rewrite(self.log_path, self.history)
    if self.store is not None and self.store.latest_step() != self.epoch:
      self.save_checkpoint(train_loader)  # (checkpoint_every may have saved this epoch)
    where = (
      f"; checkpoint in {self.store.directory}"
      if self.store is not None
      else " (no checkpoint_dir: nothing saved)"
    )
    warnings.warn(
      f"fit stopped after epoch {self.epoch} of {epochs}: {self.stopped_early}{where}; fit "
      "again with resume=True to continue",
      RuntimeWarning,
      stacklevel=3,
    )

  def fit(
    self,
    train_loader: Iterable,
    test_loader: Iterable | None = None,
    epochs: int = 1,
    *,
    resume: bool = True,
    overwrite: bool = False,
    max_seconds: float | None = None,
    must_finish: bool = False,
  ) -> list[dict[str, Any]]:
    """Train until ``epochs`` epochs are complete (resuming from the latest checkpoint).

    A fresh start (``resume=False``) owns ``checkpoint_dir``: if the folder holds
    checkpoints this trainer did not write or restore, ``fit`` refuses before training
    unless ``overwrite=True``, which deletes them first. (A trainer that already trained or
    restored may call ``fit(resume=False)`` again to go on with its own run.)

    Args:
      train_loader: training batches ``(images, labels)``.
      test_loader: optional evaluation batches, evaluated after each epoch.
      epochs: total number of epochs of the run (not the number still to train).
      resume: restore the latest checkpoint of ``checkpoint_dir`` first.
      overwrite: with ``resume=False``, delete the checkpoints already in
        ``checkpoint_dir`` instead of refusing to start.
      max_seconds: a time box for this call. Before each epoch (after the first) the trainer
        estimates its end from the last epoch's cost (training, hooks, and the evaluation if
        the next epoch is evaluated); when it would end past ``max_seconds`` after the call
        began, it stops: the last trained epoch is evaluated and logged, a checkpoint is
        saved, :attr:`stopped_early` says why, and a ``RuntimeWarning`` says how far it got.
        The same ``fit`` again (``resume=True``) continues exactly.
      must_finish: with ``max_seconds``, stop as soon as the estimate says the *remaining*
        epochs cannot all end inside it (from the second epoch of the call on: the first
        also compiles), instead of training as many as fit: for a time window whose partial
        result would be lost.

    If the run is already past ``epochs`` (e.g. a checkpoint at epoch 3 and ``epochs=2``),
    nothing is trained, a ``UserWarning`` says so and the whole history is returned.

    Returns:
      The per-epoch records (also written as JSON lines to ``log_path``).

    Raises:
      ValueError: if ``epochs`` is not a positive int, ``max_seconds`` not positive,
        ``must_finish`` without ``max_seconds``, if ``overwrite`` is given with
        ``resume=True``, if a fresh start finds another run's checkpoints in
        ``checkpoint_dir`` and ``overwrite`` is False, a batch's labels do not fit it, or
        ``train_loader`` is not an iterable of batches.
      NonFiniteError: ``max_nonfinite_steps`` consecutive train steps were not finite (see
        :meth:`train_epoch`).
    """
    _fit_checks.check_arguments(epochs, resume, overwrite, max_seconds, must_finish)
    train_loader = _loaders.LoaderView(train_loader)  # read once; the hooks get the loader
    self._start_fit(train_loader, epochs, resume=resume, overwrite=overwrite)
    fit_start = time.perf_counter() - self._elapsed_before
    box = TimeBox(max_seconds, must_finish, self.eval_every, epochs)
    first = True
    while self.epoch < epochs:
      self.stopped_early = box.stop_reason(self.epoch)
      if self.stopped_early is not None:
        self._stop_early(train_loader, test_loader, epochs)
        break
      epoch_start = time.perf_counter()
      record = self._train_one_epoch(train_loader)
      eval_s = self._evaluate_epoch(record, test_loader, box)
      self._end_epoch(record, train_loader, epochs, fit_start)
      if self.epoch_lines:
        seconds = time.perf_counter() - epoch_start
        print(_run_log.epoch_line(record, epochs, seconds, compiles=first), flush=True)
      box.epoch_done(time.perf_counter() - epoch_start, eval_s)
      first = False
    # The step donates its buffers, so the module the caller passed in would otherwise
    # point at deleted arrays after fit; sync it (a reconfigured run syncs its new model).
    _ = self.model
    return self.history

  def _start_fit(self, train_loader: Iterable, epochs: int, *, resume: bool, overwrite: bool):
    """``fit``'s start: resume, claim ``checkpoint_dir``, take the reference batch size,
    check the loader against the optimizer, run the hooks' ``on_fit_start``."""
    self.stopped_early = None
    if resume:
      self.restore_checkpoint(train_loader)
    self._checkpoints.claim(self._placement.module, overwrite)
    if self.epoch > epochs:
      # ``epochs`` is the run's total, so nothing is trained; say so rather than hand back
      # more epochs than were asked for without a word.
      where = f" (restored from {self.store.directory})" if self.store is not None else ""
      warnings.warn(
        f"fit(epochs={epochs}): the run is already at epoch {self.epoch}{where}, past the "
        f"requested epochs; nothing is trained and the history holds {self.epoch} epochs",
        stacklevel=3,
      )
    # Before the hooks, which may need the reference batch size to count the epochs.
    self._batches.start_fit(train_loader)
    self.train_loader = train_loader.loader
    _fit_checks.warn_epoch_length(self.opt_state, train_loader, self.reference_batch_size)
    for c in self.callbacks:
      c.on_fit_start(self)
    _run_log.rewrite(self.log_path, self.history)

  def _train_one_epoch(self, train_loader: _loaders.LoaderView) -> dict[str, Any]:
    """Trains the next epoch (a requested batch size applied first) and runs the hooks'
    ``on_train_epoch_end``; returns the epoch's record so far."""
    self._batches.start_epoch(train_loader, self.epoch)
    train_loader.set_epoch(self.epoch)
    record: dict[str, Any] = {"epoch": self.epoch + 1}
    lr_before = self.lr
    record.update(self.train_epoch(train_loader))
    # Pruned weights found non-zero: something chained after the masking re-filled them.
    self._refill_check(self.opt_state, self.params)
    self.epoch += 1
    record["lr"] = self.lr if self.lr is not None else lr_before
    record["lr_scale"] = self.lr_scale
    record["batch_size"] = train_loader.batch_size
    for c in self.callbacks:
      c.on_train_epoch_end(self, self.epoch, train_loader.loader)
    return record

  def _evaluate_epoch(
    self, record: dict[str, Any], test_loader: Iterable | None, box: TimeBox
  ) -> float:
    """Evaluates the epoch when it is due (its entries into ``record``); returns the
    evaluation's seconds (0 when not evaluated)."""
    if test_loader is None or not box.evaluates(self.epoch):
      return 0.0
    t0 = time.perf_counter()
    record.update(self.evaluate(test_loader))
    record["eval_time_s"] = time.perf_counter() - t0
    return record["eval_time_s"]

  def _end_epoch(
    self, record: dict[str, Any], train_loader: Iterable, epochs: int, fit_start: float
  ) -> None:
    """The epoch's hooks and metrics into ``record``, then the record logged, the checkpoint
    written when due, and the hooks' ``after_epoch``."""
    for c in self.callbacks:
      extra = c.on_epoch_end(self, self.epoch)
      if extra:
        record.update(extra)
    for name, fn in self.metrics.items():
      value = fn(self)
      record[name] = value.item() if hasattr(value, "item") else value
    self._elapsed_before = time.perf_counter() - fit_start
    record["wall_time_s"] = self._elapsed_before
    record["step"] = self.step
    self.history.append(record)
    _run_log.append(self.log_path, record)
    saved = self.checkpoint_every and self.epoch % self.checkpoint_every == 0
    if saved or self.epoch == epochs:
      self.save_checkpoint(train_loader)
    for c in self.callbacks:
      c.after_epoch(self, record)


def fit(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  train_loader: Iterable,
  test_loader: Iterable | None = None,
  epochs: int = 1,
  **trainer_kwargs: Any,
) -> Trainer:
  """Build a :class:`Trainer` and run :meth:`Trainer.fit`; returns the trainer.

  The trainer holds ``trainer.model`` and ``trainer.history``.

  Example:
    >>> trainer = fit(model, sgd(0.05, 0.9), train_loader, test_loader, epochs=5)  # doctest: +SKIP
  """
  trainer = Trainer(model, tx, **trainer_kwargs)
  trainer.fit(train_loader, test_loader, epochs)
  return trainer
