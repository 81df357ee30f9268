"""``load(name)``: the data set registry and where each data set is looked for.

Data sets that fit in memory are read whole by :func:`load`; those that do not (ImageNet) are
opened by :func:`open_stream`, which returns their own loader reading files batch by batch.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from jaxprune.data._cache import default_cache_dir
from jaxprune.data.cifar import CIFAR10_CANDIDATES, CIFAR100_CANDIDATES, read_cifar10, read_cifar100
from jaxprune.data.dataset import Dataset, Splits
from jaxprune.data.digits import read_digits
from jaxprune.data.tiny_imagenet import TINY_IMAGENET_CANDIDATES, read_tiny_imagenet

__all__ = ["available", "available_streams", "default_data_dir", "load", "open_stream", "DATA_ENV"]

DATA_ENV = "JAXPRUNE_DATA"


class _Spec(NamedTuple):
  candidates: tuple[str, ...] | None  # None: embedded, no files to find
  read: Callable[[Path | None, Path], Splits]
  splits: tuple[str, ...] = ("train", "test")


_SPECS: dict[str, _Spec] = {
  "cifar10": _Spec(CIFAR10_CANDIDATES, lambda path, cache: read_cifar10(path, cache)),
  "cifar100": _Spec(CIFAR100_CANDIDATES, lambda path, cache: read_cifar100(path, "fine")),
  "cifar100-coarse": _Spec(CIFAR100_CANDIDATES, lambda path, cache: read_cifar100(path, "coarse")),
  "digits": _Spec(None, lambda path, cache: read_digits()),
  "tiny-imagenet": _Spec(
    TINY_IMAGENET_CANDIDATES,
    lambda path, cache: read_tiny_imagenet(path, cache),
    ("train", "test", "val"),
  ),
}


class _Stream(NamedTuple):
  loader: str  # "module:attribute" of the loader class, imported when opened (optional extra)
  candidates: tuple[str, ...]
  splits: tuple[str, ...]


# Data sets read from disk batch by batch, too large to hold in memory.
_STREAMS: dict[str, _Stream] = {
  "imagenet": _Stream(
    "jaxprune.data.imagenet:ImageNetLoader",
    ("imagenet", "ILSVRC2012", "ILSVRC/Data/CLS-LOC"),
    ("train", "val"),
  ),
}


def available() -> tuple[str, ...]:
  """Names accepted by :func:`load`."""
  return tuple(_SPECS)


def available_streams() -> tuple[str, ...]:
  """Names accepted by :func:`open_stream`."""
  return tuple(_STREAMS)


def open_stream(
  name: str, *, root: str | os.PathLike | None = None, split: str = "train", **loader_kwargs
):
  """Opens a data set too large for memory as its own batch loader.

  ``"imagenet"``: the folder layout ``train/<wnid>/*.JPEG``, ``val/<wnid>/*.JPEG``, read by
  :class:`jaxprune.data.imagenet.ImageNetLoader` (needs the ``imagenet`` extra, grain).

  Args:
    name: one of :func:`available_streams`.
    root: the data set folder, or a folder holding it under a usual name (``imagenet``,
      ``ILSVRC2012``, ``ILSVRC/Data/CLS-LOC``). Default: :func:`default_data_dir`.
    split: ``"train"`` or ``"val"``.
    **loader_kwargs: the loader's keywords (``batch_size``, ``process_index``,
      ``process_count``, ``num_workers``, ``seed``, ...).

  Returns:
    The loader.

  Raises:
    ValueError: unknown name or split.
    FileNotFoundError: the data cannot be found.

  Example:
    >>> train = open_stream("imagenet", root="/data", batch_size=256, num_workers=8)
  """
  if name not in _STREAMS:
    raise ValueError(f"unknown streamed data set {name!r}; available: {', '.join(_STREAMS)}")
  stream = _STREAMS[name]
  if split not in stream.splits:
    raise ValueError(f"split must be one of {stream.splits} for {name}, got {split!r}")
  path = _resolve(name, root, stream.candidates)
  module, attribute = stream.loader.split(":")
  loader_class = getattr(importlib.import_module(module), attribute)
  return loader_class(path, split, **loader_kwargs)


def default_data_dir() -> Path:
  """``$JAXPRUNE_DATA`` if set, else the ``shared/data`` folder beside the repository."""
  env = os.environ.get(DATA_ENV)
  if env:
    return Path(env).expanduser()
  return Path(__file__).resolve().parents[3] / "shared" / "data"


def _resolve(name: str, root: str | os.PathLike | None, candidates: tuple[str, ...]) -> Path:
  if root is None:
    base = default_data_dir()
    if base.is_file():
      return base
    for candidate in candidates:
      if (base / candidate).exists():
        return base / candidate
    raise FileNotFoundError(
      f"no {name} data found: looked for {', '.join(candidates)} in {base}; "
      f"pass root=... or set ${DATA_ENV}"
    )
  path = Path(root).expanduser()
  if not path.exists():
    raise FileNotFoundError(f"{name}: root {path} does not exist")
  if path.is_dir():
    for candidate in candidates:
      if (path / candidate).exists():
        return path / candidate
  return path


def load(
  name: str,
  *,
  root: str | os.PathLike | None = None,
  split: str = "train",
  cache_dir: str | os.PathLike | None = None,
) -> Dataset:
  """Loads one split of a named data set into memory.

  Names: ``"cifar10"`` (JPEG folder/tarball or the official pickles, detected),
  ``"cifar100"`` / ``"cifar100-coarse"`` (official pickles, fine or coarse labels),
  ``"digits"`` (scikit-learn's 8x8 digits, embedded, 80/20 stratified seeded split) and
  ``"tiny-imagenet"`` (standard folder layout or zip; ``"test"`` is its labelled val set).

  Args:
    name: one of :func:`available`.
    root: a data set folder/archive, or a folder holding one under its usual name
      (``cifar10-jpeg.tar.gz``, ``cifar-10-batches-py``, ``cifar-100-python``,
      ``tiny-imagenet-200`` ...). Default: :func:`default_data_dir`.
    split: ``"train"`` or ``"test"``.
    cache_dir: where decoded JPEG data sets are cached (default ``$JAXPRUNE_CACHE`` or
      ``~/.cache/jaxprune``). Decoding happens once per source file; later calls read the cache.

  Returns:
    A :class:`Dataset`; ``mean``/``std`` are the training split's, for both splits.

  Raises:
    ValueError: unknown name or split, or a corrupt/unrecognised layout.
    FileNotFoundError: the data cannot be found.

  Example:
    >>> from jaxprune import data
    >>> train = data.load("digits")
    >>> train.images.shape[1:], train.num_classes
    ((8, 8, 1), 10)
  """
  if name in _STREAMS:
    raise ValueError(f"{name} does not fit in memory: open it with open_stream({name!r}, ...)")
  if name not in _SPECS:
    raise ValueError(f"unknown data set name {name!r}; available: {', '.join(_SPECS)}")
  spec = _SPECS[name]
  if split not in spec.splits:
    raise ValueError(f"split must be one of {spec.splits} for {name}, got {split!r}")
  if spec.candidates is None:
    if root is not None:
      raise ValueError(f"{name} is embedded (no files); root must be None, got {root!r}")
    path = None
  else:
    path = _resolve(name, root, spec.candidates)
  splits = spec.read(path, default_cache_dir(cache_dir))
  if split == "train":
    images, labels = splits.train_images, splits.train_labels
  else:
    images, labels = splits.test_images, splits.test_labels
  return Dataset(
    images=images,
    labels=labels,
    num_classes=len(splits.class_names),
    class_names=splits.class_names,
    mean=splits.mean,
    std=splits.std,
    name=name,
    split="test" if split == "val" else split,
  )
