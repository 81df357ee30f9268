"""The named budgets of every paper table, and the results folder each table writes to.

A *budget* is one named recipe for a whole table: ``paper`` is the paper's recipe exactly (for a
GPU), ``cpu`` one reduced recipe that every row of that table shares: reduced width over the
full training set, sized from FLOPs so that a run takes about an hour on 2 CPU cores and a
dense row gets near 80% on CIFAR-10 (the dense PruneTrain ResNet-20, 82 MFLOPs per image,
reached 81.4% in 10 epochs and 68 minutes on such a machine,
``results/benchmarks/cifar10_resnet20_dense.md``).

    budget = get_budget("sdgp_table1", "cpu")
    describe_budget(budget)   # the line a results page states
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

from jaxprune import methods

# The results folders: one per paper of the library's list, and the benchmarks'.
PAPERS = (*(paper.results for paper in methods.PAPERS), "benchmarks")


class Budget(Mapping[str, Any]):
  """A typed, frozen recipe that also reads as a read-only mapping of its fields: the results
  pages and the saved JSON name its settings by key (``budget["epochs"]``, ``dict(budget)``).

  Subclasses are frozen dataclasses; their fields, in order, are the recipe's settings.
  """

  def __getitem__(self, key: str) -> Any:
    if key not in self._names():
      raise KeyError(key)
    return getattr(self, key)

  def __iter__(self) -> Iterator[str]:
    return iter(self._names())

  def __len__(self) -> int:
    return len(self._names())

  def _names(self) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(self))


Width = float | Mapping[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingBudget(Budget):
  """What every training budget sets: the model width (one multiplier, or one per model family:
  :func:`row_width`), the data (``train_subset`` / ``test_subset`` None: the whole split), the
  run's length and its batch."""

  width: Width
  train_subset: int | None = None
  test_subset: int | None = None
  epochs: int
  batch_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepBudget(TrainingBudget):
  """A training budget of SGD at ``lr``, ×0.1 at each fraction of the run in ``milestones``."""

  lr: float
  milestones: tuple[float, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClickTrainBudget(StepBudget):
  """ClickTrain Table 1's recipe: the stage lengths; ``hard_prune_fraction`` None: the paper's
  epoch per row; ``linear_init_std`` None: the models' own classifier init."""

  pool_epochs: int
  finalize_epochs: int
  hard_prune_fraction: float | None
  linear_init_std: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruneTrainBudget(StepBudget):
  """PruneTrain Table 1's recipe: the group lasso's penalty ratio, threshold and
  reconfiguration interval (epochs)."""

  interval: int
  penalty_ratio: float
  threshold: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class SdgpBudget(TrainingBudget):
  """SDGP's training recipe (Table I, Fig. 8): the triangular LR (``peak_lr`` at
  ``peak_epoch``) and ``init`` (``"released"``: the authors' re-initialising converter, the
  dense row converted as 4:4; ``"model"``: the model's own init, the dense row unconverted)."""

  init: str
  peak_lr: float
  peak_epoch: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimeModelBudget(Budget):
  """SDGP Fig. 10's time model: the width and batch it times, and the target accuracy of its
  time-to-accuracy table."""

  width: Width
  batch_size: int
  target_acc: float


def _sdgp(width: float, epochs: int, batch_size: int) -> SdgpBudget:
  """The SDGP recipe (the ffcv ResNet-9 recipe SDGP ran) at this width, length and batch: the
  peak LR scales linearly with the batch, the peak sits at the recipe's fraction of the run
  (2 of 150 epochs), no earlier than half an epoch."""
  return SdgpBudget(
    width=width,
    epochs=epochs,
    batch_size=batch_size,
    init="released",
    peak_lr=0.5 * batch_size / 512,
    peak_epoch=min(2.0, max(0.5, epochs * 2.0 / 150)),
  )


# ClickTrain §6.1: 190 epochs, batch 128, SGD 0.9, lr 0.1 (×0.1 at 50% / 75%: the paper does not
# state its schedule), wd 5e-4; pool / finalization 5 epochs each, hard prune at the row's epoch
# of Table 1.
_CLICKTRAIN_PAPER = ClickTrainBudget(
  width=1.0,
  epochs=190,
  batch_size=128,
  lr=0.1,
  milestones=(0.5, 0.75),
  pool_epochs=5,
  finalize_epochs=5,
  hard_prune_fraction=None,
  linear_init_std=None,
)


# PruneTrain §5 and the authors' scripts: 182 epochs, lr 0.1 ×0.1 at epochs 91 / 136, penalty
# ratio 0.2, threshold 1e-4, reconfiguration every 10 epochs, dynamic mini-batch.
_PRUNETRAIN_PAPER = PruneTrainBudget(
  width=1.0,
  epochs=182,
  batch_size=128,
  lr=0.1,
  milestones=(0.5, 0.75),
  interval=10,
  penalty_ratio=0.2,
  threshold=1e-4,
)


# The `fit` budget: the papers' own networks and hyper-parameters, trained until the dense
# network fits its training data, on a fixed balanced subset of the training images (the whole
# test set) so that a run takes under an hour on 2 CPU cores. At the `cpu` budget no network fits
# (dense VGG-11 trains at 75% and tests at 76%), so every weight a method removes costs accuracy;
# the papers' claim is about networks that fit. Chosen by measurement (results/fit_sizing.md):
# one SGD step at batch 128 on 2 cores takes 0.75 s for ClickTrain's VGG-11 at ×1/2, 1.03 s for
# its ResNet-32 at ×1/4 (3.03 s at ×1/2), 1.52 s for PruneTrain's ResNet-32 at ×1 and 0.85 s
# for SDGP's ResNet-9 at ×1/4: about 1 900 steps fit the hour at those widths, the widest that
# do. 5 000 images for 48 epochs (1 872 steps) left the ×1/2 VGG-11 short of fitting its
# training data; 2 560 images (256 a class, 20 steps an epoch) for 96 epochs is the same work
# with twice the passes over each image.
FIT_TRAIN_SUBSET = 2_560
FIT_EPOCHS = 96


def scaled_epochs(paper_epochs: int, paper_run: int, epochs: int) -> int:
  """A stage length of ``paper_epochs`` in a ``paper_run``-epoch run, at the same fraction of an
  ``epochs``-epoch run (at least one epoch)."""
  return max(1, round(paper_epochs * epochs / paper_run))


# ClickTrain's networks at `fit`: the widest that fit the hour (ResNet-32 at ×1/2 would take
# 3.03 s a step).
_CLICKTRAIN_FIT_WIDTH = MappingProxyType({"resnet": 0.25, "vgg": 0.5})


# Table -> budget name -> settings. Every row of a table trains with these (the rows differ only
# in model and method), so the rows of one page compare. A table is named
# "<paper>_<figure>", the paper by its package name in jaxprune.methods.PAPERS (PAPER_OF).
BUDGETS: Mapping[str, Mapping[str, Budget]] = {
  "clicktrain_table1": {
    "paper": _CLICKTRAIN_PAPER,
    # The width is set per model family so that every dense row costs 20-41 MFLOPs per image
    # and a run takes under an hour on 2 cores (measured: a 390-step epoch takes 2.2 min for
    # VGG-11 ×1/4, 3.2 min for VGG-13 ×1/4, 4.0 min for ResNet-32 ×1/8). At ×1/8 VGG-11 has 5
    # MFLOPs and its dense row stopped at 66.8%. The stages are squeezed into the run (one
    # epoch each of warm-up, pool generation and finalization; hard prune at 60%). The VGG
    # classifier's N(0, 0.01) init stays at chance for hundreds of steps at reduced width, so
    # it is N(0, 0.05) for every row of both methods.
    "cpu": dataclasses.replace(
      _CLICKTRAIN_PAPER,
      width=MappingProxyType({"resnet": 0.125, "vgg": 0.25}),
      epochs=12,
      pool_epochs=1,
      finalize_epochs=1,
      hard_prune_fraction=0.6,
      linear_init_std=0.05,
    ),
    # The paper's stages at the paper's fractions of the run: pool and finalization 5/190 of
    # it each, the hard prune at each row's Table 1 epoch scaled by 96/190; the pool starts at
    # §4.1's loss-derivative trigger. The VGG classifier is initialised N(0, 0.05) as at the
    # cpu budget: with its own N(0, 0.01) the ×1/2 VGG-11 stood at 22% train accuracy after 312
    # steps (8 epochs of 5 000 images), too slow to fit in the budget's steps.
    "fit": dataclasses.replace(
      _CLICKTRAIN_PAPER,
      width=_CLICKTRAIN_FIT_WIDTH,
      train_subset=FIT_TRAIN_SUBSET,
      epochs=FIT_EPOCHS,
      pool_epochs=scaled_epochs(5, _CLICKTRAIN_PAPER.epochs, FIT_EPOCHS),
      finalize_epochs=scaled_epochs(5, _CLICKTRAIN_PAPER.epochs, FIT_EPOCHS),
      linear_init_std=0.05,
    ),
  },
  "prunetrain_table1": {
    "paper": _PRUNETRAIN_PAPER,
    # Half width, full data, 10 epochs (3 900 steps). With SGD the group lasso shrinks a group
    # by about lr·λ/(1−momentum) per step; the paper's ratio 0.2 needs ~10⁴ steps to kill a
    # channel, so the ratio is raised to 0.55 (λ ∝ r/(1−r): 4.9× the paper's) and the threshold
    # to 1e-2 (groups jitter around zero with amplitude ~lr·λ). Ratio 0.6 (λ 6×) ended at 13%
    # of the inference FLOPs against the paper's 34% (results/prunetrain/index.md).
    "cpu": dataclasses.replace(
      _PRUNETRAIN_PAPER, width=0.5, epochs=10, interval=1, penalty_ratio=0.55, threshold=1e-2
    ),
    # The paper's penalty ratio and threshold; a reconfiguration every 10/182 of the run. Its
    # own networks at the widest that fit the hour, and ClickTrain's (ClickTrain Table 1's
    # PruneTrain rows) at ClickTrain's widths, so their dense runs are the same runs. The
    # paper's λ per step over 1 920 steps moves a group's norm by at most Σ lr·λ/(1−momentum)
    # ≈ 0.14 (VGG-11 ×1/2), a tenth of a fresh group's: nothing dies (results/prunetrain/
    # index.md); the ratio that matches the paper's total shrinkage (0.9, `--penalty-ratio`)
    # makes the penalty 90% of the first loss and the network never learns (19%).
    "fit": dataclasses.replace(
      _PRUNETRAIN_PAPER,
      width=MappingProxyType(
        {
          "prunetrain-resnet": 1.0,
          "prunetrain-vgg": 0.5,
          **{f"clicktrain-{family}": w for family, w in _CLICKTRAIN_FIT_WIDTH.items()},
        }
      ),
      train_subset=FIT_TRAIN_SUBSET,
      epochs=FIT_EPOCHS,
      interval=scaled_epochs(_PRUNETRAIN_PAPER.interval, _PRUNETRAIN_PAPER.epochs, FIT_EPOCHS),
    ),
  },
  "sdgp_table1": {
    "paper": _sdgp(width=1.0, epochs=150, batch_size=512),
    "cpu": _sdgp(width=0.125, epochs=10, batch_size=128),
    "fit": dataclasses.replace(
      _sdgp(width=0.25, epochs=FIT_EPOCHS, batch_size=128), train_subset=FIT_TRAIN_SUBSET
    ),
  },
  # Fig. 8 trains each n:m cell with Table I's recipe.
  "sdgp_fig8": {
    "paper": _sdgp(width=1.0, epochs=150, batch_size=512),
    "cpu": _sdgp(width=0.125, epochs=10, batch_size=128),
    "fit": dataclasses.replace(
      _sdgp(width=0.25, epochs=FIT_EPOCHS, batch_size=128), train_subset=FIT_TRAIN_SUBSET
    ),
  },
  # Fig. 10: the time model at the training budget's width, and the target accuracy of the
  # time-to-accuracy table (the paper's 94.5%; for the cpu budget a level its dense row passes).
  "sdgp_timemodel": {
    "paper": TimeModelBudget(width=1.0, batch_size=512, target_acc=0.945),
    "cpu": TimeModelBudget(width=0.125, batch_size=32, target_acc=0.75),
  },
}


def _results_of(table: str) -> str:
  """The results folder of ``table``: its paper's, named by the table's first word."""
  by_package = {paper.name: paper.results for paper in methods.PAPERS}
  paper = table.partition("_")[0]
  if paper not in by_package:
    raise ValueError(f"table {table!r} does not start with a paper of {sorted(by_package)}")
  return by_package[paper]


# Which results folder each table command writes to.
PAPER_OF = {table: _results_of(table) for table in BUDGETS}


def get_budget(table: str, name: str) -> Budget:
  """The settings of budget ``name`` for ``table`` (frozen).

  Args:
    table: a key of :data:`BUDGETS` (``"sdgp_table1"``, ...).
    name: ``"paper"`` or ``"cpu"``.

  Returns:
    The budget: a frozen dataclass of the table's kind (:class:`ClickTrainBudget`, ...), also
    a read-only mapping of its settings.

  Raises:
    ValueError: ``table`` or ``name`` is unknown (the message names it and lists the choices).
  """
  if table not in BUDGETS:
    raise ValueError(f"table: unknown table {table!r}; choose from {sorted(BUDGETS)}")
  if name not in BUDGETS[table]:
    raise ValueError(
      f"budget: unknown budget {name!r} for {table}; choose from {sorted(BUDGETS[table])}"
    )
  return BUDGETS[table][name]


def row_width(width: float | Mapping[str, float], row: str) -> float:
  """The width multiplier a budget gives ``row``.

  Args:
    width: a budget's ``width``: one multiplier for every row, or a mapping from model family
      to its multiplier, keyed by the start of the row's name (``"vgg"`` for ``"vgg11"``) or
      of the model's registry name (``"clicktrain-vgg"`` for ``"clicktrain-vgg11"``).
    row: the row's name (``"vgg11"``) or its model's registry name (``"clicktrain-vgg11"``,
      which also matches a key ``"vgg"``).

  Returns:
    The multiplier.

  Raises:
    ValueError: ``width`` is a mapping with no family that ``row`` starts with.
  """
  if not isinstance(width, Mapping):
    return float(width)
  names = (row, row.partition("-")[2]) if "-" in row else (row,)
  for family, multiplier in width.items():
    if any(name.startswith(family) for name in names):
      return float(multiplier)
  raise ValueError(f"row: {row!r} is of no model family of the budget's width {dict(width)}")


def model_overrides(name: str, model: str) -> dict[str, Any]:
  """``models.create`` keywords beyond the width that budget ``name`` gives ``model`` in every
  table that trains it: a ClickTrain VGG's classifier init (``linear_init_std`` of ClickTrain
  Table 1's budget), so that ClickTrain's and PruneTrain's tables train the same network.

  Args:
    name: the budget's name (``"fit"``).
    model: the registry name (``"clicktrain-vgg11"``).
  """
  if not model.startswith("clicktrain-vgg"):
    return {}
  std = get_budget("clicktrain_table1", name).linear_init_std
  return {} if std is None else {"linear_init_std": std}


def _describe_width(width: float | Mapping[str, float]) -> str:
  if isinstance(width, Mapping):
    return " / ".join(f"{family} ×{multiplier:g}" for family, multiplier in width.items())
  return f"×{width:g}"


def describe_budget(budget: Mapping[str, Any]) -> str:
  """One line naming the data, width and schedule of a budget (for the results page)."""
  train_images = budget.get("train_subset") or 50_000
  test_images = budget.get("test_subset") or 10_000
  parts = [f"width {_describe_width(budget['width'])}"]
  if "epochs" in budget:
    parts.append(f"{train_images:,} training / {test_images:,} test images")
    parts.append(f"{budget['epochs']} epochs at batch {budget['batch_size']}")
  else:
    parts.append(f"batch {budget['batch_size']}")
  return ", ".join(parts)


def as_saved(budget: Mapping[str, Any]) -> dict[str, Any]:
  """``budget`` in the form a result's JSON holds it (tuples become lists, read-only mappings
  such as a per-family ``width`` plain dicts), for comparing a preset with what an earlier run
  saved."""
  return json.loads(json.dumps(dict(budget), default=_plain_mapping))


def _plain_mapping(value: Any) -> dict[str, Any]:
  if isinstance(value, Mapping):
    return dict(value)
  raise TypeError(f"{type(value).__name__} is not JSON serialisable")
