"""scikit-learn's 8x8 handwritten digits: a real data set that needs no download."""

from __future__ import annotations

import numpy as np

from jaxprune.data.dataset import Splits, make_splits

__all__ = ["read_digits"]

_TEST_FRACTION = 0.2
_SPLIT_SEED = 0


def read_digits() -> Splits:
  """The 1 797 digits as (N, 8, 8, 1) uint8, split 80/20 stratified by class with a fixed seed.

  The 17 grey levels 0..16 are scaled to 0..255 (``round(v * 255 / 16)``). Each split keeps
  scikit-learn's original order, so the split is the same on every machine and run.
  """
  from sklearn.datasets import load_digits  # imported here: only this data set needs scikit-learn
  from sklearn.model_selection import train_test_split

  bunch = load_digits()
  images = np.round(bunch.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  labels = bunch.target.astype(np.int32)
  train_index, test_index = train_test_split(
    np.arange(len(labels)), test_size=_TEST_FRACTION, stratify=labels, random_state=_SPLIT_SEED
  )
  train_index, test_index = np.sort(train_index), np.sort(test_index)
  class_names = tuple(str(int(c)) for c in bunch.target_names)
  return make_splits(
    images[train_index], labels[train_index], images[test_index], labels[test_index], class_names
  )
