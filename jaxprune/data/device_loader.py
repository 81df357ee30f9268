"""Batches made on the accelerator from a data set that lives there for the whole run."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxprune.data import device_augment
from jaxprune.data.dataset import Dataset
from jaxprune.data.loader import _AUGMENT_STREAM, Batch, Loader, _check_non_negative_int

__all__ = ["DeviceLoader", "Dispatch"]


class Dispatch(NamedTuple):
  """Several consecutive train steps of one epoch, for one call of a fused train step.

  ``indices[k]`` are the examples of step ``steps[k]`` of ``epoch``; the batch itself is made
  on the device by :meth:`DeviceLoader.make_batch`.
  """

  indices: np.ndarray  # (K, B) int32
  steps: np.ndarray  # (K,) int32: the steps' numbers within the epoch
  epoch: int
  seed: int


def _closest_divisor(total: int, wanted: int) -> int:
  """The divisor of ``total`` closest to ``wanted`` on a log scale (ties: the smaller), so that
  every dispatch of an epoch has the same length and the fused step compiles once."""
  divisors = [d for d in range(1, total + 1) if total % d == 0]
  return min(divisors, key=lambda d: (abs(math.log(d / wanted)), d))


def _batch_maker(batch_fn: device_augment.BatchFunction):
  def make_batch(images, labels, indices, seed, epoch, step):
    """The batch of examples ``indices`` at ``(seed, epoch, step)``.

    Gathered from the device-resident ``images`` / ``labels``, augmented and normalised. Pure and
    traceable (the trainer calls it inside its fused step).
    """
    key = jax.random.key(seed)
    for value in (_AUGMENT_STREAM, epoch, step):
      key = jax.random.fold_in(key, value)
    return batch_fn(key, jnp.take(images, indices, axis=0), jnp.take(labels, indices, axis=0))

  return make_batch


class DeviceLoader(Loader):
  """A :class:`~jaxprune.data.Loader` whose data set lives on the accelerator.

  The uint8 images and int32 labels are copied to the device once. Each batch is gathered,
  augmented (the JAX twins of :mod:`jaxprune.data.augment`, :mod:`~jaxprune.data.device_augment`)
  and normalised on the device, inside the train step when a
  :class:`~jaxprune.train.Trainer` runs it: the host only issues steps, ``steps_per_dispatch``
  of them per call (a ``lax.scan``), and never copies a batch.

  Order and position are the :class:`Loader`'s: the epoch's order is the same permutation of
  ``(seed, epoch)``, and :meth:`state` / :meth:`restore` resume exactly. Each batch's draws come
  from ``fold_in(fold_in(fold_in(key(seed), 1), epoch), step)``, so a batch depends only on
  ``(seed, epoch, step, batch_size)`` however the steps are grouped into dispatches (the
  augmented pixels are not the NumPy loader's: another generator).

  With a :class:`~jaxprune.train.Trainer` on a mesh (data parallelism) the data set is
  replicated on the mesh's devices (:meth:`place`) and each global batch, the same pixels as
  on one device, is made sharded over the batch axis: each device gathers and augments its
  own shard. A copy per device costs the data set's size on each (CIFAR-10's training set:
  146 MiB of uint8) and no traffic between devices per step.

  Iterating it yields ``(images, labels)`` as device arrays, one batch at a time, for any
  consumer; the trainer instead takes :meth:`dispatches` and fuses :attr:`make_batch`
  ``(images, labels, indices, seed, epoch, step)`` into its step.

  Args:
    dataset: the :class:`Dataset` (uint8 images) to draw from.
    batch_size: examples per batch (changeable between epochs, PruneTrain §4.3).
    shuffle: new random order every epoch; otherwise data set order.
    seed: non-negative int seeding order and augmentation.
    augment: as for :class:`Loader`; every member needs a device twin (crop, translate, flip,
      cutout, mixup: the papers' presets).
    drop_last: drop the final partial batch (which otherwise gets a dispatch of its own).
    normalize: finish with ``(x/255 - mean)/std`` using the data set's statistics.
    steps_per_dispatch: steps fused into one device call (rounded to the divisor of the
      epoch's full batches closest to it, so every call of an epoch has one shape).
    device: where the data set lives (default: JAX's default device): a device or a
      ``jax.sharding.Sharding`` (see :meth:`place`; a trainer with a mesh moves it there).

  Raises:
    ValueError: bad arguments (named), an augmentation without a device twin, or a
      multi-process run (each process would need its own slice: not supported).

  Example:
    >>> from jaxprune import data
    >>> loader = data.DeviceLoader(data.load("digits"), 64, augment="none", seed=0)
    >>> images, labels = next(iter(loader))
    >>> images.shape, images.dtype
    ((64, 8, 8, 1), dtype('float32'))
  """

  def __init__(
    self,
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    augment: Any = None,
    drop_last: bool = True,
    normalize: bool = True,
    steps_per_dispatch: int = 1,
    device: Any = None,
  ):
    if jax.process_count() > 1:
      raise ValueError(
        "DeviceLoader holds the whole data set on the devices of one process; a multi-process "
        "run needs jaxprune.data.Loader"
      )
    super().__init__(
      dataset,
      batch_size,
      shuffle=shuffle,
      seed=seed,
      augment=augment,
      drop_last=drop_last,
      prefetch=0,
      num_threads=1,
      normalize=normalize,
      process_index=0,
      process_count=1,
    )
    if _check_non_negative_int(steps_per_dispatch, "steps_per_dispatch") < 1:
      raise ValueError(f"steps_per_dispatch must be at least 1, got {steps_per_dispatch}")
    self._steps_per_dispatch = int(steps_per_dispatch)
    # A closure over the pipeline alone (not over the loader and its device arrays): compiled
    # steps cache it as a key without keeping the data set alive.
    self.make_batch = _batch_maker(device_augment.batch_function(self._augment, self._normalize))
    self._images = jax.device_put(np.asarray(dataset.images), device)
    self._labels = jax.device_put(np.asarray(dataset.labels), device)
    # Where the data set goes back to for a single-device trainer.
    self._home = self._images.sharding
    self._jit_batch = jax.jit(self.make_batch)

  def place(self, where: Any = None) -> None:
    """Moves the data set to ``where``.

    ``where``: a device, or a ``jax.sharding.Sharding``; ``None``: back where the constructor put
    it. A :class:`~jaxprune.train.Trainer` with a mesh places it replicated on the mesh
    (``NamedSharding(mesh, PartitionSpec())``: a copy on each device, from which each device makes
    its shard of every batch), one without a mesh back home (a loader may serve both); nothing is
    copied when it is there already.
    """
    where = self._home if where is None else where
    if where != self._images.sharding:
      self._images, self._labels = jax.device_put((self._images, self._labels), where)

  @property
  def device_arrays(self) -> tuple[jax.Array, jax.Array]:
    """The whole data set on the device: ``(uint8 images, int32 labels)``."""
    return self._images, self._labels

  @property
  def steps_per_dispatch(self) -> int:
    """Steps per dispatch asked for (:meth:`dispatches` rounds it to a divisor)."""
    return self._steps_per_dispatch

  def dispatch_steps(self) -> int:
    """Steps per dispatch at the current batch size.

    The divisor of the epoch's full batches closest to :attr:`steps_per_dispatch`.
    """
    return _closest_divisor(len(self._dataset) // self.batch_size, self._steps_per_dispatch)

  def dispatches(self) -> Iterator[Dispatch]:
    """The rest of the current epoch as :class:`Dispatch` es.

    Each of :meth:`dispatch_steps` steps (the final partial batch, with ``drop_last=False``, as a
    dispatch of its own).

    The position moves as each dispatch is handed out, and the epoch advances at the end, as
    iterating the loader does; a newer iteration (or :meth:`set_epoch`, :meth:`restore`)
    supersedes this one.
    """
    self._owner += 1
    owner, epoch, total = self._owner, self._epoch, len(self)
    size = self.batch_size
    order = self.order(epoch).astype(np.int32)
    full = len(order) // size
    k = self.dispatch_steps()
    while self._step < total:
      if self._owner != owner:
        raise RuntimeError(
          "this DeviceLoader's dispatches were superseded by a newer iteration, set_epoch or "
          f"restore; the loader's position is now epoch {self._epoch} step {self._step}"
        )
      start = self._step
      if start < full:
        count = min(k - start % k, full - start)  # a resumed epoch re-aligns to k
        indices = order[start * size : (start + count) * size].reshape(count, size)
      else:
        count = 1
        indices = order[start * size :][None]
      self._step += count
      yield Dispatch(indices, np.arange(start, start + count, dtype=np.int32), epoch, self._seed)
    if self._owner == owner:
      self._epoch, self._step = epoch + 1, 0

  def _generate(self, epoch: int, start_step: int, steps: int, batch_size: int) -> Iterator[Batch]:
    order = self.order(epoch).astype(np.int32)
    for step in range(start_step, steps):
      indices = order[step * batch_size : (step + 1) * batch_size]
      yield self._jit_batch(self._images, self._labels, indices, self._seed, epoch, step)
