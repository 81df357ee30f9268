"""The validated settings of one :func:`jaxprune.clicktrain.clicktrain` transform.

Every argument of ``clicktrain()`` except the inner optimizer and the epoch settings becomes one
field of the frozen :class:`Config`, checked once when it is built; the epoch settings are its
``schedule`` (:class:`~jaxprune.clicktrain.schedule.Schedule`). The transform reads nothing else.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxprune.clicktrain import patterns as _pat
from jaxprune.clicktrain.schedule import Schedule, check_int
from jaxprune.clicktrain.state import PATTERN_SIZE

__all__ = [
  "FILTER_GROUPINGS",
  "GROUP_LASSO_RAMPS",
  "Config",
  "LayerFilter",
  "RatioSpec",
  "check_ratio",
  "choose_layer",
  "default_layer_filter",
]

# How the aligned mode's filter groups are formed (clicktrain's filter_grouping).
FILTER_GROUPINGS = ("consecutive", "clustered")
# How the group lasso's coefficient grows over the regularize stage (clicktrain's
# group_lasso_ramp): held (the paper), or from 0 to the coefficient, linearly or cubically.
GROUP_LASSO_RAMPS = ("constant", "linear", "cubic")

LayerFilter = Callable[[str, tuple[int, ...]], "str | None"]
# One float for every layer, one per pruned layer (param flatten order), or fn(path, shape).
RatioSpec = float | tuple[float, ...] | Callable[[str, tuple[int, ...]], float]


def default_layer_filter(path: str, shape: tuple[int, ...]) -> str | None:
  """ClickTrain's layer choice, as in the authors' released code (every conv but the stem and
  the 1x1 shortcuts), with the shortcuts known by name.

  A transform sees parameters, not the model, so this default tells a 1x1 projection shortcut
  by its path (``shortcut`` / ``downsample``, as :mod:`jaxprune.models` and torchvision name
  them). :func:`jaxprune.clicktrain.layer_filter_for` decides the same by structure (a 1x1
  conv alone on the skip path of a residual add), whatever the layers are called; the
  :func:`jaxprune.clicktrain.method` preset checks the two agree at fit start.

  Args:
    path: the param's path, keys joined by ``/``.
    shape: the param's shape (HWIO for a conv kernel).

  Returns:
    ``"pattern"`` (patterns + kernel pruning) for a square ``k x k`` kernel, ``k > 1``, with
    more than 3 input channels; ``"kernel"`` (connectivity pruning only) for other such convs
    and 1x1 convs not on a ``shortcut`` / ``downsample`` path; ``None`` (left dense) for the
    rest: non-4-D params, the stem (3 input channels) and 1x1 shortcut convs.
  """
  return choose_layer(shape, shortcut="shortcut" in path or "downsample" in path)


def choose_layer(shape: tuple[int, ...], *, shortcut: bool) -> str | None:
  """The released code's choice for a param of ``shape``; ``shortcut``: a 1x1 projection
  shortcut (left dense)."""
  if len(shape) != 4:
    return None
  kh, kw, cin, _ = shape
  if cin <= 3:  # the stem reads the image
    return None
  if kh == kw == 1:
    return None if shortcut else "kernel"
  return "pattern" if kh == kw else "kernel"


def check_ratio(r: Any, name: str | None = None) -> float:
  """A kernel prune ratio as a float in ``[0, 1]``.

  Args:
    r: the ratio.
    name: the pruned layer it is for (``None``: one ratio for all), named in the message.

  Returns:
    ``float(r)``.

  Raises:
    ValueError: a bool (an int subclass: True would prune every kernel) or a value outside
      ``[0, 1]``.
  """
  where = "" if name is None else f" for {name!r}"
  if isinstance(r, (bool, np.bool_)):
    raise ValueError(f"kernel_prune_ratio{where} must be a number in [0, 1], got {r}")
  if not 0.0 <= float(r) <= 1.0:
    raise ValueError(f"kernel_prune_ratio{where} must be in [0, 1], got {r}")
  return float(r)


@dataclasses.dataclass(frozen=True)
class Config:
  """The schedule, coefficients and layer choice of one ``clicktrain()`` (see its Args).

  Built and validated once; ``kernel_prune_ratio`` is normalised to a float, a tuple of floats
  or a callable, ``layer_filter`` to a function (the default when ``None`` is given).

  Raises:
    ValueError: a bad field, named in the message (the checks of ``clicktrain()``).
  """

  schedule: Schedule
  kernel_prune_ratio: RatioSpec
  pool_size: int
  loss_margin: float
  margin_rule: str
  group_lasso_coefficient: float
  group_lasso_ramp: str
  one_shot_patterns: int
  layer_filter: LayerFilter | None
  importance_every: int
  balanced_kernels: bool
  filter_groups: int | None
  filter_grouping: str
  eps: float

  @property
  def mode(self) -> str:
    """``"paper"`` or ``"one_shot"`` (the schedule's)."""
    return self.schedule.mode

  def __post_init__(self):
    if not isinstance(self.schedule, Schedule):
      raise ValueError(f"schedule must be a clicktrain.Schedule, got {self.schedule!r}")
    if not isinstance(self.balanced_kernels, bool):
      raise ValueError(f"balanced_kernels must be a bool, got {self.balanced_kernels!r}")
    if self.filter_groups is not None:
      check_int("filter_groups", self.filter_groups, 1)
      if isinstance(self.filter_groups, bool):
        raise ValueError(f"filter_groups must be an int >= 1, got {self.filter_groups!r}")
    if self.filter_grouping not in FILTER_GROUPINGS:
      raise ValueError(
        f"filter_grouping must be one of {FILTER_GROUPINGS}, got {self.filter_grouping!r}"
      )
    if self.filter_grouping == "clustered" and self.filter_groups is None:
      raise ValueError(
        "filter_grouping='clustered' chooses the filter groups of the aligned mode: it needs "
        "filter_groups (the number of groups)"
      )
    check_int("pool_size", self.pool_size, 1)
    check_int("importance_every", self.importance_every, 1)
    if (
      isinstance(self.one_shot_patterns, bool)
      or self.one_shot_patterns not in _pat.ONE_SHOT_POOL_SIZES
    ):
      raise ValueError(
        f"one_shot_patterns must be one of {_pat.ONE_SHOT_POOL_SIZES}, "
        f"got {self.one_shot_patterns!r}"
      )
    if self.mode == "paper":
      self._check_importance_every()
    for name in ("loss_margin", "group_lasso_coefficient", "eps"):
      v = getattr(self, name)
      if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    if self.group_lasso_ramp not in GROUP_LASSO_RAMPS:
      raise ValueError(
        f"group_lasso_ramp must be one of {GROUP_LASSO_RAMPS}, got {self.group_lasso_ramp!r}"
      )
    if self.margin_rule not in ("relative", "literal"):
      raise ValueError(f"margin_rule must be 'relative' or 'literal', got {self.margin_rule!r}")
    if self.pool_size > _pat.num_patterns(PATTERN_SIZE, 3):
      raise ValueError(f"pool_size must be <= 126, got {self.pool_size}")
    # Normalised once, so the transform reads plain values.
    set_ = object.__setattr__  # frozen: __post_init__ is the one place that may write
    set_(self, "kernel_prune_ratio", _normalise_ratio(self.kernel_prune_ratio))
    set_(self, "one_shot_patterns", int(self.one_shot_patterns))
    if self.layer_filter is None:
      set_(self, "layer_filter", default_layer_filter)

  def _check_importance_every(self) -> None:
    schedule = self.schedule
    shortest = min(schedule.pool_epochs, schedule.finalize_epochs) * schedule.steps_per_epoch
    if self.importance_every > shortest:
      # A stage of fewer steps than importance_every may hold no importance step: all-zero
      # scores, and the pool / masks would go by index.
      stage = (
        "pool_epochs" if schedule.pool_epochs <= schedule.finalize_epochs else "finalize_epochs"
      )
      raise ValueError(
        f"importance_every ({self.importance_every}) must be <= the shortest importance "
        f"stage, {stage} * steps_per_epoch = {shortest} steps, or that stage may score no batch"
      )


def _normalise_ratio(spec: Any) -> RatioSpec:
  """One float, a tuple of floats (each checked), or the callable as given (its values are
  checked per layer when the plan asks it)."""
  if isinstance(spec, (int, float, np.bool_, np.integer, np.floating)):
    return check_ratio(spec)
  if callable(spec):
    return spec
  if not isinstance(spec, Sequence) and not isinstance(spec, np.ndarray):
    raise ValueError(
      "kernel_prune_ratio must be a number, a sequence of numbers (one per pruned layer) or "
      f"fn(path, shape) -> number, got {spec!r}"
    )
  return tuple(check_ratio(r) for r in spec)
