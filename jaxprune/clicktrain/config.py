"""The validated settings of one :func:`jaxprune.clicktrain.clicktrain` transform.

Every argument of ``clicktrain()`` except the inner optimizer lands in the frozen
:class:`Config`, checked once when it is built: the epoch settings are its ``schedule``
(:class:`~jaxprune.clicktrain.schedule.Schedule`), the settings of one mode its sub-configs
(:class:`PaperMode`, :class:`OneShot`, :class:`Aligned`; :data:`SUB_CONFIG_KEYWORDS` maps the
keywords to their fields), and the rest its own fields. The transform reads nothing else.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxprune.clicktrain import patterns as _pat
from jaxprune.clicktrain.schedule import Schedule, check_int
from jaxprune.clicktrain.state import PATTERN_SIZE
from jaxprune.paths import path_string

__all__ = [
  "FILTER_GROUPINGS",
  "GROUP_LASSO_RAMPS",
  "SUB_CONFIG_KEYWORDS",
  "Aligned",
  "Config",
  "LayerFilter",
  "OneShot",
  "PaperMode",
  "RatioSpec",
  "RatiosByName",
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


class RatiosByName(Mapping[str, float]):
  """A read-only, hashable ``{layer path: kernel-prune ratio}`` (a ``Config`` field)."""

  def __init__(self, ratios: Mapping[str, Any]):
    for name in ratios:
      if not isinstance(name, str):
        raise ValueError(f"kernel_prune_ratio: a mapping's keys must be layer paths, got {name!r}")
    self._items = tuple(sorted((name, check_ratio(r, name)) for name, r in ratios.items()))
    self._dict = dict(self._items)

  def __getitem__(self, name: str) -> float:
    return self._dict[name]

  def __iter__(self) -> Iterator[str]:
    return iter(self._dict)

  def __len__(self) -> int:
    return len(self._items)

  def __hash__(self) -> int:
    return hash(self._items)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, Mapping) and dict(self._items) == dict(other)

  def __repr__(self) -> str:
    return f"RatiosByName({self._dict!r})"


# One float for every layer, one per pruned layer (param flatten order), one per layer path,
# or fn(path, shape).
RatioSpec = float | tuple[float, ...] | RatiosByName | Callable[[str, tuple[int, ...]], float]


def default_layer_filter(path: str, shape: tuple[int, ...]) -> str | None:
  """ClickTrain's layer choice, as in the authors' released code, with shortcuts known by name.

  Every conv is pruned but the stem and the 1x1 shortcuts. A transform sees parameters, not
  the model, so this default tells a 1x1 projection shortcut by its path (``shortcut`` /
  ``downsample``, as :mod:`jaxprune.models` and torchvision name them).
  :func:`jaxprune.clicktrain.layer_filter_for` decides the same by structure (a 1x1 conv alone
  on the skip path of a residual add), whatever the layers are called; the
  :func:`jaxprune.clicktrain.method` preset checks the two agree at fit start.

  Args:
    path: the param's path, keys joined by ``/``.
    shape: the param's shape (HWIO for a conv kernel).

  Returns:
    ``"pattern"`` (patterns + kernel pruning) for a 3x3 kernel with more than 3 input channels;
    ``"kernel"`` (connectivity pruning only) for 1x1 convs not on a ``shortcut`` /
    ``downsample`` path; ``None`` (left dense) for the rest: non-4-D params, the stem (3 input
    channels), 1x1 shortcut convs and convs of other kernel sizes (5x5, 3x1, ...: the
    patterns are 3x3), which the transform names once in a warning.
  """
  return choose_layer(shape, shortcut="shortcut" in path or "downsample" in path)


def uses_choose_layer(layer_filter: Any) -> bool:
  """Whether ``layer_filter`` is one of the library's rules, not one of the user's.

  The library's rules have :func:`choose_layer` underneath: the default and
  :func:`jaxprune.clicktrain.layer_filter_for`.
  """
  return layer_filter is default_layer_filter or getattr(layer_filter, "choose_layer_rule", False)


def choose_layer(shape: tuple[int, ...], *, shortcut: bool) -> str | None:
  """The released code's choice for a param of ``shape``.

  ``shortcut``: the param is a 1x1 projection shortcut (left dense). A conv of another kernel
  size than 3x3 and 1x1 (5x5, 7x7, 3x1, ...) is left dense: ClickTrain's patterns are 4 of a
  3x3 kernel's 9 weights (§4.1), and neither the paper nor the released code says what a 5x5
  or a 3x1 kernel keeps; a ``layer_filter`` of one's own may still choose such a layer.
  """
  if len(shape) != 4:
    return None
  kh, kw, cin, _ = shape
  if cin <= 3:  # the stem reads the image
    return None
  if kh == kw == 1:
    return None if shortcut else "kernel"
  return "pattern" if kh == kw == 3 else None


def unsupported_kernels(params: Any) -> list[str]:
  """The convs that the default choice leaves dense for their kernel size.

  4-D kernels past the stem, neither 3x3 (patterns) nor 1x1 (connectivity), as
  ``path (kh x kw)``.
  """
  found = []
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    shape = tuple(np.shape(leaf))
    if len(shape) == 4 and shape[2] > 3 and shape[:2] not in ((3, 3), (1, 1)):
      found.append(f"{path_string(key_path)} ({shape[0]}x{shape[1]})")
  return found


# Words that name a skip path in other code bases (``proj``, ``skip``, ``residual``, ...), which
# the name rule does not know: a 1x1 conv so named is likely a projection shortcut it prunes.
_SKIP_WORDS = re.compile(r"proj|skip|short|resid|ident|down", re.IGNORECASE)


def name_chosen_projections(params: Any) -> list[str]:
  """The 1x1 convs that the name rule prunes though their names suggest a skip path.

  Past the stem, named ``proj``, ``skip``, ``residual``, ... (not ``shortcut`` / ``downsample``,
  which it leaves dense): likely projection shortcuts, which the paper's code leaves dense.
  """
  found = []
  for key_path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    path, shape = path_string(key_path), tuple(np.shape(leaf))
    if len(shape) == 4 and shape[:2] == (1, 1) and default_layer_filter(path, shape):
      if _SKIP_WORDS.search(path):
        found.append(path)
  return found


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


def _check_non_negative(name: str, v: Any) -> None:
  if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
    raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


@dataclasses.dataclass(frozen=True)
class PaperMode:
  """The paper mode's settings (DPPG and adaptive finalization, ClickTrain §4.2-4.3).

  Checked when built; a bad value raises a ``ValueError`` named by its ``clicktrain()``
  keyword, which has the same name.

  Args:
    pool_size: N, patterns in the final pool (8 or 12 in the paper; at most 126, the
      ``C(9, 4)`` patterns of a 3x3 kernel).
    loss_margin: δ of §4.3 (a batch votes when its loss did not rise by more).
    margin_rule: ``"relative"`` or ``"literal"`` (see
      :func:`jaxprune.clicktrain.patterns.loss_margin_ok`).

  Example:
    >>> from jaxprune import clicktrain
    >>> clicktrain.PaperMode(pool_size=8).pool_size
    8
  """

  pool_size: int = 12
  loss_margin: float = 0.0018
  margin_rule: str = "relative"

  def __post_init__(self):
    check_int("pool_size", self.pool_size, 1)
    if self.pool_size > _pat.num_patterns(PATTERN_SIZE, 3):
      raise ValueError(f"pool_size must be <= 126, got {self.pool_size}")
    _check_non_negative("loss_margin", self.loss_margin)
    if self.margin_rule not in ("relative", "literal"):
      raise ValueError(f"margin_rule must be 'relative' or 'literal', got {self.margin_rule!r}")


@dataclasses.dataclass(frozen=True)
class OneShot:
  """The one-shot mode's setting (the authors' released rule).

  Args:
    patterns: size of the fixed pool each kernel picks its pattern from, 4, 8 or 12
      (``clicktrain()``'s ``one_shot_patterns``, the name its ``ValueError`` gives).

  Example:
    >>> from jaxprune import clicktrain
    >>> clicktrain.OneShot(patterns=12).patterns
    12
  """

  patterns: int = 4

  def __post_init__(self):
    if isinstance(self.patterns, bool) or self.patterns not in _pat.ONE_SHOT_POOL_SIZES:
      raise ValueError(
        f"one_shot_patterns must be one of {_pat.ONE_SHOT_POOL_SIZES}, got {self.patterns!r}"
      )
    object.__setattr__(self, "patterns", int(self.patterns))  # frozen: normalised once


@dataclasses.dataclass(frozen=True)
class Aligned:
  """The aligned mode, beyond the paper: the filters share patterns in groups.

  ``clicktrain()``'s ``filter_groups`` and ``filter_grouping``, the names its ``ValueError``
  gives.

  Args:
    filter_groups: groups of filters per pruned layer (it must divide their number; 1 = all
      filters one group).
    grouping: ``"consecutive"`` (runs of consecutive filters) or ``"clustered"`` (a balanced
      partition chosen when the patterns are final).

  Example:
    >>> from jaxprune import clicktrain
    >>> clicktrain.Aligned(filter_groups=4, grouping="clustered").grouping
    'clustered'
  """

  filter_groups: int
  grouping: str = "consecutive"

  def __post_init__(self):
    if self.grouping not in FILTER_GROUPINGS:
      raise ValueError(f"filter_grouping must be one of {FILTER_GROUPINGS}, got {self.grouping!r}")
    if self.grouping == "clustered" and self.filter_groups is None:
      raise ValueError(
        "filter_grouping='clustered' chooses the filter groups of the aligned mode: it needs "
        "filter_groups (the number of groups)"
      )
    check_int("filter_groups", self.filter_groups, 1)


# The keywords of clicktrain() that are a sub-config's fields: keyword -> (Config field, field).
SUB_CONFIG_KEYWORDS = {
  "pool_size": ("paper", "pool_size"),
  "loss_margin": ("paper", "loss_margin"),
  "margin_rule": ("paper", "margin_rule"),
  "one_shot_patterns": ("one_shot", "patterns"),
  "filter_groups": ("aligned", "filter_groups"),
  "filter_grouping": ("aligned", "grouping"),
}


@dataclasses.dataclass(frozen=True)
class Config:
  """The settings of one ``clicktrain()``: its schedule, common settings and mode sub-configs.

  The schedule, the settings every mode reads, and one sub-config per mode (see
  ``clicktrain()``'s Args for each field).

  Built and validated once (each sub-config where it is built); ``kernel_prune_ratio`` is
  normalised to a float, a tuple of floats, a :class:`RatiosByName` or a callable,
  ``layer_filter`` to a function (the default when ``None`` is given).
  ``clicktrain(inner, config=...)`` takes one instead of the keywords; :meth:`from_keywords`
  builds one from them.

  Example:
    >>> from jaxprune import clicktrain
    >>> cfg = clicktrain.Config(
    ...     clicktrain.Schedule(steps_per_epoch=390, hard_prune_epoch=95),
    ...     kernel_prune_ratio=0.65, paper=clicktrain.PaperMode(pool_size=8),
    ...     aligned=clicktrain.Aligned(filter_groups=4))
    >>> cfg.mode, cfg.paper.pool_size
    ('paper', 8)

  Raises:
    ValueError: a bad field, named in the message (the checks of ``clicktrain()``).
  """

  schedule: Schedule
  kernel_prune_ratio: RatioSpec = 0.5
  group_lasso_coefficient: float = 2.5e-4
  group_lasso_ramp: str = "constant"
  layer_filter: LayerFilter | None = None
  importance_every: int = 1
  balanced_kernels: bool = False
  eps: float = 1e-8
  paper: PaperMode = PaperMode()
  one_shot: OneShot = OneShot()
  aligned: Aligned | None = None  # None: the paper's per-kernel patterns

  @classmethod
  def from_keywords(cls, schedule: Schedule, **options: Any) -> Config:
    """The config of ``clicktrain()``'s flat keywords (the epoch settings as ``schedule``).

    Args:
      schedule: the epoch settings.
      **options: the other keywords of ``clicktrain()``, by name; the sub-configs' keywords
        (``pool_size``, ``one_shot_patterns``, ``filter_groups``, ...) build them.

    Returns:
      The validated :class:`Config`; ``aligned`` is ``None`` when ``filter_groups`` is
      ``None`` and ``filter_grouping`` its default.

    Raises:
      ValueError: a bad value, named by its keyword.
    """
    parts: dict[str, dict[str, Any]] = {"paper": {}, "one_shot": {}, "aligned": {}}
    for keyword, (part, field) in SUB_CONFIG_KEYWORDS.items():
      if keyword in options:
        parts[part][field] = options.pop(keyword)
    aligned = parts.pop("aligned")
    # Off unless asked for; Aligned names a grouping given without groups.
    off = aligned.get("filter_groups") is None and aligned.get("grouping", "consecutive") == (
      "consecutive"
    )
    return cls(
      schedule,
      paper=PaperMode(**parts["paper"]),
      one_shot=OneShot(**parts["one_shot"]),
      aligned=None if off else Aligned(**aligned),
      **options,
    )

  @property
  def mode(self) -> str:
    """``"paper"`` or ``"one_shot"`` (the schedule's)."""
    return self.schedule.mode

  def __post_init__(self):
    for name, kind in (("schedule", Schedule), ("paper", PaperMode), ("one_shot", OneShot)):
      if not isinstance(getattr(self, name), kind):
        raise ValueError(
          f"{name} must be a clicktrain.{kind.__name__}, got {getattr(self, name)!r}"
        )
    if self.aligned is not None and not isinstance(self.aligned, Aligned):
      raise ValueError(f"aligned must be a clicktrain.Aligned or None, got {self.aligned!r}")
    if not isinstance(self.balanced_kernels, bool):
      raise ValueError(f"balanced_kernels must be a bool, got {self.balanced_kernels!r}")
    check_int("importance_every", self.importance_every, 1)
    if self.mode == "paper":
      self._check_importance_every()
    for name in ("group_lasso_coefficient", "eps"):
      _check_non_negative(name, getattr(self, name))
    if self.group_lasso_ramp not in GROUP_LASSO_RAMPS:
      raise ValueError(
        f"group_lasso_ramp must be one of {GROUP_LASSO_RAMPS}, got {self.group_lasso_ramp!r}"
      )
    # Normalised once, so the transform reads plain values.
    set_ = object.__setattr__  # frozen: __post_init__ is the one place that may write
    set_(self, "kernel_prune_ratio", _normalise_ratio(self.kernel_prune_ratio))
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
  """One float, a tuple of floats, a :class:`RatiosByName` (each ratio checked), or the
  callable as given (its values are checked per layer when the plan asks it)."""
  if isinstance(spec, (int, float, np.bool_, np.integer, np.floating)):
    return check_ratio(spec)
  if isinstance(spec, Mapping):
    return spec if isinstance(spec, RatiosByName) else RatiosByName(spec)
  if callable(spec):
    return spec
  if not isinstance(spec, Sequence) and not isinstance(spec, np.ndarray):
    raise ValueError(
      "kernel_prune_ratio must be a number, a sequence of numbers (one per pruned layer), a "
      f"mapping {{layer path: number}} or fn(path, shape) -> number, got {spec!r}"
    )
  return tuple(check_ratio(r) for r in spec)
