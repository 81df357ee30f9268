"""The options of ClickTrain's sparse execution: one validated config, defaults and checks.

:class:`SparseExecutionConfig` holds the eight options of
:func:`~jaxprune.clicktrain.execution.conversion.to_sparse_layers` and of the
:class:`~jaxprune.clicktrain.execution.hook.SparseExecution` hook, declared and checked here
once. The hook converts the model at the hard prune (ClickTrain §5.2), often hours into a run,
so an option it cannot use fails where it is written, when the config is built; what only the
model can tell (groups that divide a layer's filters, the masks) is checked at the conversion.
"""

from __future__ import annotations

import dataclasses
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import jax

import pallas_kernels
from jaxprune.clicktrain.execution.aligned_conv import check_columns
from jaxprune.clicktrain.execution.pattern_conv import BACKENDS, check_backend

__all__ = [
  "DEFAULT_THRESHOLDS",
  "THRESHOLD_MODES",
  "SparseExecutionConfig",
  "as_config",
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
  """The default dispatch on ``platform``: ``"measure"`` everywhere.

  No sparse path is known to win on any platform measured (GPU and CPU alike); ``platform`` is kept
  so a platform where one is known to win can get a fixed threshold here.
  """
  del platform
  return "measure"


def fixed_threshold(platform: str | None = None) -> float:
  """The fixed sparsity threshold of ``platform`` (default: the default backend's)."""
  platform = platform or jax.default_backend()
  return DEFAULT_THRESHOLDS.get(platform, DEFAULT_THRESHOLDS["cpu"])


def default_backend(platform: str | None = None) -> str:
  """The sparse kernel used on ``platform``.

  The Pallas kernels on GPU when this JAX still has Pallas's Triton backend
  (:func:`pallas_kernels.triton_available`), else the reference.
  """
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


# What filter_groups may be, for the messages: "from_state" only means something to the hook.
_GROUPS_FORMS = (
  "None, 'auto' or 'from_state' (SparseExecution: the groups the ClickTrain state holds), a "
  "group count, groups or a mapping of them"
)


def _check_filter_groups(filter_groups: Any) -> None:
  if filter_groups is None or isinstance(filter_groups, Mapping):
    if isinstance(filter_groups, Mapping) and not all(isinstance(k, str) for k in filter_groups):
      raise ValueError("filter_groups: a mapping's keys must be kernel paths (strings)")
    return
  if isinstance(filter_groups, str):
    if filter_groups in ("auto", "from_state"):
      return
    raise ValueError(f"filter_groups must be {_GROUPS_FORMS}, got {filter_groups!r}")
  if _is_int(filter_groups):
    if filter_groups >= 1:
      return
    raise ValueError(f"filter_groups must be a positive group count, got {filter_groups!r}")
  try:  # explicit groups: sequences of filter indices (partition checked per layer)
    groups = [[operator.index(f) for f in group] for group in filter_groups]
  except TypeError:
    raise ValueError(f"filter_groups must be {_GROUPS_FORMS}, got {filter_groups!r}") from None
  if not groups or any(not g or min(g) < 0 for g in groups):
    raise ValueError(
      f"filter_groups: groups must be non-empty sequences of filter indices >= 0, "
      f"got {filter_groups!r}"
    )


@dataclasses.dataclass(frozen=True)
class SparseExecutionConfig:
  """The options of ClickTrain's sparse execution, checked when built.

  Attributes:
    threshold: ``"measure"`` (``None``, the default: :func:`default_threshold`): time each
      layer both ways at its real input shape, in its compute dtype (forward + both
      gradients, :func:`~jaxprune.clicktrain.execution.layer_timing.time_train_pass`; layers of
      one geometry and sparsity are timed once) and keep the faster. A number in [0, 1]: the
      sparsity above which a layer goes sparse; ``"fixed"``: :func:`fixed_threshold` of the
      platform.
    backend: the fine-grained sparse backend; ``None``: :func:`default_backend`.
    nnz_per_kernel: weights per kept kernel the fine-grained layouts enforce (4 for
      ClickTrain's patterns; a 1x1 kernel keeps its single weight); ``None`` accepts any.
    input_shape: the model's input batch shape, needed to measure (a tuple once built). The
      hook's default is the training loader's batch size and ``dataset.image_shape``.
    repeats: timed calls per measurement (median).
    filter_groups: masks of ClickTrain's aligned mode: the groups (as
      :func:`~jaxprune.clicktrain.execution.aligned_layout.group_filters`, or ``"auto"``) the
      sparse layers are ``AlignedConv`` on, the same for every layer; or a mapping from each
      masked kernel's path (``jaxprune.paths.path_string``, e.g. ``"stages/0/0/conv1/conv/
      kernel"``) to its groups: :func:`~jaxprune.clicktrain.filter_partition` of the optimizer
      state, which holds the clustered partitions of ``filter_grouping="clustered"`` (the
      layer's outputs come back in the conv's filter order); ``"from_state"`` (the hook only):
      that partition, read off the optimizer state at every conversion, so a resumed or
      reconfigured run uses its own. ``None``: the fine-grained ``PatternConv``.
    check_model: with ``threshold="measure"`` (``None``: on there), when some layer measures
      faster sparse, also time the whole model's training pass all dense, as the layers chose
      and with every pruned conv sparse, and keep the fastest: switching between the dense
      convolutions and the sparse layers costs what no single layer's timing sees.
    columns: how an aligned layer of several filter groups makes its columns
      (:func:`~jaxprune.clicktrain.execution.aligned_conv.aligned_conv`): ``"per_group"`` or
      ``"shared"``; ``None`` (default): both timed and the faster kept (under a fixed
      threshold: per group).

  Raises:
    ValueError: naming the option: a threshold that is not a sparsity in [0, 1],
      ``"measure"`` or ``"fixed"``; an unknown or unusable backend (``"pallas"`` where this JAX
      has no Pallas Triton backend); ``nnz_per_kernel`` or ``repeats`` not a positive int;
      ``input_shape`` not a sequence of positive ints; an unknown ``filter_groups`` name (e.g.
      ``"from-state"``), a group count below 1 or groups that are not index sequences;
      ``check_model`` not a bool, or on without measuring; bad ``columns``.
  """

  threshold: float | str | None = None
  backend: str | None = None
  nnz_per_kernel: int | None = 4
  input_shape: tuple[int, ...] | None = None
  repeats: int = 3
  filter_groups: Any = None
  check_model: bool | None = None
  columns: str | None = None

  def __post_init__(self):
    _check_threshold(self.threshold)
    if self.backend is not None:
      check_backend(self.backend)
    nnz = self.nnz_per_kernel
    if nnz is not None and not (_is_int(nnz) and nnz >= 1):
      raise ValueError(f"nnz_per_kernel must be a positive int or None, got {nnz!r}")
    if self.input_shape is not None:
      try:
        dims = tuple(self.input_shape)
      except TypeError:
        dims = None
      if not dims or not all(_is_int(d) and d >= 1 for d in dims):
        raise ValueError(
          f"input_shape must be a sequence of positive ints, got {self.input_shape!r}"
        )
      object.__setattr__(self, "input_shape", tuple(int(d) for d in dims))
    if not (_is_int(self.repeats) and self.repeats >= 1):
      raise ValueError(f"repeats must be a positive int, got {self.repeats!r}")
    _check_filter_groups(self.filter_groups)
    if self.check_model is not None and not isinstance(self.check_model, bool):
      raise ValueError(f"check_model must be True, False or None, got {self.check_model!r}")
    if self.check_model and self.threshold not in (None, "measure"):
      raise ValueError("check_model: the whole-model check needs threshold='measure'")
    check_columns(self.columns, optional=True)

  def _threshold(self) -> float | str:
    return default_threshold() if self.threshold is None else self.threshold

  def measures(self) -> bool:
    """Each layer is timed both ways (``threshold`` ``"measure"``, the default)."""
    return self._threshold() == "measure"

  def fixed_sparsity(self) -> float:
    """The sparsity above which a layer goes sparse, for a config that does not measure."""
    threshold = self._threshold()
    return fixed_threshold() if threshold == "fixed" else float(threshold)

  def sparse_backend(self) -> str:
    """The fine-grained backend: ``backend``, or the platform's :func:`default_backend`."""
    return default_backend() if self.backend is None else self.backend

  def checks_model(self) -> bool:
    """The whole-model check runs: ``check_model``, by default whenever the layers are timed."""
    return self.measures() if self.check_model is None else self.check_model


def as_config(
  config: SparseExecutionConfig | None, options: Mapping[str, Any]
) -> SparseExecutionConfig:
  """The one config of a call that takes a config or its fields as keywords.

  The call takes either a :class:`SparseExecutionConfig` or its fields as keywords.

  Raises:
    ValueError: both given, ``config`` not a :class:`SparseExecutionConfig`, or as the config.
    TypeError: a keyword that is not one of its fields.
  """
  if config is None:
    return SparseExecutionConfig(**options)
  if options:
    raise ValueError(f"pass a SparseExecutionConfig or options, not both: {sorted(options)}")
  if not isinstance(config, SparseExecutionConfig):
    raise ValueError(f"config must be a SparseExecutionConfig, got {type(config).__name__}")
  return config
