"""What the trainer asks of a loader, and the one place a batch is placed for the step.

Two protocols name what a :class:`~jaxprune.train.Trainer` uses of a training loader:
:class:`HostLoader`, whose batches are made on the host (:class:`jaxprune.data.Loader`), and
:class:`FusedLoader`, whose data set lives on the device and whose batches the trainer makes
inside its step (:class:`jaxprune.data.DeviceLoader`). Only iteration is required: a list or a
generator of ``(images, labels)`` trains too, without what the missing members give.

:class:`LoaderView` reads a loader once: which kind it is and which members it has. Every
part of the trainer (and the hooks that read the loader's batch size or image shape) asks
the view, so the decision is made in this module alone. :func:`batch_arrays` decides where
a batch's arrays go; :meth:`LoaderView.place` moves a fused loader's data set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "FusedLoader",
  "HostLoader",
  "LoaderView",
  "batch_arrays",
  "batch_size",
  "length",
  "position",
  "restore",
  "set_batch_size",
]

# The members that make a loader fused: the trainer builds its batches inside the step.
_FUSED = ("dispatches", "make_batch", "device_arrays", "place")


class HostLoader(Protocol):
  """A training loader whose batches are made on the host (:class:`jaxprune.data.Loader`).

  Only ``__iter__`` is required. Each other member is used when the loader has it, and what
  it gives is lost without it:

  * ``__len__``: the progress bar's total, the check of the optimizer's steps per epoch, the
    schedules' pace after a batch size change.
  * ``batch_size``: the epoch record's batch size, the reference for batch growth
    (PruneTrain §4.3), the size a checkpoint restores; settable, unless the loader has
    ``set_batch_size``, which :meth:`Trainer.set_batch_size
    <jaxprune.train.Trainer.set_batch_size>` then calls.
  * ``set_epoch(epoch)``: called before each epoch (0-based), so that the order depends only
    on ``(seed, epoch)``, which exact resume needs.
  * ``state()`` / ``restore(state)``: the position within the run, saved in each checkpoint
    (``state_dict()`` / ``load_state_dict(state)`` are taken as well).
  * ``iter_epoch(epoch)``: an epoch's batches again without moving the position (BatchNorm
    re-estimation, :func:`~jaxprune.train.epoch_batches`).
  * ``dataset.image_shape``: one image's ``(H, W, C)`` (:meth:`jaxprune.methods.Run.from_loader`,
    the input shape ClickTrain's sparse execution measures with).
  """

  batch_size: int

  def __iter__(self) -> Iterator[tuple[Any, Any]]:
    """The epoch's batches ``(images, labels)``: NumPy arrays (or device arrays)."""

  def __len__(self) -> int:
    """Batches per epoch."""

  def set_batch_size(self, batch_size: int) -> None:
    """Batches of ``batch_size`` from the next epoch on."""

  def set_epoch(self, epoch: int) -> None:
    """The next iteration yields epoch ``epoch`` (0-based)."""

  def state(self) -> Any:
    """The position within the run (JSON-serialisable)."""

  def restore(self, state: Any) -> None:
    """Back to a position :meth:`state` returned."""

  def iter_epoch(self, epoch: int) -> Iterator[tuple[Any, Any]]:
    """Epoch ``epoch``'s batches, the loader's own position left alone."""

  @property
  def dataset(self) -> Any:
    """The data set drawn from; its ``image_shape`` is one image's ``(H, W, C)``."""


class FusedLoader(HostLoader, Protocol):
  """A training loader whose data set lives on the device (:class:`jaxprune.data.DeviceLoader`).

  The trainer takes its epoch as :meth:`dispatches` and makes each batch inside its fused
  step with :attr:`make_batch`; all four members below are needed (a loader with only some of
  them is a :class:`HostLoader`). The :class:`HostLoader` members are used as for one.
  """

  make_batch: Callable[..., tuple[jax.Array, jax.Array]]
  """``make_batch(images, labels, indices, seed, epoch, step)``: one batch, pure and traceable."""

  @property
  def device_arrays(self) -> tuple[jax.Array, jax.Array]:
    """The whole data set on the device: ``(images, labels)``."""

  def dispatches(self) -> Iterator[Any]:
    """The rest of the epoch as dispatches (``indices``, ``steps``, ``epoch``, ``seed``)."""

  def place(self, where: Any = None) -> None:
    """Moves the data set to ``where`` (a sharding; ``None``: where it was made)."""


def _method(loader: Any, *names: str) -> Callable[..., Any] | None:
  """The first of ``names`` that is a method of ``loader`` (``None``: none is)."""
  for name in names:
    method = getattr(loader, name, None)
    if callable(method):
      return method
  return None


class LoaderView:
  """What the trainer uses of ``loader``, read once: its kind and the members it has.

  Args:
    loader: a :class:`HostLoader`, a :class:`FusedLoader`, or any iterable of batches
      ``(images, labels)``.
    name: the argument's name in errors.

  Attributes:
    loader: the loader itself (what hooks are given).
    fused: the loader when it is a :class:`FusedLoader`, else ``None``.

  Raises:
    ValueError: ``loader`` is not an iterable of batches (named by ``name``).
  """

  def __init__(self, loader: Any, name: str = "train_loader"):
    iterable = isinstance(loader, Iterable) or hasattr(type(loader), "__getitem__")
    if not iterable or isinstance(loader, (str, bytes)):
      raise ValueError(
        f"{name} must be an iterable of (images, labels) batches (a jaxprune.data.Loader, a "
        f"DeviceLoader, a list, a generator), got {type(loader).__name__}"
      )
    self.loader = loader
    self.fused: FusedLoader | None = loader if all(hasattr(loader, n) for n in _FUSED) else None
    self._position = _method(loader, "state", "state_dict")
    self._restore = _method(loader, "restore", "load_state_dict")
    self._set_epoch = _method(loader, "set_epoch")
    self._set_batch_size = _method(loader, "set_batch_size")
    self._iter_epoch = _method(loader, "iter_epoch")
    self._place = _method(loader, "place")

  @classmethod
  def of(cls, loader: Any, name: str = "train_loader") -> LoaderView:
    """``loader``'s view (``loader`` itself when it is one already)."""
    return loader if isinstance(loader, LoaderView) else cls(loader, name)

  def __iter__(self) -> Iterator[tuple[Any, Any]]:
    return iter(self.loader)

  def __len__(self) -> int:
    """``len(loader)``; a ``TypeError`` for a loader without a length."""
    return len(self.loader)

  @property
  def batch_size(self) -> int | None:
    """The loader's batch size now (``None``: it has none)."""
    size = getattr(self.loader, "batch_size", None)
    return int(size) if size is not None else None

  def set_batch_size(self, batch_size: int) -> None:
    """``loader.set_batch_size(batch_size)`` if it has one, else sets the attribute."""
    if self._set_batch_size is not None:
      self._set_batch_size(batch_size)
    else:
      self.loader.batch_size = batch_size

  def set_epoch(self, epoch: int) -> None:
    """``loader.set_epoch(epoch)`` when it has one (its order is then the epoch's)."""
    if self._set_epoch is not None:
      self._set_epoch(epoch)

  def position(self) -> Any:
    """The loader's position (``None``: it has none to give)."""
    return self._position() if self._position is not None else None

  def restore(self, state: Any) -> None:
    """Puts the loader back at a :meth:`position` (nothing when it cannot be)."""
    if self._restore is not None:
      self._restore(state)

  def epoch_batches(self, epoch: int) -> Iterable[Any]:
    """Epoch ``epoch``'s (0-based) batches.

    ``loader.iter_epoch(epoch)``, which leaves the position alone, or else a fresh ``iter(loader)``.
    """
    return self._iter_epoch(epoch) if self._iter_epoch is not None else iter(self.loader)

  @property
  def image_shape(self) -> tuple[int, ...] | None:
    """One image's shape, from the loader's ``dataset`` (``None``: it has none)."""
    dataset = getattr(self.loader, "dataset", None)
    shape = getattr(dataset, "image_shape", None)
    if shape is None and getattr(dataset, "images", None) is not None:
      shape = np.shape(dataset.images)[1:]
    return tuple(int(d) for d in shape) if shape is not None else None

  def place(self, where: Any) -> None:
    """Moves a device-resident data set to ``where`` (a sharding; ``None``: its home).

    Any other loader's batches are placed one at a time by :func:`batch_arrays`.
    """
    if self._place is not None:
      self._place(where)


def batch_arrays(images: Any, labels: Any) -> tuple[Any, Any, Any]:
  """A batch as arrays for the step, and the array module that pads it.

  Returns ``(xp, images, labels)``. Device arrays (a :class:`FusedLoader`'s batches) stay where they
  are and ``xp`` is ``jax.numpy``; anything else becomes NumPy on the host, which the jitted step
  copies to the device (sharded over the mesh with data parallelism).
  """
  xp = jnp if isinstance(images, jax.Array) else np
  return xp, xp.asarray(images), xp.asarray(labels)


# The trainer's parts that take a loader or its view (batch growth, the epoch-length check).
def batch_size(loader: Any) -> int | None:
  """:attr:`LoaderView.batch_size` of ``loader`` (``None`` for no loader)."""
  return LoaderView.of(loader).batch_size if loader is not None else None


def length(loader: Any) -> int | None:
  """``len(loader)``, or ``None`` for a loader without a length."""
  try:
    return int(len(loader))
  except TypeError:
    return None


def position(loader: Any) -> Any:
  """:meth:`LoaderView.position` of ``loader``."""
  return LoaderView.of(loader).position()


def restore(loader: Any, state: Any) -> None:
  """:meth:`LoaderView.restore` of ``loader``."""
  LoaderView.of(loader).restore(state)


def set_batch_size(loader: Any, batch_size: int) -> None:
  """:meth:`LoaderView.set_batch_size` of ``loader``."""
  LoaderView.of(loader).set_batch_size(batch_size)
