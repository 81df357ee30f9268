"""Image decoding, and the worker process that runs it for :mod:`jaxprune.data._decode`.

Run as a script (``python -P _decode_worker.py``), this file imports only NumPy and Pillow:
a worker started through :mod:`multiprocessing` would import the parent's main module and
this package, and with them JAX (seconds per worker, more than its share of CIFAR-10 takes
to decode), and would need the main script to have an ``if __name__ == "__main__":`` guard.

Protocol: the parent writes pickled tasks ``(description, names, blobs, height, width)`` to
the worker's stdin; for each, the worker writes back ``("ok", array)`` or ``("error",
message)``. The worker exits at the end of its input.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import sys
from collections.abc import Callable, Sequence

import numpy as np


def cannot_decode(description: str, name: str, err: Exception) -> ValueError:
  """The error for a file that cannot be read or is not an image."""
  return ValueError(f"{description}: cannot decode {name} ({err})")


def decode_into(
  out: np.ndarray,
  description: str,
  names: Sequence[str],
  read: Callable[[int], bytes | memoryview],
  height: int,
  width: int,
) -> None:
  """Decodes file ``i`` of ``names``, whose bytes ``read(i)`` returns, into ``out[i]``.

  Args:
    out: a ``(len(names), height, width, 3)`` uint8 array.
    description: what holds the files, for error messages ("archive ...").
    names: the files' names, for error messages.
    read: the bytes of file ``i``.
    height: every image's height in pixels.
    width: every image's width in pixels.

  Raises:
    ValueError: a file is not a decodable image, or has the wrong size.
  """
  from PIL import Image, UnidentifiedImageError  # imported here: only decoding needs Pillow

  for i, name in enumerate(names):
    try:
      with Image.open(io.BytesIO(read(i))) as image:
        if image.size != (width, height):
          raise ValueError(
            f"{description}: {name} is {image.size[0]}x{image.size[1]}, expected {width}x{height}"
          )
        if image.mode != "RGB":  # greyscale or palette (Tiny ImageNet has some)
          image = image.convert("RGB")
        out[i] = np.asarray(image)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
      raise cannot_decode(description, name, err) from err


def _serve() -> None:
  # Results go out through a copy of stdout, and stdout itself to stderr: nothing a library
  # prints can corrupt the stream of pickles.
  results = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
  os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
  tasks = sys.stdin.buffer
  # Ctrl-C is the parent's to handle; it ends the workers by closing their input.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  while True:
    try:
      description, names, blobs, height, width = pickle.load(tasks)
    except EOFError:
      return
    out = np.empty((len(names), height, width, 3), dtype=np.uint8)
    try:
      decode_into(out, description, names, blobs.__getitem__, height, width)
      reply: tuple[str, object] = ("ok", out)
    except ValueError as err:
      reply = ("error", str(err))
    pickle.dump(reply, results, protocol=pickle.HIGHEST_PROTOCOL)
    results.flush()


if __name__ == "__main__":
  _serve()
