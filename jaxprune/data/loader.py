"""Seeded, resumable, prefetching mini-batch iterator over an in-memory :class:`Dataset`."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxprune.data.augment import Augmentation, Normalize, as_augmentation
from jaxprune.data.dataset import Dataset

__all__ = ["Loader"]

Batch = tuple[np.ndarray, np.ndarray]
# Stream tags keep the shuffle and the augmentation draws of the same (seed, epoch) independent.
_SHUFFLE_STREAM = 0
_AUGMENT_STREAM = 1


def _check_non_negative_int(value: object, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
    raise ValueError(f"{what} must be a non-negative int, got {value!r}")
  return int(value)


class Loader:
  """Mini-batches of one data set, one epoch per iteration.

  Every batch is a pure function of ``(seed, epoch, step, batch_size)``: the epoch's order is a
  permutation seeded by ``(seed, epoch)`` and each batch's augmentation draws are seeded by
  ``(seed, epoch, step)``. A run restored from :meth:`state` (or resumed with
  :meth:`iter_epoch`) therefore sees exactly the batches an uninterrupted run would, whatever
  the number of threads. Batches are built by background threads, ``prefetch`` ahead.

  Iterating the loader runs the current epoch from the current step and then advances
  :attr:`epoch`; breaking out early keeps the position, so the next iteration continues it.

  Args:
    dataset: the :class:`Dataset` to draw from.
    batch_size: examples per batch (changeable between epochs, e.g. PruneTrain's dynamic
      mini-batch, PruneTrain §4.3).
    shuffle: new random order every epoch; otherwise data set order.
    seed: non-negative int seeding order and augmentation.
    augment: None, a preset name (``"prunetrain"``, ``"clicktrain"``, ``"clicktrain-mixup"``,
      ``"sdgp"``, ``"none"``), an :class:`Augmentation` or a list of them; applied to uint8
      images before normalisation (mixup may come last).
    drop_last: drop the final partial batch.
    prefetch: batches built ahead of the consumer (0: build synchronously, no threads).
    num_threads: worker threads building batches (default: 1 per 2 CPU cores, at least 1).
    normalize: finish with ``(x/255 - mean)/std`` using the data set's statistics.

  Yields:
    ``(images, labels)``: float32 NHWC images; int32 labels [B], or float32 soft labels
    [B, num_classes] when the pipeline mixes (mixup).

  Example:
    >>> from jaxprune import data
    >>> loader = data.Loader(data.load("digits"), 64, augment="none", seed=0)
    >>> images, labels = next(iter(loader))
    >>> images.shape, images.dtype, labels.dtype
    ((64, 8, 8, 1), dtype('float32'), dtype('int32'))
  """

  def __init__(
    self,
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    augment: None | str | Augmentation | Sequence[Augmentation] = None,
    drop_last: bool = True,
    prefetch: int = 2,
    num_threads: int | None = None,
    normalize: bool = True,
  ):
    if not isinstance(dataset, Dataset):
      raise ValueError(f"dataset must be a jaxprune.data.Dataset, got {type(dataset).__name__}")
    self._dataset = dataset
    self._shuffle = bool(shuffle)
    self._seed = _check_non_negative_int(seed, "seed")
    self._drop_last = bool(drop_last)
    self._prefetch = _check_non_negative_int(prefetch, "prefetch")
    if num_threads is None:
      num_threads = max(1, (os.cpu_count() or 1) // 2)
    if _check_non_negative_int(num_threads, "num_threads") < 1:
      raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    self._num_threads = int(num_threads)
    pipeline = as_augmentation(augment)
    if any(isinstance(aug, Normalize) for aug in pipeline):
      raise ValueError("augment must not contain Normalize: the Loader normalises (normalize=True)")
    self._augment = pipeline.bind(dataset)
    self._normalize = Normalize(dataset.mean, dataset.std) if normalize else None
    self._epoch = 0
    self._step = 0
    self._batch_size = 0
    self.batch_size = batch_size

  # -- configuration -------------------------------------------------------------------------

  @property
  def dataset(self) -> Dataset:
    return self._dataset

  @property
  def batch_size(self) -> int:
    return self._batch_size

  @batch_size.setter
  def batch_size(self, value: int) -> None:
    value = _check_non_negative_int(value, "batch_size")
    if value < 1:
      raise ValueError("batch_size must be at least 1")
    if value > len(self._dataset):
      raise ValueError(f"batch_size {value} exceeds the data set size {len(self._dataset)}")
    if value != self._batch_size and self._step != 0:
      raise ValueError(
        f"batch_size can only change between epochs (now at step {self._step} of epoch {self._epoch})"
      )
    self._batch_size = value

  @property
  def epoch(self) -> int:
    """The epoch the next iteration runs."""
    return self._epoch

  @property
  def step(self) -> int:
    """Batches of :attr:`epoch` already handed out."""
    return self._step

  def set_epoch(self, epoch: int) -> None:
    """Makes the next iteration run ``epoch`` from its start."""
    self._epoch = _check_non_negative_int(epoch, "epoch")
    self._step = 0

  def __len__(self) -> int:
    """Batches per epoch at the current batch size."""
    full, rest = divmod(len(self._dataset), self._batch_size)
    return full + (1 if rest and not self._drop_last else 0)

  # -- resumption ----------------------------------------------------------------------------

  def state(self) -> dict[str, int]:
    """Everything needed to continue exactly here (plain ints: store it in any checkpoint)."""
    return {
      "epoch": self._epoch,
      "step": self._step,
      "batch_size": self._batch_size,
      "seed": self._seed,
      "num_examples": len(self._dataset),
    }

  def restore(self, state: dict[str, Any]) -> None:
    """Continues from a :meth:`state` snapshot.

    Raises:
      ValueError: the snapshot is malformed or was taken on a data set of another size.
    """
    try:
      epoch, step, batch_size, seed = (state[k] for k in ("epoch", "step", "batch_size", "seed"))
    except (KeyError, TypeError) as err:
      raise ValueError(f"state must be a dict from Loader.state(), got {state!r}") from err
    if state.get("num_examples", len(self._dataset)) != len(self._dataset):
      raise ValueError(
        f"state was taken on {state['num_examples']} examples, this data set has {len(self._dataset)}"
      )
    self._step = 0  # so the batch size may change
    self.batch_size = batch_size
    self._seed = _check_non_negative_int(seed, "seed")
    self._epoch = _check_non_negative_int(epoch, "epoch")
    step = _check_non_negative_int(step, "step")
    if step > len(self):
      raise ValueError(f"step {step} is past the end of the epoch ({len(self)} steps)")
    self._step = step

  # -- batches -------------------------------------------------------------------------------

  def order(self, epoch: int) -> np.ndarray:
    """Indices of the data set in the order ``epoch`` visits them."""
    epoch = _check_non_negative_int(epoch, "epoch")
    if not self._shuffle:
      return np.arange(len(self._dataset))
    return np.random.default_rng((self._seed, epoch, _SHUFFLE_STREAM)).permutation(
      len(self._dataset)
    )

  def _make_batch(self, indices: np.ndarray, epoch: int, step: int) -> Batch:
    images = self._dataset.images[indices]
    labels = self._dataset.labels[indices]
    rng = np.random.default_rng((self._seed, epoch, step, _AUGMENT_STREAM))
    images, labels = self._augment(images, labels, rng)
    if self._normalize is not None:
      images, labels = self._normalize.apply(images, labels)
    return images, labels

  def iter_epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
    """The batches of ``epoch`` from ``start_step`` on, without touching the loader's position.

    Raises:
      ValueError: negative epoch, or ``start_step`` past the end of the epoch.
    """
    epoch = _check_non_negative_int(epoch, "epoch")
    start_step = _check_non_negative_int(start_step, "start_step")
    steps = len(self)
    if start_step > steps:
      raise ValueError(f"start_step {start_step} is past the end of the epoch ({steps} steps)")
    return self._generate(epoch, start_step, steps, self._batch_size)

  def _generate(self, epoch: int, start_step: int, steps: int, batch_size: int) -> Iterator[Batch]:
    order = self.order(epoch)

    def build(step: int) -> Batch:
      return self._make_batch(order[step * batch_size : (step + 1) * batch_size], epoch, step)

    if self._prefetch == 0:
      for step in range(start_step, steps):
        yield build(step)
      return
    in_flight = max(self._prefetch, self._num_threads)
    executor = ThreadPoolExecutor(
      max_workers=self._num_threads, thread_name_prefix="jaxprune-loader"
    )
    pending: collections.deque[Future[Batch]] = collections.deque()
    next_step = start_step
    try:
      while pending or next_step < steps:
        while next_step < steps and len(pending) < in_flight:
          pending.append(executor.submit(build, next_step))
          next_step += 1
        yield pending.popleft().result()
    finally:
      for future in pending:
        future.cancel()
      executor.shutdown(wait=False, cancel_futures=True)

  def __iter__(self) -> Iterator[Batch]:
    epoch, steps = self._epoch, len(self)
    for batch in self._generate(epoch, self._step, steps, self._batch_size):
      # Counted when handed out, so state() taken now resumes right after this batch.
      self._step += 1
      yield batch
    self._epoch, self._step = epoch + 1, 0
