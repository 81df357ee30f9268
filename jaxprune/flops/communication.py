"""Gradient all-reduce volume per device and step (PruneTrain §5 Fig. 11, ClickTrain §5.3).

:func:`allreduce_bytes` applies the ring all-reduce model to the weight gradients, counting only
the kept entries when masks are given (ClickTrain's sparse all-reduce).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxprune.flops.sparsity import _mask_table, _shape
from jaxprune.paths import flatten_with_paths


def _dtype(leaf: Any) -> np.dtype:
  return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def allreduce_bytes(params: Any, num_devices: int, masks: Any = None) -> float:
  """Bytes each device sends per step to all-reduce the weight gradients (ring all-reduce).

  PruneTrain §5 (Fig. 11) models communication with ring all-reduce: each of ``p`` devices
  sends (and receives) ``2 (p − 1) / p × gradient bytes``. With ``masks`` only the kept
  gradient entries are reduced (ClickTrain §5.3's sparse all-reduce; the fixed positions are
  known to every device, so no index traffic is counted).

  Args:
    params: the parameter pytree (every leaf is a gradient that is reduced).
    num_devices: ``p`` ≥ 1; one device communicates nothing.
    masks: optional masks (see :func:`layer_flops`).

  Returns:
    Bytes per device per step.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
    raise ValueError(f"num_devices must be an int, got {num_devices!r}")
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  leaves = flatten_with_paths(params)
  mask_by_path = _mask_table(masks, dict(leaves))
  gradient_bytes = 0
  for path, leaf in leaves:
    itemsize = _dtype(leaf).itemsize
    entries = (
      int(np.count_nonzero(mask_by_path[path])) if path in mask_by_path else math.prod(_shape(leaf))
    )
    gradient_bytes += entries * itemsize
  return 2.0 * (num_devices - 1) / num_devices * gradient_bytes
