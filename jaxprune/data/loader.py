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


def _jax_process() -> tuple[int, int]:
  """``(jax.process_index(), jax.process_count())`` of a started multi-host run, else (0, 1).

  Asks JAX only when its distributed runtime or backends already started: creating a loader
  must not start JAX's backends before :func:`jax.distributed.initialize` could run.
  """
  import jax

  from jaxprune.multihost import backends_started

  if jax.distributed.is_initialized() or backends_started():
    return jax.process_index(), jax.process_count()
  return 0, 1


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
  The loader has one position, so only its newest iteration moves it: ``iter(loader)``
  takes the position over from any iterator still live, and :meth:`set_epoch` or
  :meth:`restore` move it; an iterator superseded that way raises ``RuntimeError`` on its
  next batch instead of handing out batches the position no longer counts (use
  :meth:`iter_epoch` for extra passes that must not touch the position).

  Multi-host (one process per host, :mod:`jaxprune.multihost`): ``batch_size`` is the
  *global* batch; each process gets its own ``batch_size // process_count`` examples of
  every global batch (process ``i`` the ``i``-th contiguous slice), so the processes
  together see each global batch once and each example of the epoch exactly once, in the
  order a single process would. The position (:meth:`state`) is the same on every process.
  The augmentation draws of a process's slice are seeded by ``(seed, epoch, step,
  process_index)`` when there are several processes, so the augmented pixels differ from a
  single-process run's (the examples, their order and unaugmented pixels do not).

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
    process_index: this process's index among ``process_count`` (default
      ``jax.process_index()`` once :func:`jax.distributed.initialize` has run, else 0).
    process_count: processes sharing each global batch (default ``jax.process_count()``
      likewise, else 1).

  Raises:
    ValueError: bad arguments; a ``batch_size`` not divisible by ``process_count`` (and,
      with ``drop_last=False``, a final partial batch not divisible by it); a
      ``process_index`` outside ``[0, process_count)``.

  Yields:
    ``(images, labels)``: float32 NHWC images; int32 labels [B], or float32 soft labels
    [B, num_classes] when the pipeline mixes (mixup); B is :attr:`local_batch_size`.

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
    process_index: int | None = None,
    process_count: int | None = None,
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
    default_index, default_count = _jax_process()
    self._process_count = _check_non_negative_int(
      default_count if process_count is None else process_count, "process_count"
    )
    if self._process_count < 1:
      raise ValueError(f"process_count must be at least 1, got {self._process_count}")
    self._process_index = _check_non_negative_int(
      default_index if process_index is None else process_index, "process_index"
    )
    if self._process_index >= self._process_count:
      raise ValueError(
        f"process_index {self._process_index} must be below process_count {self._process_count}"
      )
    self._epoch = 0
    self._step = 0
    # Identifies the iteration that owns the position; a new one (or set_epoch / restore)
    # supersedes the live one, so two live iterators never advance one position in turns.
    self._owner = 0
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
    count = self._process_count
    if value % count:
      raise ValueError(
        f"batch_size {value} (the global batch) must be divisible by process_count {count}"
      )
    rest = len(self._dataset) % value
    if not self._drop_last and rest % count:
      raise ValueError(
        f"drop_last=False: the final batch of {rest} examples (data set size "
        f"{len(self._dataset)}, batch_size {value}) must be divisible by process_count {count}"
      )
    self._batch_size = value

  @property
  def local_batch_size(self) -> int:
    """Examples per batch this process gets (``batch_size // process_count``)."""
    return self._batch_size // self._process_count

  @property
  def process_index(self) -> int:
    return self._process_index

  @property
  def process_count(self) -> int:
    return self._process_count

  @property
  def epoch(self) -> int:
    """The epoch the next iteration runs."""
    return self._epoch

  @property
  def step(self) -> int:
    """Batches of :attr:`epoch` already handed out."""
    return self._step

  def set_epoch(self, epoch: int) -> None:
    """Makes the next iteration run ``epoch`` from its start.

    A live iteration is superseded: its next ``next()`` raises ``RuntimeError``, so
    :meth:`state` always describes what the next iteration will hand out.
    """
    self._epoch = _check_non_negative_int(epoch, "epoch")
    self._step = 0
    self._owner += 1

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

    It supersedes a live iteration, as :meth:`set_epoch` does.

    The position counts global batches, so a snapshot from any process of a multi-host run,
    or from a run with another process count, restores the same place.

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
    self._owner += 1

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
    key = (self._seed, epoch, step, _AUGMENT_STREAM)
    if self._process_count > 1:
      # Each process draws its own slice's augmentation; one process keeps the old key, so
      # single-host runs (and their checkpoints) see the same batches as before.
      key += (self._process_count, self._process_index)
    rng = np.random.default_rng(key)
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

    count, index = self._process_count, self._process_index

    def build(step: int) -> Batch:
      batch = order[step * batch_size : (step + 1) * batch_size]
      local = len(batch) // count  # the final partial batch divides too (checked)
      return self._make_batch(batch[index * local : (index + 1) * local], epoch, step)

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
    """The rest of the current epoch; takes the position over from any live iteration."""
    self._owner += 1
    return self._run(self._owner)

  def _run(self, owner: int) -> Iterator[Batch]:
    epoch, steps = self._epoch, len(self)
    batches = self._generate(epoch, self._step, steps, self._batch_size)
    try:
      for batch in batches:
        if self._owner != owner:
          raise RuntimeError(
            "this Loader iterator was superseded by a newer iteration, set_epoch or restore; "
            "the loader's position is now "
            f"epoch {self._epoch} step {self._step} (use iter_epoch for independent passes)"
          )
        # Counted when handed out, so state() taken now resumes right after this batch.
        self._step += 1
        yield batch
    finally:
      batches.close()
    if self._owner == owner:
      self._epoch, self._step = epoch + 1, 0
