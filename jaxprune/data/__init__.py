"""Data sets, augmentation and loading for training on one host.

* :func:`load` ``(name, *, root, split, cache_dir)`` → :class:`Dataset` (uint8 NHWC images,
  int32 labels, class names, training mean/std). Names: :func:`available`.
* :class:`Loader`: seeded, resumable, prefetching batches of float32 normalised images.
* :class:`DeviceLoader`: the same order and position, with the data set on the accelerator and
  each batch augmented there (:mod:`jaxprune.data.device_augment`), inside the train step.
* :mod:`jaxprune.data.augment`: batched NumPy augmentations and the papers' presets.
* :func:`open_stream` ``("imagenet", ...)``: data sets too large for memory, read batch by batch
  by worker processes (:mod:`jaxprune.data.imagenet`, the ``imagenet`` extra).

Example:
  >>> from jaxprune import data
  >>> train = data.load("digits", split="train")
  >>> loader = data.Loader(train, batch_size=128, augment="prunetrain", seed=0)
  >>> for images, labels in loader:  # one epoch
  ...     pass
"""

from jaxprune.data import augment
from jaxprune.data.augment import (
  Augmentation,
  Compose,
  Cutout,
  Mixup,
  Normalize,
  RandomCrop,
  RandomHorizontalFlip,
  RandomTranslate,
  available_presets,
  preset,
)
from jaxprune.data.cifar import CIFAR10_CLASSES
from jaxprune.data import device_augment
from jaxprune.data.dataset import Dataset, channel_stats
from jaxprune.data.device_loader import DeviceLoader, Dispatch
from jaxprune.data.loader import Loader
from jaxprune.data.registry import (
  DATA_ENV,
  available,
  available_streams,
  default_data_dir,
  load,
  open_stream,
)
from jaxprune.data._cache import CACHE_ENV, default_cache_dir

__all__ = [
  "Augmentation",
  "CACHE_ENV",
  "CIFAR10_CLASSES",
  "Compose",
  "Cutout",
  "DATA_ENV",
  "Dataset",
  "DeviceLoader",
  "Dispatch",
  "Loader",
  "Mixup",
  "Normalize",
  "RandomCrop",
  "RandomHorizontalFlip",
  "RandomTranslate",
  "augment",
  "available",
  "available_presets",
  "available_streams",
  "channel_stats",
  "default_cache_dir",
  "default_data_dir",
  "device_augment",
  "load",
  "open_stream",
  "preset",
]
