"""One training epoch and one evaluation pass of :class:`~jaxprune.train.Trainer`: the step
loop, its timing and throughput, step hooks, the progress bar, and padded evaluation."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable

import numpy as np

from jaxprune.train.step import Metrics

__all__ = ["EpochLoops"]


class EpochLoops:
  """``train_epoch`` and ``evaluate`` (a mixin of :class:`~jaxprune.train.Trainer`: the state,
  step, callbacks and progress setting are the trainer's)."""

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
