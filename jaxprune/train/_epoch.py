"""One training epoch and one evaluation pass of :class:`~jaxprune.train.Trainer`: the step
loop, its timing and throughput, step hooks, the progress bar, and padded evaluation."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxprune.train import _checks
from jaxprune.train.step import Metrics

__all__ = ["EpochLoops"]


class EpochLoops:
  """``train_epoch`` and ``evaluate`` (a mixin of :class:`~jaxprune.train.Trainer`: the state,
  step, callbacks and progress setting are the trainer's)."""

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
    metrics = Metrics.zeros()._replace(
      nonfinite_run=jnp.float32(self._nonfinite_run[0]),
      max_nonfinite=jnp.float32(self.max_nonfinite_steps or 0),
    )
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
    run = self._device_steps if hasattr(loader, "dispatches") else self._host_steps
    for metrics, count, batch, wait in run(loader, metrics, due):
      self._model_synced = False
      data_wait += wait
      for _ in range(count):
        self.step += 1
        steps += 1
        images_seen += batch
        for c in due:
          if self.step % c.every_steps == 0:
            c.on_step(self, self.step)
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
    self._warn_nonfinite(summary, steps)
    self._check_nonfinite_run(summary)
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

  def _host_steps(self, loader: Iterable, metrics: Metrics, due: list) -> Iterator:
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
      self._own_donated_state()
      try:
        self.params, self.rest, self.opt_state, metrics = self._steps.train(
          self.params, self.rest, self.opt_state, metrics, images, labels
        )
      except (TypeError, ValueError) as e:  # raised while tracing: nothing was donated
        self._raise_if_wrong_channels(images, e)
        raise
      yield metrics, 1, int(np.shape(images)[0]), wait

  def _device_steps(self, loader: Any, metrics: Metrics, due: list) -> Iterator:
    """A :class:`~jaxprune.data.DeviceLoader`'s epoch, several steps per call of the fused
    step (one per call while a callback wants every few steps): yields ``(metrics, steps,
    batch size, data wait)`` per call."""
    if self.mesh is not None:
      raise ValueError(
        "train_loader: a DeviceLoader trains on one device; with a mesh use jaxprune.data.Loader"
      )
    fused = self._steps.fused_train(loader.make_batch)
    images_all, labels_all = loader.device_arrays
    for dispatch in loader.dispatches():
      indices, step_ids = dispatch.indices, dispatch.steps
      if due:  # step hooks see every step
        chunks = [(indices[i : i + 1], step_ids[i : i + 1]) for i in range(len(step_ids))]
      else:
        chunks = [(indices, step_ids)]
      for chunk, ids in chunks:
        self._own_donated_state()
        try:
          self.params, self.rest, self.opt_state, metrics = fused(
            self.params, self.rest, self.opt_state, metrics, images_all, labels_all,
            chunk, dispatch.seed, dispatch.epoch, ids,
          )  # fmt: skip
        except (TypeError, ValueError) as e:  # raised while tracing: nothing was donated
          self._raise_if_wrong_channels(np.zeros((1, *images_all.shape[1:])), e)
          raise
        yield metrics, len(ids), chunk.shape[1], 0.0

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
      self._check_batch(images, labels)
      # Device arrays (a DeviceLoader's) stay where they are; only a short batch is padded.
      xp = np if isinstance(images, np.ndarray) or not hasattr(images, "device") else jnp
      images, labels = xp.asarray(images), xp.asarray(labels)
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
        metrics = self._steps.evaluate(self.params, self.rest, metrics, images, labels, weights)
      except (TypeError, ValueError) as e:
        self._raise_if_wrong_channels(images, e)
        raise
    if full is None:
      raise ValueError("test_loader yielded no batches")
    summary = metrics.summary()
    return {"test_loss": summary["loss"], "test_acc": summary["acc"]}

  def _warn_nonfinite(self, summary: dict, steps: int) -> None:
    """The epoch's warnings about non-finite steps (see :meth:`train_epoch`)."""
    epoch = self.epoch + 1
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
        if self.skip_nonfinite
        else "their updates were applied (skip_nonfinite=False)"
      )
      warnings.warn(
        f"epoch {epoch}: {summary['nonfinite']} of {steps} train steps had a non-finite loss "
        f"or gradient{why}; {what}, train_loss / train_acc average the other steps and the "
        "record's nonfinite_steps counts them",
        RuntimeWarning,
        stacklevel=4,
      )
    if summary["nonfinite_inputs"] and not self._warned_nonfinite_inputs:
      self._warned_nonfinite_inputs = True
      warnings.warn(
        f"epoch {epoch}: train batch {summary['first_nonfinite_input']} of {steps} (1-based, "
        "in the loader's order) is the first whose inputs are not finite (NaN or Inf in the "
        f"images); {summary['nonfinite_inputs']} batches of this epoch had such inputs. Clean "
        "the data: each such step is non-finite (this warning is shown once per trainer)",
        RuntimeWarning,
        stacklevel=4,
      )

  def _check_nonfinite_run(self, summary: dict) -> None:
    """Carries the run of consecutive non-finite steps into the next epoch, or raises
    :class:`~jaxprune.train.NonFiniteError` when a run reached ``max_nonfinite_steps``."""
    epoch = self.epoch + 1
    if summary["limit_reached"]:
      start = summary["limit_run_start"]
      first_epoch, first_step = (epoch, start) if start else self._nonfinite_run[1]
      limit = self.max_nonfinite_steps
      what = "skipped" if self.skip_nonfinite else "applied (skip_nonfinite=False)"
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
        stacklevel=5,
      )

  def _raise_if_wrong_channels(self, images, error: Exception) -> None:
    """Turns a step that failed on a batch with the wrong channel count into a ``ValueError``
    naming both counts (instead of XLA's convolution shape error)."""
    message = _checks.input_channel_error(self._eval_graphdef, self.params, self.rest, images)
    if message is not None:
      raise ValueError(message) from error
