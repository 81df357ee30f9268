"""One training epoch and one evaluation pass: the step loop, its timing and throughput, the
progress bar, the checks of each batch and of non-finite steps, and padded evaluation; one
part of :class:`~jaxprune.train.Trainer`, held in its ``_loop`` field.

:class:`EpochLoop` writes only its own bookkeeping (which once-per-trainer warnings were
shown, the run of consecutive non-finite steps); the steps change the trained state through
:meth:`~jaxprune.train._placement.Placement.run_step`, and the trainer counts the steps (and
runs the step hooks) in the ``step_done`` it passes to :meth:`EpochLoop.train_epoch`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jaxprune.train import _checks
from jaxprune.train._loaders import FusedLoader, LoaderView, batch_arrays
from jaxprune.train._placement import Placement
from jaxprune.train.step import Metrics

__all__ = ["EpochLoop"]


class EpochLoop:
  """``train_epoch`` and ``evaluate`` over the state and step of ``placement``.

  Args:
    placement: the trainer's model, state and step.
    progress: show a tqdm bar for each epoch.
    max_nonfinite_steps: consecutive non-finite steps that stop training (``None``: never).
  """

  def __init__(self, placement: Placement, *, progress: bool, max_nonfinite_steps: int | None):
    self._placement = placement
    self.progress = progress
    self.max_nonfinite_steps = max_nonfinite_steps
    self._warned_nonfinite_inputs = False  # the non-finite input warning is shown once
    self._warned_integer_images = False  # and so is the integer images one
    # Consecutive non-finite train steps so far and (epoch, step) of the first of them.
    self._nonfinite_run: tuple[int, tuple[int, int]] = (0, (0, 0))

  def train_epoch(
    self, loader: Iterable, *, epoch: int, step_done: Callable[[], None], per_step: bool
  ) -> dict[str, float]:
    """One pass over ``loader``, epoch ``epoch`` (1-based).

    :meth:`Trainer.train_epoch <jaxprune.train.Trainer.train_epoch>` (its record entries, warnings
    and errors). ``step_done()`` runs after each step; ``per_step``: run a
    :class:`~jaxprune.data.DeviceLoader`'s fused steps one at a time (a step hook is due).
    """
    view = LoaderView.of(loader)
    placement = self._placement
    metrics = Metrics.zeros(
      nonfinite_run=self._nonfinite_run[0], max_nonfinite=self.max_nonfinite_steps or 0
    )
    if placement.mesh is not None:
      placement.sync_reduction()
      placement.replicate()
      metrics = placement.steps.replicate(metrics)
    try:
      total = len(view)
    except TypeError:
      total = None
    bar = None
    if self.progress:
      from tqdm.auto import tqdm

      bar = tqdm(total=total, desc=f"epoch {epoch}", leave=False, dynamic_ncols=True)
    images_seen, data_wait, steps = 0, 0.0, 0
    start = time.perf_counter()
    # CPU seconds of the whole process (XLA's threads, the loader's): unlike wall time, not
    # inflated when a shared host takes the cores away (steal time).
    cpu_start = time.process_time()
    if view.fused is not None:
      self._place_data(view)
      runs = self._device_steps(view.fused, metrics, per_step)
    else:
      runs = self._host_steps(view, metrics)
    for metrics, count, batch, wait in runs:
      data_wait += wait
      for _ in range(count):
        steps += 1
        images_seen += batch
        step_done()
      if bar is not None:
        bar.update(count)
        if steps % 20 < count:
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
    self._warn_nonfinite(summary, steps, epoch)
    self._check_nonfinite_run(summary, epoch)
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

  def _host_steps(self, loader: Iterable, metrics: Metrics) -> Iterator:
    """One step per batch of a host loader: yields ``(metrics, 1, batch size, data wait)``."""
    iterator = iter(loader)
    while True:
      t0 = time.perf_counter()
      try:
        images, labels = next(iterator)
      except StopIteration:
        return
      wait = time.perf_counter() - t0
      self._check_batch(images, labels)
      _, images, labels = batch_arrays(images, labels)
      try:
        metrics = self._placement.run_step(self._placement.steps.train, metrics, images, labels)
      except (TypeError, ValueError) as e:  # raised while tracing: nothing was donated
        self._raise_if_wrong_channels(images, e)
        raise
      yield metrics, 1, int(np.shape(images)[0]), wait

  def _device_steps(self, loader: FusedLoader, metrics: Metrics, per_step: bool) -> Iterator:
    """A fused loader's epoch (a :class:`~jaxprune.data.DeviceLoader`'s), several steps per
    call of the fused step (one per call while a callback wants every few steps): yields
    ``(metrics, steps, batch size, data wait)`` per call; its data set is placed already."""
    placement = self._placement
    fused = placement.steps.fused_train(loader.make_batch)
    images_all, labels_all = loader.device_arrays
    for dispatch in loader.dispatches():
      indices, step_ids = dispatch.indices, dispatch.steps
      if per_step:  # step hooks see every step
        chunks = [(indices[i : i + 1], step_ids[i : i + 1]) for i in range(len(step_ids))]
      else:
        chunks = [(indices, step_ids)]
      for chunk, ids in chunks:
        try:
          metrics = placement.run_step(
            fused, metrics, images_all, labels_all, chunk, dispatch.seed, dispatch.epoch, ids
          )
        except (TypeError, ValueError) as e:  # raised while tracing: nothing was donated
          self._raise_if_wrong_channels(np.zeros((1, *images_all.shape[1:])), e)
          raise
        yield metrics, len(ids), chunk.shape[1], 0.0

  def _place_data(self, view: LoaderView) -> None:
    """Puts a :class:`~jaxprune.data.DeviceLoader`'s data set where the step runs (any other
    loader is left alone). Data parallelism: a copy on every device of the mesh (once), each
    device making its shard of every global batch from its own copy. One device: the loader's
    own (it may have served a trainer on a mesh before)."""
    placement = self._placement
    view.place(placement.steps.replicated if placement.mesh is not None else None)

  def evaluate(self, loader: Iterable, params: Any = None, rest: Any = None) -> dict[str, float]:
    """:meth:`Trainer.evaluate <jaxprune.train.Trainer.evaluate>`: loss and accuracy.

    Over ``loader``, of ``params`` / ``rest`` (``None``: the trained ones) in eval mode.
    """
    placement = self._placement
    metrics = Metrics.zeros()
    multiple = 1
    if placement.mesh is not None:
      placement.replicate()
      metrics = placement.steps.replicate(metrics)
      multiple = placement.steps.batch_multiple
    params = placement.params if params is None else params
    rest = placement.rest if rest is None else rest
    if placement.mesh is not None:
      # Arrays from outside may sit on one device; the eval step takes them replicated.
      params, rest = placement.steps.replicate((params, rest))
    view = LoaderView.of(loader, "test_loader")
    self._place_data(view)
    full = None
    for images, labels in view:
      self._check_batch(images, labels)
      # Device arrays (a DeviceLoader's) stay where they are; only a short batch is padded.
      xp, images, labels = batch_arrays(images, labels)
      n = images.shape[0]
      # Data parallel: padded up to a multiple of the devices too (padding rows weigh 0).
      full = max(full or 0, -(-n // multiple) * multiple)
      weights = np.ones(full, np.float32)
      if n < full:
        pad = full - n
        images = xp.concatenate([images, xp.zeros((pad, *images.shape[1:]), images.dtype)])
        labels = xp.concatenate([labels, xp.zeros((pad, *labels.shape[1:]), labels.dtype)])
        weights[n:] = 0
      try:
        metrics = placement.steps.evaluate(params, rest, metrics, images, labels, weights)
      except (TypeError, ValueError) as e:
        self._raise_if_wrong_channels(images, e)
        raise
    if full is None:
      raise ValueError("test_loader yielded no batches")
    summary = metrics.summary()
    return {"test_loss": summary["loss"], "test_acc": summary["acc"]}

  def _warn_nonfinite(self, summary: dict, steps: int, epoch: int) -> None:
    """The epoch's warnings about non-finite steps (see :meth:`train_epoch`)."""
    if summary["nonfinite"]:
      why = ""
      if summary["labels_out_of_range"]:
        why = (
          f"; {summary['labels_out_of_range']} of them had labels out of range: class ids "
          f"outside [0, {summary['num_classes']}), the model's {summary['num_classes']} "
          "outputs (a data set with more classes than the model?)"
        )
      what = (
        "their updates were skipped (params, optimizer state and BatchNorm's running "
        "statistics unchanged)"
        if self._placement.skip_nonfinite
        else "their updates were applied (skip_nonfinite=False)"
      )
      warnings.warn(
        f"epoch {epoch}: {summary['nonfinite']} of {steps} train steps had a non-finite loss "
        f"or gradient{why}; {what}, train_loss / train_acc average the other steps and the "
        "record's nonfinite_steps counts them",
        RuntimeWarning,
        # The line that called Trainer.fit: fit -> _train_one_epoch -> train_epoch -> here.
        stacklevel=6,
      )
    if summary["nonfinite_inputs"] and not self._warned_nonfinite_inputs:
      self._warned_nonfinite_inputs = True
      warnings.warn(
        f"epoch {epoch}: train batch {summary['first_nonfinite_input']} of {steps} (1-based, "
        "in the loader's order) is the first whose inputs are not finite (NaN or Inf in the "
        f"images); {summary['nonfinite_inputs']} batches of this epoch had such inputs. Clean "
        "the data: each such step is non-finite (this warning is shown once per trainer)",
        RuntimeWarning,
        stacklevel=6,
      )

  def _check_nonfinite_run(self, summary: dict, epoch: int) -> None:
    """Carries the run of consecutive non-finite steps into the next epoch, or raises
    :class:`~jaxprune.train.NonFiniteError` when a run reached ``max_nonfinite_steps``."""
    if summary["limit_reached"]:
      start = summary["limit_run_start"]
      first_epoch, first_step = (epoch, start) if start else self._nonfinite_run[1]
      limit = self.max_nonfinite_steps
      what = "skipped" if self._placement.skip_nonfinite else "applied (skip_nonfinite=False)"
      raise _checks.NonFiniteError(
        f"training stopped at the end of epoch {epoch}: {limit} consecutive train steps had "
        f"a non-finite loss or gradient (max_nonfinite_steps={limit}); the first of them was "
        f"epoch {first_epoch}, step {first_step} (1-based, in the loader's order). Their "
        f"updates were {what}; look for NaN / Inf in the data or a diverging learning rate",
        epoch=first_epoch,
        step=first_step,
        limit=limit,
      )
    run, start = summary["nonfinite_run"], summary["run_start"]
    # A run that began this epoch names its step; one that began earlier keeps its start.
    began = (epoch, start) if start else self._nonfinite_run[1]
    self._nonfinite_run = (run, began if run else (0, 0))

  def _check_batch(self, images: Any, labels: Any) -> None:
    """Host-side checks of a batch before its step (shapes and dtypes only, no sync): labels
    that do not fit raise a ``ValueError``; integer images warn once per trainer."""
    message = _checks.label_error(images, labels)
    if message is not None:
      raise ValueError(message)
    dtype = _checks.integer_images(images)
    if dtype is not None and not self._warned_integer_images:
      self._warned_integer_images = True
      warnings.warn(
        f"images: the batch is {dtype}, so raw pixel values (e.g. 0-255) reach the model; "
        "normalise them to floats first, e.g. with jaxprune.data.Loader, which normalises "
        "(this warning is shown once per trainer)",
        UserWarning,
        stacklevel=7,
      )

  def _raise_if_wrong_channels(self, images, error: Exception) -> None:
    """Turns a step that failed on a batch with the wrong channel count into a ``ValueError``
    naming both counts (instead of XLA's convolution shape error)."""
    p = self._placement
    message = _checks.input_channel_error(p.eval_graphdef, p.params, p.rest, images)
    if message is not None:
      raise ValueError(message) from error
