"""Compression ratio and sparsity of conv kernels, and the weight-mask tables every count uses.

ClickTrain (Zhang et al., ICS'21, §6 Tab. 1) reports the compression ratio over the conv layers
only: :func:`compression_ratio` (total / nonzero weights of the 4-D leaves) and
:func:`conv_sparsity`. :func:`_mask_table` normalizes the ``masks=`` argument accepted across
:mod:`jaxprune.flops` (a pytree mirroring the params, or ``{param path: mask}``) and checks it
against the params.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxprune.paths import ParamPath, flatten_with_paths


def _shape(leaf: Any) -> tuple[int, ...]:
  """Shape of an array or of an abstract leaf (``ShapeDtypeStruct`` from ``nnx.eval_shape``)."""
  return tuple(leaf.shape) if hasattr(leaf, "shape") else tuple(np.shape(leaf))


def _mask_table(masks: Any, params_by_path: Mapping[ParamPath, Any]) -> dict[ParamPath, np.ndarray]:
  """Normalizes ``masks`` to ``{param path: bool array}`` and validates it against the params.

  ``masks`` is either a pytree mirroring the params (``None`` leaves / missing entries = no
  mask), or a mapping from parameter path tuples to mask arrays (a "per-layer" mask).
  """
  if masks is None:
    return {}
  if isinstance(masks, Mapping) and masks and all(isinstance(k, tuple) for k in masks):
    items = [(tuple(k), v) for k, v in masks.items() if v is not None]
  else:
    items = flatten_with_paths(masks)
  table: dict[ParamPath, np.ndarray] = {}
  for path, mask in items:
    if path not in params_by_path:
      raise ValueError(f"masks: no parameter at path {path!r}")
    mask = np.asarray(mask)
    expected = _shape(params_by_path[path])
    if mask.shape != expected:
      raise ValueError(
        f"masks: mask at {path!r} has shape {mask.shape}, the parameter has {expected}"
      )
    table[path] = mask != 0
  return table


def _conv_counts(params: Any, masks: Any) -> tuple[int, int]:
  leaves = flatten_with_paths(params)
  params_by_path = dict(leaves)
  mask_by_path = _mask_table(masks, params_by_path)
  total = nonzero = 0
  for path, leaf in leaves:
    if len(_shape(leaf)) != 4:
      continue
    if isinstance(leaf, jax.ShapeDtypeStruct):
      raise ValueError(f"params: leaf {path!r} is abstract; nonzeros need concrete values")
    values = np.asarray(leaf)
    if path in mask_by_path:
      values = values * mask_by_path[path]
    total += values.size
    nonzero += int(np.count_nonzero(values))
  if total == 0:
    raise ValueError("params contains no conv kernels (4-D leaves)")
  return total, nonzero


def compression_ratio(params: Any, masks: Any = None) -> float:
  """Total / nonzero weights over the conv kernels (4-D leaves) — the papers' definition.

  ClickTrain (§6, Tab. 1) "calculate[s] the compression ratio only considering the
  convolutional layers". A 3×3 kernel keeping 4 of 9 weights gives 9/4; additionally removing
  a fraction p of kernels gives 9/4 · 1/(1−p).

  Args:
    params: any param pytree (NNX ``State``, pure dict, Linen dict).
    masks: optional masks (see :func:`layer_flops`); then the nonzeros of ``params * mask``
      are counted. Without masks the nonzeros of ``params`` are.

  Returns:
    ``total / nonzero``; ``math.inf`` when every conv weight is zero (all pruned).

  Raises:
    ValueError: no 4-D leaf in ``params``, or a mask does not match its parameter.
  """
  total, nonzero = _conv_counts(params, masks)
  return math.inf if nonzero == 0 else total / nonzero


def conv_sparsity(params: Any, masks: Any = None) -> float:
  """Fraction of conv-kernel weights (4-D leaves) that are zero (after masking).

  Arguments as in :func:`compression_ratio`; ``1 − 1 / compression_ratio``.
  """
  total, nonzero = _conv_counts(params, masks)
  return 1.0 - nonzero / total
