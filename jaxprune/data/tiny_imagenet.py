"""Tiny ImageNet (200 classes, 64x64) from its standard folder layout or zip."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

import numpy as np

from jaxprune.data import _cache
from jaxprune.data._archive import FileTree, open_tree
from jaxprune.data._decode import check_processes, decode_images
from jaxprune.data.dataset import Splits, make_splits

__all__ = ["read_tiny_imagenet"]

TINY_IMAGENET_CANDIDATES = ("tiny-imagenet-200", "tiny-imagenet-200.zip")
_SIZE = 64


def _natural_key(name: str) -> tuple[object, ...]:
  # n01443537_10.JPEG after n01443537_9.JPEG, as the files were numbered.
  return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _prefix(tree: FileTree) -> str:
  for name in tree.names:
    folder, base = posixpath.split(name)
    if base == "wnids.txt":
      prefix = folder + "/" if folder else ""
      if f"{prefix}val/val_annotations.txt" in tree:
        return prefix
  raise ValueError(
    f"{tree.description} does not hold Tiny ImageNet: expected wnids.txt and val/val_annotations.txt"
  )


def _text_lines(tree: FileTree, name: str) -> list[str]:
  return [
    line.strip() for line in bytes(tree.read(name)).decode("utf-8").splitlines() if line.strip()
  ]


def _layout(
  tree: FileTree, prefix: str
) -> tuple[tuple[str, ...], list[str], np.ndarray, list[str], np.ndarray]:
  # Classes in sorted wnid order (as torchvision's ImageFolder numbers them), not wnids.txt order.
  wnids = tuple(sorted(_text_lines(tree, f"{prefix}wnids.txt")))
  if len(set(wnids)) != len(wnids):
    raise ValueError(f"{tree.description}: wnids.txt lists a class twice")
  class_index = {wnid: i for i, wnid in enumerate(wnids)}

  train_names: list[str] = []
  train_labels: list[int] = []
  by_class: dict[str, list[str]] = {}
  train_prefix = f"{prefix}train/"
  for name in tree.names:
    if name.startswith(train_prefix) and name.upper().endswith(".JPEG"):
      parts = name[len(train_prefix) :].split("/")
      if len(parts) != 3 or parts[1] != "images":
        raise ValueError(
          f"{tree.description}: unexpected file {name} (expected train/<wnid>/images/*.JPEG)"
        )
      if parts[0] not in class_index:
        raise ValueError(
          f"{tree.description}: {name} is in class {parts[0]!r}, absent from wnids.txt"
        )
      by_class.setdefault(parts[0], []).append(name)
  empty = [wnid for wnid in wnids if wnid not in by_class]
  if empty:
    raise ValueError(
      f"{tree.description}: no training images for {len(empty)} classes, e.g. {empty[:3]}"
    )
  for wnid in wnids:
    files = sorted(by_class[wnid], key=_natural_key)
    train_names.extend(files)
    train_labels.extend([class_index[wnid]] * len(files))

  val_names: list[str] = []
  val_labels: list[int] = []
  for line in _text_lines(tree, f"{prefix}val/val_annotations.txt"):
    fields = line.split("\t")
    if len(fields) < 2 or fields[1] not in class_index:
      raise ValueError(f"{tree.description}: bad line in val_annotations.txt: {line!r}")
    val_names.append(f"{prefix}val/images/{fields[0]}")
    val_labels.append(class_index[fields[1]])
  missing = [name for name in val_names if name not in tree]
  if missing:
    raise ValueError(
      f"{tree.description}: {len(missing)} validation images missing, e.g. {missing[0]}"
    )
  return (
    wnids,
    train_names,
    np.asarray(train_labels, np.int32),
    val_names,
    np.asarray(val_labels, np.int32),
  )


def read_tiny_imagenet(path: Path, cache_dir: Path, *, processes: int | None = None) -> Splits:
  """Reads Tiny ImageNet; its labelled ``val`` set serves as the test split.

  Layout (folder or zip): ``wnids.txt``, ``train/<wnid>/images/*.JPEG``, ``val/images/*.JPEG``
  with ``val/val_annotations.txt``. Class index = position in sorted wnids; training images in
  class order then file number; validation images in annotation-file order. Greyscale images are
  converted to RGB. Decoded once and cached under ``cache_dir``, by ``processes`` processes
  (see :func:`~jaxprune.data._decode.decode_images`; default one per core).

  Raises:
    ValueError: the layout is incomplete or an image is not 64x64, or ``processes`` is not a
      positive int or None.
  """
  check_processes(processes)  # here, not only when a cold cache decodes
  tree = open_tree(path)
  cache_file = _cache.cache_path(cache_dir, "tiny-imagenet", tree.fingerprint())
  cached = _cache.read_cached(cache_file)
  if cached is not None:
    return cached
  wnids, train_names, train_labels, val_names, val_labels = _layout(tree, _prefix(tree))
  train_images = decode_images(tree, train_names, _SIZE, _SIZE, processes=processes)
  val_images = decode_images(tree, val_names, _SIZE, _SIZE, processes=processes)
  return _cache.store(
    cache_file, make_splits(train_images, train_labels, val_images, val_labels, wnids)
  )
