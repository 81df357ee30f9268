"""The training loop: ``Trainer`` and ``fit``.

The trainer owns a split NNX model (``params`` / ``rest`` pure-array states and the
graphdefs) and a raw Optax state, runs the jitted step of ``jaxprune.train.step``,
evaluates, logs one JSON line per epoch, checkpoints with orbax and resumes exactly.

Host-side callbacks run at epoch end (and optionally every ``k`` steps). They may

* replace the model and optimizer state (PruneTrain §3.3 reconfiguration: the new
  shapes get a freshly traced step automatically),
* change the loader's batch size and scale the LR (PruneTrain §4.3 dynamic
  mini-batch with linear LR scaling), see :meth:`Trainer.set_batch_size`,
* return extra metrics for the epoch's JSON line (e.g. a compression ratio).

Exact resume needs (a) a loader whose order depends only on ``(seed, epoch)`` —
the trainer calls ``loader.set_epoch(epoch)`` before each epoch when the loader has it,
and saves ``loader.state()`` (``jaxprune.data.Loader``) or ``loader.state_dict()`` — and (b) every random stream of the
model inside its NNX state (``nnx.Rngs``), which the checkpoint stores.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxprune import distributed, masking, models
from jaxprune.train import data_parallel, optim
from jaxprune.train._spec_json import decode_spec, encode_spec
from jaxprune.train.checkpoint import CheckpointStore, DamagedCheckpointError
from jaxprune.train.step import (
  Metrics,
  PerExampleLoss,
  StepFunctions,
  default_loss,
  split_model,
  step_functions,
  train_step_memory,
)


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


def _is_tty() -> bool:
  return hasattr(sys.stderr, "isatty") and sys.stderr.isatty()


def _model_spec(model: nnx.Module) -> Any:
  """JSON form of ``model.spec`` (``None`` if the model has none or it is not encodable)."""
  spec = getattr(model, "spec", None)
  if spec is None:
    return None
  try:
    return json.loads(json.dumps(encode_spec(spec)))
  except (TypeError, ValueError):
    return None


def _loader_batch_size(loader: Any) -> int | None:
  size = getattr(loader, "batch_size", None)
  return int(size) if size is not None else None


def _loader_state(loader: Any) -> Any:
  """Position of a loader: ``jaxprune.data.Loader.state()`` or a ``state_dict()``."""
  for name in ("state", "state_dict"):
    method = getattr(loader, name, None)
    if callable(method):
      return method()
  return None


def _restore_loader(loader: Any, state: Any) -> None:
  for name in ("restore", "load_state_dict"):
    method = getattr(loader, name, None)
    if callable(method):
      method(state)
      return


def _set_loader_batch_size(loader: Any, batch_size: int) -> None:
  if hasattr(loader, "set_batch_size"):
    loader.set_batch_size(batch_size)
  else:
    loader.batch_size = batch_size


def _check_run_config(
  saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None, directory: Any
) -> None:
  """Refuse to resume a checkpoint written by a differently configured run."""
  if saved is None or current is None or saved == current:
    return
  keys = sorted(set(saved) | set(current))
  diff = [
    f"{k}: checkpoint {saved.get(k, '<absent>')!r} vs now {current.get(k, '<absent>')!r}"
    for k in keys
    if saved.get(k, "<absent>") != current.get(k, "<absent>")
  ]
  raise ValueError(
    f"run_config differs from the one stored in the checkpoints of {directory} "
    f"({'; '.join(diff)}): use another checkpoint_dir or delete it"
  )


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
      checkpoints unless ``overwrite=True`` (see :meth:`fit`).
    checkpoint_every: checkpoint every this many epochs (and after the last one).
    max_to_keep: number of checkpoints kept.
    progress: show a tqdm bar; ``None`` = only when stderr is a terminal.
    model_builder: ``spec -> model`` used on resume when the checkpoint's
      ``model.spec`` differs from the current model's (a reconfigured model); default
      :func:`jaxprune.models.rebuild` (same class and classes, conversions re-applied).
    donate: donate state buffers to the jitted step.
    run_config: JSON-serialisable description of the run (epochs, schedule, seed, ...)
      stored with every checkpoint. Resuming from a checkpoint written with a different
      ``run_config`` raises ``ValueError`` instead of silently continuing another run
      (e.g. a 10-epoch schedule on top of a 3-epoch one).
    mesh: data parallelism (:mod:`jaxprune.train.data_parallel`). ``None`` (default): one
      device, the plain jitted step. ``"auto"``: every device (``jax.devices()``, all
      processes after ``jax.distributed.initialize``) on a mesh axis ``"batch"``. A
      ``jax.sharding.Mesh`` with a ``"batch"`` axis: that mesh. The loader's batch is then
      the global batch (on several processes, each process's loader yields its local part
      of it), split evenly over the devices; params and optimizer state are replicated and
      the gradients averaged explicitly in the step — sparsely, over the kept entries only,
      once the optimizer state holds final masks (:func:`jaxprune.masking.find_masks`, e.g.
      after ClickTrain's hard prune; checked at every epoch start, so also on resume).
      A batch not divisible by the devices raises ``ValueError``.
    sync_batchnorm: with a mesh, normalise with the global batch's BatchNorm statistics
      (moments averaged over the devices inside each BatchNorm). Default ``False``: each
      device uses its shard's statistics (as PyTorch data parallelism without
      SyncBatchNorm) and the running statistics are averaged over the devices after each
      step. Evaluation always uses those (replicated) running statistics.

  Example:
    >>> trainer = Trainer(model, sgd(0.1, 0.9, weight_decay=5e-4), label_smoothing=0.1)  # doctest: +SKIP
    >>> history = trainer.fit(train_loader, test_loader, epochs=10)  # doctest: +SKIP

    Data parallel over every device (each loader batch split evenly over them)::

    >>> trainer = Trainer(model, tx, mesh="auto")  # doctest: +SKIP
    >>> trainer.num_devices  # doctest: +SKIP
    4

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
    callbacks: Sequence[Callback | Callable[["Trainer", int], Any]] = (),
    metrics: Mapping[str, Callable[["Trainer"], Any]] | None = None,
    log_path: str | os.PathLike | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    checkpoint_every: int = 1,
    max_to_keep: int | None = 2,
    progress: bool | None = None,
    model_builder: Callable[[Any], nnx.Module] | None = None,
    donate: bool = True,
    run_config: Mapping[str, Any] | None = None,
    mesh: Any = None,
    sync_batchnorm: bool = False,
  ):
    if not 0.0 <= label_smoothing < 1.0:
      raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    if checkpoint_every < 1:
      raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    self.tx = optax.with_extra_args_support(tx)
    self.loss_fn = loss_fn if loss_fn is not None else default_loss(label_smoothing)
    self.flip_tta = flip_tta
    self.callbacks: list[Callback] = [
      c if isinstance(c, Callback) else _FunctionCallback(c) for c in callbacks
    ]
    for c in self.callbacks:
      if c.every_steps is not None and c.every_steps < 1:
        raise ValueError(f"callbacks: every_steps must be >= 1, got {c.every_steps}")
    self.metrics = dict(metrics or {})
    self.log_path = os.fspath(log_path) if log_path is not None else None
    self.checkpoint_every = checkpoint_every
    self.store = (
      CheckpointStore(checkpoint_dir, max_to_keep=max_to_keep)
      if checkpoint_dir is not None
      else None
    )
    self.progress = _is_tty() if progress is None else progress
    self.model_builder = model_builder
    self.donate = donate
    self.mesh = data_parallel.resolve_mesh(mesh)
    if sync_batchnorm and self.mesh is None:
      raise ValueError("sync_batchnorm=True needs a mesh (data parallelism)")
    self.sync_batchnorm = bool(sync_batchnorm)
    # Round-trip through JSON so the comparison on resume sees what the checkpoint stores
    # (tuples become lists); unserialisable values fail here, not at the first save.
    try:
      self.run_config = json.loads(json.dumps(dict(run_config))) if run_config else None
    except TypeError as e:
      raise ValueError(f"run_config must be JSON-serialisable: {e}") from None

    self.epoch = 0  # completed epochs
    self.step = 0  # completed optimizer steps
    self.history: list[dict[str, Any]] = []
    self.reference_batch_size: int | None = None
    self.batch_size: int | None = None  # the training loader's batch size this epoch
    self._pending_batch_size: tuple[int, bool] | None = None
    self._elapsed_before = 0.0
    self._memory_cache: dict[Any, dict[str, int]] = {}
    self._refill_check = masking.RefillCheck()  # pruned weights re-filled at an epoch end
    # True once checkpoint_dir holds only this run's checkpoints (restored from it, found it
    # empty, or cleared it with fit(overwrite=True)): only then may save_checkpoint write there.
    self._owns_store = False
    self._set_model(model, self.tx.init(nnx.as_pure(nnx.state(model, nnx.Param))))

  # ----------------------------------------------------------------- state access
  def _set_model(self, model: nnx.Module, opt_state: Any, indices: Any = None) -> None:
    self._model = model
    train_gd, eval_gd, params, rest = split_model(model)
    self.params, self.rest, self.opt_state = params, rest, opt_state
    self._model_synced = True
    if self.mesh is None:
      self._steps = step_functions(
        train_gd, eval_gd, self.tx, self.loss_fn, flip_tta=self.flip_tta, donate=self.donate
      )
      return
    # A new structure (PruneTrain's reconfiguration) or new masks: a new step, compiled at
    # its first call, and the (new) states replicated on every device.
    self._steps = data_parallel.step_functions(
      model,
      self.tx,
      self.loss_fn,
      self.mesh,
      sync_batchnorm=self.sync_batchnorm,
      flip_tta=self.flip_tta,
      donate=self.donate,
      indices=indices,
    )
    self._replicate()

  def _replicate(self) -> None:
    """Places params, rest and optimizer state on every device of the mesh (host-side edits
    between epochs, e.g. an LR scale, may have left some leaves on one device)."""
    self.params, self.rest, self.opt_state = self._steps.replicate(
      (self.params, self.rest, self.opt_state)
    )

  def _sync_reduction(self) -> None:
    """Data parallelism: reduce only the kept gradient entries once the optimizer state
    holds final masks (ClickTrain §5.3); index arrays built once per set of masks, the step
    rebuilt (and recompiled) only when they change."""
    masks = masking.find_masks(self.opt_state, self.params)
    indices = distributed.mask_indices(masks) if masks is not None else None
    if data_parallel.indices_digest(indices) != self._steps.indices_digest:
      self._set_model(self.model, self.opt_state, indices)

  @property
  def num_devices(self) -> int:
    """Devices the global batch is split over (1 without a mesh)."""
    return 1 if self.mesh is None else int(self.mesh.shape[data_parallel.BATCH_AXIS])

  @property
  def reduction_indices(self) -> Any:
    """The index arrays of the data-parallel gradient reduction (``None``: dense, or no
    mesh)."""
    return getattr(self._steps, "indices", None)

  @property
  def model(self) -> nnx.Module:
    """The live model (its variables are synced from the trained state on access)."""
    if not self._model_synced:
      nnx.update(self._model, self.params, self.rest)
      self._model_synced = True
    return self._model

  @property
  def steps(self) -> StepFunctions:
    """The jitted train / eval functions for the current model structure."""
    return self._steps

  def replace(self, model: nnx.Module | None = None, opt_state: Any | None = None) -> None:
    """Install a new model and/or optimizer state (e.g. after PruneTrain reconfiguration).

    A model with new shapes gets newly jitted steps. If only ``model`` is given the
    optimizer state must still match its params (same structure and shapes).
    """
    model = self.model if model is None else model
    opt_state = self.opt_state if opt_state is None else opt_state
    expected, expected_def = jax.tree.flatten(
      jax.eval_shape(self.tx.init, nnx.as_pure(nnx.state(model, nnx.Param)))
    )
    got, got_def = jax.tree.flatten(opt_state)
    if expected_def != got_def or [e.shape for e in expected] != [np.shape(g) for g in got]:
      raise ValueError("opt_state: structure or shapes do not match tx.init(model params)")
    self._set_model(model, opt_state)

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
    old_size = _loader_batch_size(loader)
    if old_size is None:
      raise ValueError("train_loader has no batch_size attribute; cannot change it")
    _set_loader_batch_size(loader, new_size)
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

  # ----------------------------------------------------------------- train / eval
  def train_epoch(self, loader: Iterable) -> dict[str, float]:
    """One pass over ``loader``; returns train loss / acc and throughput.

    Steps with a non-finite loss are left out of ``train_loss`` / ``train_acc`` and counted
    in ``nonfinite_steps``, with a ``RuntimeWarning`` (see :class:`~jaxprune.train.Metrics`).
    """
    metrics = Metrics.zeros()
    if self.mesh is not None:
      self._sync_reduction()
      self._replicate()
      metrics = self._steps.replicate(metrics)
    due = [c for c in self.callbacks if c.every_steps]
    try:
      total = len(loader)  # type: ignore[arg-type]
    except TypeError:
      total = None
    bar = None
    if self.progress:
      from tqdm.auto import tqdm

      bar = tqdm(total=total, desc=f"epoch {self.epoch + 1}", leave=False, dynamic_ncols=True)
    images_seen, data_wait, steps = 0, 0.0, 0
    start = time.perf_counter()
    # CPU seconds of the whole process (XLA's threads, the loader's): unlike wall time, not
    # inflated when a shared host takes the cores away (steal time).
    cpu_start = time.process_time()
    iterator = iter(loader)
    while True:
      t0 = time.perf_counter()
      try:
        images, labels = next(iterator)
      except StopIteration:
        break
      data_wait += time.perf_counter() - t0
      self.params, self.rest, self.opt_state, metrics = self._steps.train(
        self.params, self.rest, self.opt_state, metrics, images, labels
      )
      self._model_synced = False
      self.step += 1
      steps += 1
      images_seen += int(np.shape(images)[0])
      for c in due:
        if self.step % c.every_steps == 0:
          c.on_step(self, self.step)
      if bar is not None:
        bar.update(1)
        if steps % 20 == 0:
          bar.set_postfix(loss=f"{float(metrics.loss_sum / metrics.count):.4f}")
    summary = metrics.summary()  # blocks until the last step finished
    elapsed = time.perf_counter() - start
    cpu_time = time.process_time() - cpu_start
    if bar is not None:
      bar.close()
    if steps == 0:
      raise ValueError(
        "train_loader yielded no batches (batch_size larger than the dataset with drop_last=True?)"
      )
    if summary["nonfinite"]:
      warnings.warn(
        f"epoch {self.epoch + 1}: {summary['nonfinite']} of {steps} train steps had a "
        "non-finite loss; train_loss / train_acc average the other steps and the record's "
        "nonfinite_steps counts them (whether their updates were applied is up to the "
        "optimizer, e.g. optax.apply_if_finite skips them)",
        RuntimeWarning,
        stacklevel=3,
      )
    compute = max(elapsed - data_wait, 1e-9)
    return {
      "train_loss": summary["loss"],
      "train_acc": summary["acc"],
      "nonfinite_steps": summary["nonfinite"],
      "steps": steps,
      "images_per_s": images_seen / elapsed,
      "step_images_per_s": images_seen / compute,
      "data_wait_s": data_wait,
      "epoch_time_s": elapsed,
      "cpu_time_s": cpu_time,
    }

  def evaluate(self, loader: Iterable) -> dict[str, float]:
    """Loss and accuracy over ``loader`` in eval mode (BatchNorm running statistics,
    no dropout), with flip TTA if enabled. Short batches are zero-padded and masked."""
    metrics = Metrics.zeros()
    multiple = 1
    if self.mesh is not None:
      self._replicate()
      metrics = self._steps.replicate(metrics)
      multiple = self._steps.batch_multiple
    full = None
    for images, labels in loader:
      images, labels = np.asarray(images), np.asarray(labels)
      n = images.shape[0]
      # Data parallel: padded up to a multiple of the devices too (padding rows weigh 0).
      full = max(full or 0, -(-n // multiple) * multiple)
      weights = np.ones(full, np.float32)
      if n < full:
        pad = full - n
        images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
        labels = np.concatenate([labels, np.zeros((pad, *labels.shape[1:]), labels.dtype)])
        weights[n:] = 0
      metrics = self._steps.evaluate(self.params, self.rest, metrics, images, labels, weights)
    if full is None:
      raise ValueError("test_loader yielded no batches")
    summary = metrics.summary()
    return {"test_loss": summary["loss"], "test_acc": summary["acc"]}

  # ----------------------------------------------------------------- checkpoints
  def _meta(self, loader: Any) -> dict[str, Any]:
    loader_state = _loader_state(loader) if loader is not None else None
    return {
      "epoch": self.epoch,
      "step": self.step,
      "batch_size": _loader_batch_size(loader),
      "reference_batch_size": self.reference_batch_size,
      # A batch change requested by an epoch-end hook applies at the next epoch.
      "pending_batch_size": (list(self._pending_batch_size) if self._pending_batch_size else None),
      "loader_state": loader_state,
      "model_spec": _model_spec(self._model),
      "callbacks": [c.state_dict() for c in self.callbacks],
      "elapsed_s": self._elapsed_before,
      "history": self.history,
      "run_config": self.run_config,
    }

  def _claim_store(self, overwrite: bool) -> None:
    """Make ``checkpoint_dir`` this run's own before anything is written into it.

    Checkpoints are numbered by epoch and ``fit`` resumes the highest number, so a fresh run
    writing next to another run's checkpoints would leave the other run's later epochs as
    "latest" and a resume would silently continue the wrong run.
    """
    if self.store is None or self._owns_store:
      return
    steps = self.store.all_steps()
    if steps and not overwrite:
      raise ValueError(
        f"checkpoint_dir {self.store.directory} already holds the checkpoints {steps} of "
        "another run: resume it (fit(resume=True)), pass overwrite=True to delete them, or "
        "use another checkpoint_dir"
      )
    if steps:
      self.store.clear()
    self._owns_store = True

  def save_checkpoint(self, loader: Any = None) -> None:
    """Write a checkpoint of the current state (no-op without ``checkpoint_dir``).

    Raises:
      ValueError: if ``checkpoint_dir`` holds another run's checkpoints (this trainer
        neither restored from it nor cleared it with ``fit(overwrite=True)``).
    """
    if self.store is None:
      return
    self._claim_store(overwrite=False)
    arrays = {"params": self.params, "rest": self.rest, "opt_state": self.opt_state}
    self.store.save(self.epoch, arrays, self._meta(loader))

  def _rebuild_model(self, spec: Any) -> nnx.Module:
    if self.model_builder is not None:
      return self.model_builder(spec)
    if getattr(self._model, "num_classes", None) is None:
      raise ValueError(
        "checkpoint: model spec differs from the current model's and no "
        "model_builder was given to rebuild it"
      )
    # The checkpoint restores every variable, conversion state (e.g. SDGP keys) included.
    return models.rebuild(self._model, spec)

  def restore_checkpoint(self, loader: Any = None, step: int | None = None) -> bool:
    """Restore the latest (or given) checkpoint; returns False if there is none.

    A damaged latest checkpoint (files truncated or missing) is renamed to
    ``<step>.damaged`` with a ``UserWarning`` naming it, and the newest intact one is
    restored instead.

    Raises:
      DamagedCheckpointError: if the given ``step`` is damaged, or every checkpoint is (the
        message names each one's step and path).
      ValueError: if the checkpoint belongs to a differently configured run or does not
        fit the model.
    """
    if self.store is None:
      return False
    if step is not None:
      self._restore_step(loader, step)
      return True
    damaged: list[DamagedCheckpointError] = []
    for candidate in reversed(self.store.all_steps()):
      try:
        self._restore_step(loader, candidate)
      except DamagedCheckpointError as e:
        damaged.append(e)
        continue
      for e in damaged:
        # Out of the numbered sequence, so the resumed run can write that epoch again.
        moved = self.store.set_aside(e.step)
        warnings.warn(f"{e}; moved to {moved} and resumed from checkpoint {candidate}")
      return True
    if damaged:
      newest, older = damaged[0], damaged[1:]
      raise DamagedCheckpointError(
        newest.step,
        newest.path,
        f"{newest.reason}; no intact checkpoint to fall back to" + "".join(f"; {e}" for e in older),
      )
    return False

  def _restore_step(self, loader: Any, step: int) -> None:
    # Every read from the store happens before the trainer's state changes, so a damaged
    # checkpoint leaves the trainer as it was.
    meta = self.store.restore_meta(step)
    _check_run_config(meta.get("run_config"), self.run_config, self.store.directory)
    model = self._model
    if meta.get("model_spec") is not None and meta["model_spec"] != _model_spec(model):
      model = self._rebuild_model(decode_spec(meta["model_spec"]))
    _, _, params, rest = split_model(model)
    template = {"params": params, "rest": rest, "opt_state": jax.eval_shape(self.tx.init, params)}
    template["opt_state"] = jax.tree.map(
      lambda s: jnp.zeros(s.shape, s.dtype), template["opt_state"]
    )
    arrays, meta = self.store.restore(step, template)
    nnx.update(model, arrays["params"], arrays["rest"])
    self._set_model(model, arrays["opt_state"])
    self.epoch, self.step = int(meta["epoch"]), int(meta["step"])
    self._owns_store = True  # the restored run goes on in its own folder
    self.reference_batch_size = meta.get("reference_batch_size")
    pending = meta.get("pending_batch_size")
    self._pending_batch_size = (int(pending[0]), bool(pending[1])) if pending else None
    self.history = list(meta.get("history", []))
    self._elapsed_before = float(meta.get("elapsed_s", 0.0))
    for c, state in zip(self.callbacks, meta.get("callbacks", [])):
      c.load_state_dict(state)
    if loader is not None:
      if meta.get("batch_size") is not None and _loader_batch_size(loader) is not None:
        _set_loader_batch_size(loader, int(meta["batch_size"]))
      if meta.get("loader_state") is not None:
        _restore_loader(loader, meta["loader_state"])

  # ----------------------------------------------------------------- logging
  def _rewrite_log(self) -> None:
    if self.log_path is None:
      return
    os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
    tmp = self.log_path + ".tmp"
    with open(tmp, "w") as f:
      for record in self.history:
        f.write(json.dumps(record) + "\n")
    os.replace(tmp, self.log_path)

  def _append_log(self, record: dict[str, Any]) -> None:
    if self.log_path is None:
      return
    with open(self.log_path, "a") as f:
      f.write(json.dumps(record) + "\n")

  # ----------------------------------------------------------------- main loop
  def fit(
    self,
    train_loader: Iterable,
    test_loader: Iterable | None = None,
    epochs: int = 1,
    *,
    resume: bool = True,
    overwrite: bool = False,
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

    If the run is already past ``epochs`` (e.g. a checkpoint at epoch 3 and ``epochs=2``),
    nothing is trained, a ``UserWarning`` says so and the whole history is returned.

    Returns:
      The per-epoch records (also written as JSON lines to ``log_path``).

    Raises:
      ValueError: if ``epochs`` is not a positive int, if ``overwrite`` is given with
        ``resume=True``, or if a fresh start finds another run's checkpoints in
        ``checkpoint_dir`` and ``overwrite`` is False.
    """
    # bool is an int subclass: epochs=True would silently train one epoch.
    if isinstance(epochs, bool) or not isinstance(epochs, (int, np.integer)) or epochs < 1:
      raise ValueError(f"epochs must be a positive int, got {epochs!r}")
    if overwrite and resume:
      raise ValueError("overwrite=True deletes the checkpoints: it needs resume=False")
    if resume:
      self.restore_checkpoint(train_loader)
    self._claim_store(overwrite)
    if self.epoch > epochs:
      # ``epochs`` is the run's total, so nothing is trained; say so rather than hand back
      # more epochs than were asked for without a word.
      where = f" (restored from {self.store.directory})" if self.store is not None else ""
      warnings.warn(
        f"fit(epochs={epochs}): the run is already at epoch {self.epoch}{where}, past the "
        f"requested epochs; nothing is trained and the history holds {self.epoch} epochs",
        stacklevel=2,
      )
    for c in self.callbacks:
      c.on_fit_start(self)
    if self.reference_batch_size is None:
      self.reference_batch_size = _loader_batch_size(train_loader)
    self._rewrite_log()
    fit_start = time.perf_counter() - self._elapsed_before
    while self.epoch < epochs:
      self._apply_pending_batch_size(train_loader)
      self.batch_size = _loader_batch_size(train_loader)
      if hasattr(train_loader, "set_epoch"):
        train_loader.set_epoch(self.epoch)
      record: dict[str, Any] = {"epoch": self.epoch + 1}
      lr_before = self.lr
      record.update(self.train_epoch(train_loader))
      # Pruned weights found non-zero: something chained after the masking re-filled them.
      self._refill_check(self.opt_state, self.params)
      self.epoch += 1
      record["lr"] = self.lr if self.lr is not None else lr_before
      record["lr_scale"] = self.lr_scale
      record["batch_size"] = _loader_batch_size(train_loader)
      for c in self.callbacks:
        c.on_train_epoch_end(self, self.epoch, train_loader)
      if test_loader is not None:
        t0 = time.perf_counter()
        record.update(self.evaluate(test_loader))
        record["eval_time_s"] = time.perf_counter() - t0
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
      self._append_log(record)
      if self.epoch % self.checkpoint_every == 0 or self.epoch == epochs:
        self.save_checkpoint(train_loader)
      for c in self.callbacks:
        c.after_epoch(self, record)
    # The step donates its buffers, so the module the caller passed in would otherwise
    # point at deleted arrays after fit; sync it (a reconfigured run syncs its new model).
    _ = self.model
    return self.history


def fit(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  train_loader: Iterable,
  test_loader: Iterable | None = None,
  epochs: int = 1,
  **trainer_kwargs: Any,
) -> Trainer:
  """Build a :class:`Trainer` and run :meth:`Trainer.fit`; returns the trainer
  (``trainer.model``, ``trainer.history``).

  Example:
    >>> trainer = fit(model, sgd(0.05, 0.9), train_loader, test_loader, epochs=5)  # doctest: +SKIP
  """
  trainer = Trainer(model, tx, **trainer_kwargs)
  trainer.fit(train_loader, test_loader, epochs)
  return trainer
