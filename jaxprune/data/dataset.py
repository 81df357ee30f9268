"""The in-memory image classification data set every loader and trainer consumes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["Dataset", "channel_stats"]


def channel_stats(images: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
  """Per-channel mean and standard deviation of uint8 NHWC images, in [0, 1] units.

  Computed exactly from a 256-bin histogram per channel, so a 50 000-image set costs one
  pass over the bytes and no float copy of the data.

  Args:
    images: uint8 array of shape (N, H, W, C).

  Returns:
    (mean, std): two tuples of C floats, each the statistic of ``images / 255``.
  """
  _check_images(images, "images")
  levels = np.arange(256, dtype=np.float64) / 255.0
  means, stds = [], []
  for channel in range(images.shape[-1]):
    counts = np.bincount(images[..., channel].ravel(), minlength=256).astype(np.float64)
    total = counts.sum()
    mean = float(counts @ levels / total)
    var = float(counts @ (levels - mean) ** 2 / total)
    means.append(mean)
    stds.append(var**0.5)
  return tuple(means), tuple(stds)


def _check_images(images: object, what: str) -> None:
  if not isinstance(images, np.ndarray):
    raise ValueError(f"{what} must be a numpy array, got {type(images).__name__}")
  if images.dtype != np.uint8:
    raise ValueError(f"{what} must be uint8, got dtype {images.dtype}")
  if images.ndim != 4:
    raise ValueError(f"{what} must be NHWC (4-D), got shape {images.shape}")
  if images.shape[0] == 0:
    raise ValueError(f"{what} is empty")


def _read_only(array: np.ndarray) -> np.ndarray:
  view = array.view()
  view.flags.writeable = False
  return view


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
  """Images and integer labels of one split, held in memory.

  Attributes:
    images: uint8 array (N, H, W, C), read-only.
    labels: int32 array (N,), values in ``[0, num_classes)``, read-only.
    num_classes: number of classes.
    class_names: one name per class index.
    mean: per-channel mean of the *training* split in [0, 1] units (the test split carries the
      training statistics too, so both are normalised the same way).
    std: per-channel standard deviation of the training split, [0, 1] units.
    name: registry name it was loaded under ("" for hand-built sets).
    split: "train" or "test" ("" for hand-built sets).

  Example:
    >>> import numpy as np
    >>> ds = Dataset.from_arrays(np.zeros((4, 8, 8, 1), np.uint8), np.array([0, 1, 0, 1]))
    >>> len(ds), ds.num_classes, ds.image_shape
    (4, 2, (8, 8, 1))
  """

  images: np.ndarray
  labels: np.ndarray
  num_classes: int
  class_names: tuple[str, ...]
  mean: tuple[float, ...]
  std: tuple[float, ...]
  name: str = ""
  split: str = ""

  def __post_init__(self) -> None:
    _check_images(self.images, "images")
    labels = self.labels
    if not isinstance(labels, np.ndarray) or labels.ndim != 1:
      raise ValueError(
        f"labels must be a 1-D numpy array, got {getattr(labels, 'shape', labels)!r}"
      )
    if labels.dtype != np.int32:
      raise ValueError(f"labels must be int32, got dtype {labels.dtype}")
    if labels.shape[0] != self.images.shape[0]:
      raise ValueError(f"{labels.shape[0]} labels for {self.images.shape[0]} images")
    if not isinstance(self.num_classes, (int, np.integer)) or self.num_classes < 1:
      raise ValueError(f"num_classes must be a positive int, got {self.num_classes!r}")
    if labels.min() < 0 or labels.max() >= self.num_classes:
      raise ValueError(
        f"labels must lie in [0, {self.num_classes}), got range [{labels.min()}, {labels.max()}]"
      )
    class_names = tuple(str(c) for c in self.class_names)
    if len(class_names) != self.num_classes:
      raise ValueError(f"{len(class_names)} class_names for num_classes={self.num_classes}")
    channels = self.images.shape[-1]
    mean = tuple(float(m) for m in self.mean)
    std = tuple(float(s) for s in self.std)
    if len(mean) != channels or len(std) != channels:
      raise ValueError(
        f"mean and std need {channels} entries (one per channel), got {mean} and {std}"
      )
    if min(std) <= 0:
      raise ValueError(f"std must be positive, got {std}")
    object.__setattr__(self, "images", _read_only(self.images))
    object.__setattr__(self, "labels", _read_only(labels))
    object.__setattr__(self, "num_classes", int(self.num_classes))
    object.__setattr__(self, "class_names", class_names)
    object.__setattr__(self, "mean", mean)
    object.__setattr__(self, "std", std)

  @classmethod
  def from_arrays(
    cls,
    images: np.ndarray,
    labels: np.ndarray | Sequence[int],
    *,
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    name: str = "",
    split: str = "",
  ) -> Dataset:
    """Builds a data set from arrays, filling in what is not given.

    Args:
      images: uint8 NHWC array.
      labels: integer labels, converted to int32.
      num_classes: defaults to ``max(labels) + 1`` (or ``len(class_names)``).
      class_names: defaults to ``("0", "1", ...)``.
      mean, std: default to the statistics of ``images`` (:func:`channel_stats`); a
        channel with zero spread gets std 1.
      name, split: free-form tags.

    Returns:
      The :class:`Dataset`.
    """
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
      raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
    labels = labels.astype(np.int32)
    if num_classes is None:
      num_classes = len(class_names) if class_names is not None else int(labels.max()) + 1
    if class_names is None:
      class_names = tuple(str(i) for i in range(num_classes))
    if mean is None or std is None:
      stat_mean, stat_std = channel_stats(images)
      mean = stat_mean if mean is None else mean
      # A constant channel has no spread to divide by; leave its scale alone.
      std = tuple(s if s > 0 else 1.0 for s in stat_std) if std is None else std
    return cls(
      images, labels, num_classes, tuple(class_names), tuple(mean), tuple(std), name, split
    )

  def __len__(self) -> int:
    return int(self.images.shape[0])

  @property
  def image_shape(self) -> tuple[int, int, int]:
    """(H, W, C) of one image."""
    return tuple(int(d) for d in self.images.shape[1:])  # type: ignore[return-value]

  def subset(self, indices: np.ndarray | Sequence[int] | slice) -> Dataset:
    """The examples at ``indices`` (same classes and normalisation statistics)."""
    if isinstance(indices, slice):
      images, labels = self.images[indices], self.labels[indices]
    else:
      index_array = np.asarray(indices)
      if index_array.ndim != 1 or index_array.dtype.kind not in "iub":
        raise ValueError(f"indices must be a 1-D integer or boolean array, got {index_array!r}")
      images, labels = self.images[index_array], self.labels[index_array]
    return dataclasses.replace(self, images=images, labels=labels)

  def balanced_subset(self, size: int | None, seed: int = 0) -> Dataset:
    """``size // num_classes`` random examples of every class, in data set order.

    For reduced-budget experiments: a subset with equal class counts keeps the class
    prior of the full (balanced) set.  A class with fewer examples contributes all it has.

    Args:
        size: total number of examples wanted; ``None``, or at least ``len(self)``,
            returns the data set itself.
        seed: seed of the per-class random choice.

    Returns:
        The subset (same classes and normalisation statistics).

    Raises:
        ValueError: ``size`` smaller than ``num_classes`` (an empty class would follow).

    Example:
        >>> small = dataset.balanced_subset(2560, seed=0)  # doctest: +SKIP
    """
    if size is None or size >= len(self):
      return self
    if size < self.num_classes:
      raise ValueError(f"size must be >= num_classes ({self.num_classes}), got {size}")
    rng = np.random.default_rng(seed)
    per_class = size // self.num_classes
    picks = [
      rng.permutation(np.flatnonzero(self.labels == label))[:per_class]
      for label in range(self.num_classes)
    ]
    return self.subset(np.sort(np.concatenate(picks)))


class Splits(NamedTuple):
  """Both splits of a data set as read from disk (internal hand-off to the registry)."""

  train_images: np.ndarray
  train_labels: np.ndarray
  test_images: np.ndarray
  test_labels: np.ndarray
  class_names: tuple[str, ...]
  mean: tuple[float, ...]
  std: tuple[float, ...]


def make_splits(
  train_images: np.ndarray,
  train_labels: np.ndarray,
  test_images: np.ndarray,
  test_labels: np.ndarray,
  class_names: Sequence[str],
) -> Splits:
  """Bundles two splits, with normalisation statistics taken from the training split."""
  mean, std = channel_stats(train_images)
  return Splits(
    np.ascontiguousarray(train_images),
    np.asarray(train_labels, dtype=np.int32),
    np.ascontiguousarray(test_images),
    np.asarray(test_labels, dtype=np.int32),
    tuple(class_names),
    mean,
    std,
  )
