"""Decoding many small image files into one uint8 NHWC array, on every core.

The files are read here and their bytes sent, in contiguous chunks, to worker processes that
run :mod:`jaxprune.data._decode_worker` as a script: a
:class:`~jaxprune.data._archive.FileTree` holds the whole decompressed archive and is not
meant to be pickled, each worker opening the archive again would repeat its decompression
and listing, and a fresh interpreter (not a fork) is safe while JAX runs threads here.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import numbers
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxprune.data import _decode_worker
from jaxprune.data._archive import FileTree
from jaxprune.data._decode_worker import cannot_decode, decode_into

__all__ = ["check_processes", "decode_images", "default_processes"]

_LOG = logging.getLogger(__name__)
# A worker starts a Python and imports NumPy and Pillow (a few tenths of a second of CPU),
# while one 32x32 JPEG decodes in about 0.2 ms: fewer images per process than this would
# spend a large part of the time saved on starting workers.
_MIN_IMAGES_PER_PROCESS = 2000
# Chunks per process: several, so that a process slowed by other work on its core leaves the
# rest to the others, but few, so that each transfer is a large one.
_CHUNKS_PER_PROCESS = 4


def default_processes() -> int:
  """The cores this process may run on.

  Its CPU affinity where the OS reports it: a container or ``taskset`` may allow fewer than
  ``os.cpu_count()``.
  """
  try:
    return max(1, len(os.sched_getaffinity(0)))
  except (AttributeError, OSError):  # not on Linux
    return os.cpu_count() or 1


def check_processes(processes: int | None) -> int:
  """``processes`` as a count: :func:`default_processes` for None.

  Raises:
    ValueError: ``processes`` is not a positive int or None.
  """
  if processes is None:
    return default_processes()
  if isinstance(processes, bool) or not isinstance(processes, numbers.Integral) or processes < 1:
    raise ValueError(
      f"processes must be a positive int (1 decodes in this process) or None, got {processes!r}"
    )
  return int(processes)


def _pool_size(requested: int, num_images: int) -> int:
  """Processes worth starting for ``num_images``; 1 when decoding here is quicker."""
  size = min(requested, num_images // _MIN_IMAGES_PER_PROCESS)
  return size if size >= 2 and sys.executable else 1


def _read_chunk(tree: FileTree, names: Sequence[str]) -> list[bytes]:
  """The bytes of ``names``, copied (a memoryview into the archive does not pickle)."""
  blobs = []
  for name in names:
    try:
      blobs.append(bytes(tree.read(name)))
    except OSError as err:  # reported as decoding in this process reports it
      raise cannot_decode(tree.description, name, err) from err
  return blobs


class _Worker:
  """One decoding process, fed one task at a time."""

  def __init__(self):
    # -P: the script's own folder is not put on sys.path, where its sibling modules could
    # shadow the ones NumPy and Pillow import.
    self._process = subprocess.Popen(
      [sys.executable, "-P", str(Path(_decode_worker.__file__))],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
    )

  def decode(self, task: tuple) -> np.ndarray:
    """Sends ``task`` and returns the decoded chunk.

    Raises:
      ValueError: the worker could not decode a file (its message, unchanged).
      RuntimeError: the worker died.
    """
    try:
      pickle.dump(task, self._process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
      self._process.stdin.flush()
      status, value = pickle.load(self._process.stdout)
    except (BrokenPipeError, EOFError) as err:
      code = self._process.wait()
      raise RuntimeError(
        f"an image decoding worker process exited with code {code} (its error, if any, is "
        "above); decode in this process with processes=1"
      ) from err
    if status == "error":
      raise ValueError(value)
    return value

  def close(self) -> None:
    """Ends the process: it exits at the end of its input; killed if it does not soon."""
    for stream in (self._process.stdin, self._process.stdout):
      try:
        stream.close()
      except OSError:  # a pipe broken by a worker that died
        pass
    try:
      self._process.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self._process.kill()
      self._process.wait()


def _decode_parallel(
  tree: FileTree, names: Sequence[str], height: int, width: int, processes: int
) -> np.ndarray:
  out = np.empty((len(names), height, width, 3), dtype=np.uint8)
  bounds = np.linspace(0, len(names), processes * _CHUNKS_PER_PROCESS + 1).astype(int)
  spans = [(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds) if hi > lo]
  idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
  workers = []
  try:
    for _ in range(processes):
      workers.append(_Worker())
      idle.put(workers[-1])

    failed = threading.Event()

    def decode_span(span: tuple[int, int]) -> None:
      # One thread per worker: each sends a chunk and waits for it, the pipes' transfers
      # releasing the GIL to the others.
      if failed.is_set():  # the data set has failed: decode no more of it
        return
      lo, hi = span
      try:
        task = (tree.description, names[lo:hi], _read_chunk(tree, names[lo:hi]), height, width)
        worker = idle.get()
        try:
          out[lo:hi] = worker.decode(task)
        finally:
          idle.put(worker)  # even a dead one: the next task then fails fast instead of waiting
      except BaseException:
        failed.set()
        raise

    with concurrent.futures.ThreadPoolExecutor(processes) as threads:
      try:
        for _ in threads.map(decode_span, spans):
          pass
      except BaseException:  # a chunk failed, or Ctrl-C: the chunks under way finish, no more
        failed.set()
        raise
  finally:
    for worker in workers:
      worker.close()
  return out


def decode_images(
  tree: FileTree,
  names: Sequence[str],
  height: int,
  width: int,
  *,
  processes: int | None = None,
) -> np.ndarray:
  """Decodes the image files ``names`` of ``tree`` into one array, in order.

  Greyscale or palette images are converted to RGB (Tiny ImageNet has some); any other
  size is an error, since silently resizing would change the data set. The result does not
  depend on ``processes``.

  Args:
    tree: the folder or archive holding the files.
    names: the files, as ``tree`` names them.
    height: every image's height in pixels.
    width: every image's width in pixels.
    processes: how many worker processes decode: ``None`` for one per core this process may
      use (:func:`default_processes`), ``1`` to decode in this process. Fewer are started
      when there are too few images to repay their start.

  Returns:
    A ``(len(names), height, width, 3)`` uint8 array.

  Raises:
    ValueError: ``processes`` is not a positive int or None; a file is not a decodable
      image, or has the wrong size (the message names the file).
    RuntimeError: a worker process died (killed, out of memory).
  """
  pool_size = _pool_size(check_processes(processes), len(names))
  start = time.perf_counter()
  if pool_size == 1:
    out = np.empty((len(names), height, width, 3), dtype=np.uint8)
    decode_into(out, tree.description, names, lambda i: tree.read(names[i]), height, width)
  else:
    out = _decode_parallel(tree, names, height, width, pool_size)
  _LOG.info(
    "decoded %d images in %.1f s (%d processes)", len(names), time.perf_counter() - start, pool_size
  )
  return out
