"""Atomic on-disk cache of decoded data sets (uint8 arrays in an uncompressed .npz)."""

from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from jaxprune.data.dataset import Splits

__all__ = ["default_cache_dir", "cache_path", "read_cached", "store"]

_LOG = logging.getLogger(__name__)
CACHE_ENV = "JAXPRUNE_CACHE"
# Bump when the decoded content or the file layout changes, so stale caches are ignored.
_FORMAT_VERSION = 1


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
  """``cache_dir`` if given, else ``$JAXPRUNE_CACHE``, else ``~/.cache/jaxprune``."""
  if cache_dir is not None:
    return Path(cache_dir).expanduser()
  env = os.environ.get(CACHE_ENV)
  if env:
    return Path(env).expanduser()
  return Path.home() / ".cache" / "jaxprune"


def cache_path(cache_dir: Path, name: str, fingerprint: str) -> Path:
  return cache_dir / f"{name}-v{_FORMAT_VERSION}-{fingerprint[:20]}.npz"


def read_cached(path: Path) -> Splits | None:
  """The splits cached at ``path``; None if absent or unreadable."""
  try:
    with np.load(path, allow_pickle=False) as npz:
      return Splits(
        train_images=npz["train_images"],
        train_labels=npz["train_labels"],
        test_images=npz["test_images"],
        test_labels=npz["test_labels"],
        class_names=tuple(str(c) for c in npz["class_names"]),
        mean=tuple(float(m) for m in npz["mean"]),
        std=tuple(float(s) for s in npz["std"]),
      )
  except FileNotFoundError:
    return None
  except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:
    # A damaged cache is only a missed shortcut: decode again and overwrite it.
    _LOG.warning("ignoring unreadable cache %s (%s)", path, err)
    return None


def _write_atomic(path: Path, splits: Splits) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  # Temp file in the same folder, then os.replace: readers (other processes, parallel test
  # workers) see either no file or a complete one, never a half-written one.
  fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
  try:
    with os.fdopen(fd, "wb") as tmp:
      np.savez(
        tmp,
        train_images=splits.train_images,
        train_labels=splits.train_labels,
        test_images=splits.test_images,
        test_labels=splits.test_labels,
        class_names=np.array(splits.class_names),
        mean=np.array(splits.mean),
        std=np.array(splits.std),
      )
      tmp.flush()
      os.fsync(tmp.fileno())
    os.chmod(tmp_name, 0o644)  # mkstemp makes it private; the cache may be shared
    os.replace(tmp_name, path)
  except BaseException:
    Path(tmp_name).unlink(missing_ok=True)
    raise


def store(path: Path, splits: Splits) -> Splits:
  """Caches ``splits`` at ``path`` atomically (best effort) and returns them."""
  try:
    _write_atomic(path, splits)
  except OSError as err:  # read-only or full disk: still usable, just not cached
    _LOG.warning("could not write cache %s (%s)", path, err)
  return splits
