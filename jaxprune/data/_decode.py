"""Decoding many small image files into one uint8 NHWC array."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Sequence

import numpy as np

from jaxprune.data._archive import FileTree

__all__ = ["decode_images"]

_LOG = logging.getLogger(__name__)


def decode_images(tree: FileTree, names: Sequence[str], height: int, width: int) -> np.ndarray:
  """Decodes ``names`` from ``tree`` into a (len(names), height, width, 3) uint8 array.

  Greyscale or palette images are converted to RGB (Tiny ImageNet has some); any other
  size is an error, since silently resizing would change the data set.

  Raises:
    ValueError: a file is not a decodable image, or has the wrong size.
  """
  from PIL import Image, UnidentifiedImageError  # imported here: only decoding needs Pillow

  out = np.empty((len(names), height, width, 3), dtype=np.uint8)
  start = time.perf_counter()
  for i, name in enumerate(names):
    try:
      with Image.open(io.BytesIO(tree.read(name))) as image:
        if image.size != (width, height):
          raise ValueError(
            f"{tree.description}: {name} is {image.size[0]}x{image.size[1]}, expected {width}x{height}"
          )
        if image.mode != "RGB":
          image = image.convert("RGB")
        out[i] = np.asarray(image)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
      raise ValueError(f"{tree.description}: cannot decode {name} ({err})") from err
  _LOG.info("decoded %d images in %.1f s", len(names), time.perf_counter() - start)
  return out
