"""Uniform read access to a data set stored as a folder, a tar archive (optionally compressed) or a zip."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import io
import lzma
import os
import tarfile
import zipfile
from pathlib import Path

__all__ = ["FileTree", "open_tree"]


class FileTree:
  """Files under one root, addressed by POSIX relative names ("train/cat/0001.jpg")."""

  def __init__(self, description: str):
    self.description = description
    self._names: list[str] | None = None
    self._name_set: frozenset[str] = frozenset()

  @property
  def names(self) -> list[str]:
    """Every file, sorted. Listed on first use, so a cache hit never indexes an archive."""
    if self._names is None:
      self._names = sorted(self._list())
      self._name_set = frozenset(self._names)
    return self._names

  def __contains__(self, name: str) -> bool:
    self.names  # noqa: B018 -- lists the files on first use
    return name in self._name_set

  def read(self, name: str) -> bytes | memoryview:
    """The bytes of one file; ``FileNotFoundError`` naming it if absent."""
    if name not in self:
      raise FileNotFoundError(f"{self.description}: no file {name!r}")
    return self._read(name)

  def _list(self) -> list[str]:
    raise NotImplementedError

  def fingerprint(self) -> str:
    """A hex digest that changes whenever the stored data may have changed (cache key)."""
    raise NotImplementedError

  def _read(self, name: str) -> bytes | memoryview:
    raise NotImplementedError


class _DirTree(FileTree):
  def __init__(self, root: Path):
    self._root = root
    super().__init__(f"folder {root}")

  def _list(self) -> list[str]:
    names = []
    for dirpath, dirnames, filenames in os.walk(self._root):
      dirnames[:] = [d for d in dirnames if not d.startswith(".")]
      rel = Path(dirpath).relative_to(self._root).as_posix()
      prefix = "" if rel == "." else rel + "/"
      names.extend(prefix + f for f in filenames if not f.startswith("."))
    return names

  def _read(self, name: str) -> bytes:
    return (self._root / name).read_bytes()

  def fingerprint(self) -> str:
    # Names, sizes and modification times: cheap, and any rewrite of a file changes it.
    digest = hashlib.sha256(str(self._root.resolve()).encode())
    for name in self.names:
      stat = (self._root / name).stat()
      digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _decompress(raw: bytes, path: Path) -> bytes:
  try:
    if raw[:2] == b"\x1f\x8b":
      return gzip.decompress(raw)
    if raw[:3] == b"BZh":
      return bz2.decompress(raw)
    if raw[:6] == b"\xfd7zXZ\x00":
      return lzma.decompress(raw)
  except (OSError, EOFError, lzma.LZMAError) as err:
    raise ValueError(f"{path}: corrupt compressed archive ({err})") from err
  return raw


class _TarTree(FileTree):
  def __init__(self, path: Path):
    self._path = path
    self._raw = path.read_bytes()
    self._digest = hashlib.sha256(self._raw).hexdigest()
    self._data = memoryview(b"")
    self._spans: dict[str, tuple[int, int]] = {}
    super().__init__(f"archive {path}")

  def _list(self) -> list[str]:
    # Decompress once into memory: random access into a gzip stream would re-inflate it.
    self._data = memoryview(_decompress(self._raw, self._path))
    try:
      with tarfile.open(fileobj=io.BytesIO(self._data), mode="r:") as archive:
        for member in archive:
          if member.isfile():
            name = member.name.removeprefix("./")
            self._spans[name] = (member.offset_data, member.size)
    except tarfile.TarError as err:
      raise ValueError(f"{self._path}: not a readable tar archive ({err})") from err
    return list(self._spans)

  def _read(self, name: str) -> memoryview:
    offset, size = self._spans[name]
    return self._data[offset : offset + size]

  def fingerprint(self) -> str:
    return self._digest


class _ZipTree(FileTree):
  def __init__(self, path: Path):
    raw = path.read_bytes()
    self._digest = hashlib.sha256(raw).hexdigest()
    try:
      self._zip = zipfile.ZipFile(io.BytesIO(raw))
    except zipfile.BadZipFile as err:
      raise ValueError(f"{path}: not a readable zip archive ({err})") from err
    super().__init__(f"archive {path}")

  def _list(self) -> list[str]:
    return [info.filename for info in self._zip.infolist() if not info.is_dir()]

  def _read(self, name: str) -> bytes:
    return self._zip.read(name)

  def fingerprint(self) -> str:
    return self._digest


def open_tree(path: Path) -> FileTree:
  """Opens a folder, ``.tar[.gz|.bz2|.xz]``/``.tgz`` or ``.zip`` as a :class:`FileTree`.

  Raises:
    FileNotFoundError: ``path`` does not exist.
    ValueError: ``path`` is a file but not a readable archive.
  """
  if not path.exists():
    raise FileNotFoundError(f"{path} does not exist")
  if path.is_dir():
    return _DirTree(path)
  if zipfile.is_zipfile(path):
    return _ZipTree(path)
  return _TarTree(path)
