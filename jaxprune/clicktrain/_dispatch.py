"""The dispatch options of :mod:`jaxprune.clicktrain.sparse_execution`: defaults and checks.

:class:`~jaxprune.clicktrain.sparse_execution.SparseExecution` converts the model at the hard
prune (ClickTrain §5.2), often hours into a run; an option it cannot use must fail where it is
written, not there. :func:`check_dispatch_options` checks every option of
:func:`~jaxprune.clicktrain.sparse_execution.convert_model` and of the hook when they are
built; what only the model can tell (groups that divide a layer's filters, the masks) is
checked at the conversion.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Mapping
from typing import Any

import jax

import pallas_kernels
from jaxprune.clicktrain.aligned_conv import check_columns
from jaxprune.clicktrain.pattern_conv import BACKENDS, check_backend

__all__ = [
  "DEFAULT_THRESHOLDS",
  "THRESHOLD_MODES",
  "check_dispatch_options",
  "default_backend",
  "default_threshold",
  "fixed_threshold",
]

# Fixed sparsity thresholds (``threshold="fixed"``): above it a layer runs the sparse path.
# GPU: the paper's 65% (§5.2). CPU: the reference SpMM is slower than XLA's dense convolution
# at every ClickTrain sparsity measured, so 1.0, which no sparsity exceeds (a layer goes sparse
# when its sparsity is strictly above the threshold).
DEFAULT_THRESHOLDS = {"gpu": 0.65, "cpu": 1.0}

# The threshold's named modes: time each layer, or the platform's fixed threshold.
THRESHOLD_MODES = ("measure", "fixed")


def default_threshold(platform: str | None = None) -> str:
  """The default dispatch on ``platform``: ``"measure"`` everywhere, since no sparse path is
  known to win on any platform measured (GPU and CPU alike); ``platform`` is kept so a
  platform where one is known to win can get a fixed threshold here."""
  del platform
  return "measure"


def fixed_threshold(platform: str | None = None) -> float:
  """The fixed sparsity threshold of ``platform`` (default: the default backend's)."""
  platform = platform or jax.default_backend()
  return DEFAULT_THRESHOLDS.get(platform, DEFAULT_THRESHOLDS["cpu"])


def default_backend(platform: str | None = None) -> str:
  """The sparse kernel used on ``platform``: the Pallas kernels on GPU when this JAX still has
  Pallas's Triton backend (:func:`pallas_kernels.triton_available`), else the reference."""
  platform = platform or jax.default_backend()
  if platform == "gpu" and "pallas" in BACKENDS and pallas_kernels.triton_available():
    return "pallas"
  return "reference"


def _is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_threshold(threshold: Any) -> None:
  if threshold is None or (isinstance(threshold, str) and threshold in THRESHOLD_MODES):
    return
  if isinstance(threshold, numbers.Real) and not isinstance(threshold, bool):
    # A sparsity lies in [0, 1]: a threshold above 1 would keep every layer dense without a
    # word, one below 0 every layer sparse.
    if 0.0 <= float(threshold) <= 1.0:
      return
    raise ValueError(f"threshold must be a sparsity in [0, 1], got {threshold!r}")
  raise ValueError(
    f"threshold must be a sparsity in [0, 1], 'measure' or 'fixed', got {threshold!r}"
  )


def _check_filter_groups(filter_groups: Any, from_state: bool) -> None:
  names = ("'auto'", "'from_state'") if from_state else ("'auto'",)
  if filter_groups is None or isinstance(filter_groups, Mapping):
    if isinstance(filter_groups, Mapping) and not all(isinstance(k, str) for k in filter_groups):
      raise ValueError("filter_groups: a mapping's keys must be kernel paths (strings)")
    return
  if isinstance(filter_groups, str):
    if filter_groups == "auto" or (from_state and filter_groups == "from_state"):
      return
    raise ValueError(
      f"filter_groups must be None, {' or '.join(names)}, a group count, groups or a "
      f"mapping of them, got {filter_groups!r}"
    )
  if _is_int(filter_groups):
    if filter_groups >= 1:
      return
    raise ValueError(f"filter_groups must be a positive group count, got {filter_groups!r}")
  try:  # explicit groups: sequences of filter indices (partition checked per layer)
    groups = [[operator.index(f) for f in group] for group in filter_groups]
  except TypeError:
    raise ValueError(
      f"filter_groups must be None, {' or '.join(names)}, a group count, groups or a "
      f"mapping of them, got {filter_groups!r}"
    ) from None
  if not groups or any(not g or min(g) < 0 for g in groups):
    raise ValueError(
      f"filter_groups: groups must be non-empty sequences of filter indices >= 0, "
      f"got {filter_groups!r}"
    )


def check_dispatch_options(
  *,
  threshold: Any,
  backend: Any,
  nnz_per_kernel: Any,
  input_shape: Any,
  repeats: Any,
  filter_groups: Any,
  check_model: Any,
  columns: Any,
  from_state: bool = False,
) -> None:
  """Checks the options of ``convert_model`` / ``SparseExecution`` before any model is seen.

  Args:
    threshold, backend, nnz_per_kernel, input_shape, repeats, filter_groups, check_model,
      columns: as :func:`~jaxprune.clicktrain.sparse_execution.convert_model`.
    from_state: ``filter_groups="from_state"`` is allowed (the hook reads the groups off the
      optimizer state; ``convert_model`` has none).

  Raises:
    ValueError: naming the option: a threshold that is not a sparsity in [0, 1],
      ``"measure"`` or ``"fixed"``; an unknown or unusable backend; ``nnz_per_kernel`` or
      ``repeats`` not a positive int; ``input_shape`` not a sequence of positive ints; an
      unknown ``filter_groups`` name (e.g. ``"from-state"``), a group count below 1 or groups
      that are not index sequences; ``check_model`` not a bool, or on without measuring; bad
      ``columns``.
  """
  _check_threshold(threshold)
  if backend is not None:
    check_backend(backend)
  if nnz_per_kernel is not None and not (_is_int(nnz_per_kernel) and nnz_per_kernel >= 1):
    raise ValueError(f"nnz_per_kernel must be a positive int or None, got {nnz_per_kernel!r}")
  if input_shape is not None:
    try:
      dims = tuple(input_shape)
    except TypeError:
      dims = None
    if not dims or not all(_is_int(d) and d >= 1 for d in dims):
      raise ValueError(f"input_shape must be a sequence of positive ints, got {input_shape!r}")
  if not (_is_int(repeats) and repeats >= 1):
    raise ValueError(f"repeats must be a positive int, got {repeats!r}")
  _check_filter_groups(filter_groups, from_state)
  if check_model is not None and not isinstance(check_model, bool):
    raise ValueError(f"check_model must be True, False or None, got {check_model!r}")
  if check_model and threshold not in (None, "measure"):
    raise ValueError("check_model: the whole-model check needs threshold='measure'")
  check_columns(columns, optional=True)
