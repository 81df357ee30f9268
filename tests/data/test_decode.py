"""Tests for parallel image decoding (jaxprune.data._decode): the worker processes give the
serial decode's bytes and errors, small jobs and ``processes=1`` start none, bad counts are
refused, and a worker that dies is reported."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxprune.data import _decode, _decode_worker, cifar
from jaxprune.data._archive import open_tree

_SIZE = 16


def _image_bytes(seed: int, mode: str, size=(_SIZE, _SIZE)) -> tuple[str, bytes]:
  """A noisy image (something to decode) of ``mode``; palette and RGBA as PNG."""
  rng = np.random.default_rng(seed)
  pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
  image = Image.fromarray(pixels)
  if mode == "L":
    image = image.convert("L")
  elif mode == "P":
    image = image.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
  elif mode == "RGBA":
    image.putalpha(128)
  suffix = "png" if mode in ("P", "RGBA") else "jpg"
  buffer = io.BytesIO()
  image.save(buffer, format="PNG" if suffix == "png" else "JPEG", quality=90)
  return suffix, buffer.getvalue()


def _tarball(
  path: Path, count: int, replace: dict[int, bytes] | None = None
) -> tuple[Path, list[str]]:
  """``count`` images (every 7th greyscale, every 11th palette, every 13th RGBA) in a tar.gz,
  written in reverse order; file ``i`` is ``replace[i]`` where given."""
  modes = ["L" if i % 7 == 3 else "P" if i % 11 == 5 else "RGBA" if i % 13 == 6 else "RGB"
           for i in range(count)]  # fmt: skip
  files = {}
  for i, mode in enumerate(modes):
    suffix, blob = _image_bytes(i, mode)
    files[f"images/{i:04d}.{suffix}"] = (replace or {}).get(i, blob)
  with tarfile.open(path, "w:gz") as archive:
    for name, blob in reversed(files.items()):
      info = tarfile.TarInfo(name)
      info.size = len(blob)
      archive.addfile(info, io.BytesIO(blob))
  return path, list(files)


@pytest.fixture
def workers_started(monkeypatch):
  """Every job gets a pool however small, and the list counts the workers started."""
  started = []
  original = _decode._Worker.__init__

  def counting_init(self):
    started.append(self)
    original(self)

  monkeypatch.setattr(_decode, "_MIN_IMAGES_PER_PROCESS", 1)
  monkeypatch.setattr(_decode._Worker, "__init__", counting_init)
  return started


def test_parallel_decode_equals_serial(tmp_path, workers_started):
  path, names = _tarball(tmp_path / "images.tar.gz", 120)
  tree = open_tree(path)
  serial = _decode.decode_images(tree, names, _SIZE, _SIZE, processes=1)
  assert not workers_started
  parallel = _decode.decode_images(tree, names, _SIZE, _SIZE, processes=3)
  assert len(workers_started) == 3
  assert parallel.dtype == np.uint8 and parallel.shape == (120, _SIZE, _SIZE, 3)
  assert parallel.tobytes() == serial.tobytes()
  # Greyscale and palette images were converted, not passed through as they are stored.
  grey = serial[3]
  assert (grey[..., 0] == grey[..., 1]).all() and (grey[..., 0] == grey[..., 2]).all()
  assert len(np.unique(serial[5].reshape(-1, 3), axis=0)) <= 16
  # Out of a folder too, and with more processes than chunks of work need.
  folder = tmp_path / "folder"
  with tarfile.open(path) as archive:
    archive.extractall(folder, filter="data")
  from_folder = _decode.decode_images(open_tree(folder), names[:3], _SIZE, _SIZE, processes=4)
  assert from_folder.tobytes() == serial[:3].tobytes()


@pytest.mark.parametrize(
  "bad, message",
  [
    (b"garbage", r"cannot decode images/0077\.jpg \(cannot identify image file"),
    (_image_bytes(0, "RGB", (_SIZE + 1, _SIZE))[1], r"images/0077\.jpg is 17x16, expected 16x16"),
  ],
)
def test_parallel_errors_name_the_file(tmp_path, workers_started, bad, message):
  path, names = _tarball(tmp_path / "images.tar.gz", 80, {77: bad})
  tree = open_tree(path)
  with pytest.raises(ValueError, match=message) as serial:
    _decode.decode_images(tree, names, _SIZE, _SIZE, processes=1)
  with pytest.raises(ValueError, match=message) as parallel:
    _decode.decode_images(tree, names, _SIZE, _SIZE, processes=2)
  # The same message (Pillow's names its BytesIO, at an address of its own in each process).
  same_message = [re.sub(r"0x[0-9a-f]+", "0x?", str(e.value)) for e in (serial, parallel)]
  assert workers_started and same_message[0] == same_message[1]
  assert str(parallel.value).startswith(f"archive {path}: ")


def test_small_jobs_decode_here(tmp_path, monkeypatch):
  def no_workers(self):
    raise AssertionError("started a worker process")

  monkeypatch.setattr(_decode._Worker, "__init__", no_workers)
  path, names = _tarball(tmp_path / "images.tar.gz", 40)
  tree = open_tree(path)
  assert _decode.decode_images(tree, names, _SIZE, _SIZE).shape == (40, _SIZE, _SIZE, 3)
  assert _decode._pool_size(16, 40) == 1
  assert _decode._pool_size(16, 5 * _decode._MIN_IMAGES_PER_PROCESS) == 5
  assert _decode._pool_size(16, 100 * _decode._MIN_IMAGES_PER_PROCESS) == 16
  assert _decode._pool_size(1, 100 * _decode._MIN_IMAGES_PER_PROCESS) == 1


@pytest.mark.parametrize("bad", [0, -2, 1.5, "4", True])
def test_bad_process_counts(tmp_path, bad):
  path, names = _tarball(tmp_path / "images.tar.gz", 2)
  with pytest.raises(ValueError, match="processes must be a positive int"):
    _decode.decode_images(open_tree(path), names, _SIZE, _SIZE, processes=bad)
  # Refused before any cache lookup, so a warm cache does not hide the mistake.
  with pytest.raises(ValueError, match="processes must be a positive int"):
    cifar.read_cifar10(path, tmp_path / "cache", processes=bad)
  assert _decode.default_processes() >= 1


def test_dead_worker_is_reported(tmp_path, workers_started, monkeypatch):
  script = tmp_path / "dies.py"
  script.write_text("import sys\nsys.exit(3)\n")
  monkeypatch.setattr(_decode_worker, "__file__", str(script))
  path, names = _tarball(tmp_path / "images.tar.gz", 20)
  with pytest.raises(RuntimeError, match="exited with code 3"):
    _decode.decode_images(open_tree(path), names, _SIZE, _SIZE, processes=2)
