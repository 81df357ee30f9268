"""``load(name)``: the data set registry and where each data set is looked for."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from jaxprune.data._cache import default_cache_dir
from jaxprune.data.cifar import CIFAR10_CANDIDATES, CIFAR100_CANDIDATES, read_cifar10, read_cifar100
from jaxprune.data.dataset import Dataset, Splits
from jaxprune.data.digits import read_digits
from jaxprune.data.tiny_imagenet import TINY_IMAGENET_CANDIDATES, read_tiny_imagenet

__all__ = ["available", "default_data_dir", "load", "DATA_ENV"]

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


def available() -> tuple[str, ...]:
  """Names accepted by :func:`load`."""
  return tuple(_SPECS)


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
