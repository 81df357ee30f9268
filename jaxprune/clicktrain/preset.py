"""ClickTrain as a :class:`jaxprune.methods.Method`: the registry's ``clicktrain`` and
``clicktrain-one-shot``.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxprune.clicktrain.execution import SparseExecution
from jaxprune.clicktrain.layer_choice import LayerChoiceCheck, checked_default_layer_filter
from jaxprune.clicktrain.prune_batchnorm import DEFAULT_BATCHES, HardPruneBatchNorm, HardPruneCheck
from jaxprune.clicktrain.pruned_step import PrunedStageStep
from jaxprune.clicktrain.schedule import Schedule
from jaxprune.clicktrain.transform import clicktrain
from jaxprune.method_api import Method, Run, split_config

__all__ = [
  "PAPER_KERNEL_RATIOS",
  "RELEASED_CIFAR10",
  "method",
  "one_shot_method",
  "paper_kernel_ratios",
  "released_method",
]


def _split_schedule(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
  """``config`` split into the schedule's fields and the rest of ``clicktrain()``'s keywords.

  Without a ``layer_filter`` the rest takes the name-based default that the preset's
  :class:`LayerChoiceCheck` compares with the model's structure at fit start.
  """
  keys = {f.name for f in dataclasses.fields(Schedule)}
  rest = {k: v for k, v in config.items() if k not in keys}
  if rest.get("layer_filter") is None:
    rest["layer_filter"] = checked_default_layer_filter
  return {k: v for k, v in config.items() if k in keys}, rest


def _hook_settings(
  *, recompute_batchnorm: int = DEFAULT_BATCHES, sparse_execution: bool = True
) -> tuple[int, bool]:
  """The preset's own keys (routed by :func:`split_config`), checked."""
  if (
    isinstance(recompute_batchnorm, bool)
    or not isinstance(recompute_batchnorm, int)
    or recompute_batchnorm < 0
  ):
    raise ValueError(f"recompute_batchnorm must be a non-negative int, got {recompute_batchnorm!r}")
  if not isinstance(sparse_execution, bool):
    raise ValueError(f"sparse_execution must be a bool, got {sparse_execution!r}")
  return recompute_batchnorm, sparse_execution


def _callbacks(recompute_batchnorm: int, sparse: bool, by_name: bool):
  """The preset's trainer hooks: the BatchNorm re-estimate at the hard prune unless off, the
  end-of-run check that the hard prune came, with ``by_name`` (the default layer filter) the
  fit-start check that its choice matches the model's structure, and, with ``sparse``, the
  aligned layers' execution after the hard prune."""

  def callbacks(run: Run) -> list[Any]:
    hooks: list[Any] = [HardPruneBatchNorm(recompute_batchnorm)] if recompute_batchnorm else []
    hooks.append(HardPruneCheck(run.epochs))
    # After the hard prune the stage machine is dead weight on every step: the pruned stage's own.
    hooks.append(PrunedStageStep())
    if by_name:
      hooks.append(LayerChoiceCheck(run.image_shape))
    if sparse:
      # The aligned mode exists to run as dense slices after the hard prune (ClickTrain §5.2
      # on the paper's layout); the groups are read off the state, so clustered ones work too.
      hooks.append(SparseExecution(filter_groups="from_state"))
    return hooks

  return callbacks


def method(**config: Any) -> Method:
  """ClickTrain's pattern + connectivity pruning (ClickTrain §4) as a method.

  ``make_tx(inner, run)`` returns :func:`jaxprune.clicktrain.clicktrain` around ``inner`` with
  the epoch settings placed in ``run`` as one :class:`~jaxprune.clicktrain.Schedule`
  (:meth:`~jaxprune.clicktrain.Schedule.for_run`: a missing ``hard_prune_epoch`` is half the
  run, a missing one-shot ``one_shot_epoch`` 30/190 of the run before it). ``callbacks(run)``
  returns a :class:`~jaxprune.clicktrain.HardPruneBatchNorm`: the hard prune zeroes about half
  of each pruned conv's weights in one step, and without it the BatchNorm running statistics
  still describe the dense weights when that epoch is evaluated (an accuracy collapse that
  recovers an epoch later; docs/design.md, "BatchNorm at the hard prune"). Beyond the paper,
  which does not say how it evaluates then.
  They also hold a :class:`~jaxprune.clicktrain.PrunedStageStep`, which specialises the train
  step to the pruned stage once the masks are final, a
  :class:`~jaxprune.clicktrain.HardPruneCheck`, which warns when the run's
  last epoch ends before the hard prune (the transform, given ``total_epochs=run.epochs``,
  already warns when it is built if the schedule cannot prune inside the run), a
  :class:`~jaxprune.clicktrain.LayerChoiceCheck` unless ``layer_filter`` is given (the default
  knows 1x1 projection shortcuts by name; a model whose shortcuts are named otherwise, or
  whose 1x1 convs so named are not shortcuts, is refused at fit start with the
  ``layer_filter`` that decides by structure), and, in the
  aligned mode (``filter_groups=G``), a :class:`~jaxprune.clicktrain.SparseExecution`
  (``filter_groups="from_state"``) that switches the pruned convs to the aligned layers after
  the hard prune where they measure faster: the method runs what it trains for.

  Args:
    **config: any keyword of :func:`jaxprune.clicktrain.clicktrain` except ``inner`` and
      ``steps_per_epoch`` (``mode``, ``kernel_prune_ratio``, ``hard_prune_epoch``,
      ``pool_start_epoch``, ``pool_epochs``, ``finalize_epochs``, ...), and
      ``recompute_batchnorm``: training batches the BatchNorm statistics are re-estimated
      from at the hard prune (default 10); 0 = off (evaluate with the running statistics
      as training leaves them).
      ``sparse_execution``: with ``filter_groups``, attach the
      :class:`~jaxprune.clicktrain.SparseExecution` hook (default ``True``; ``False`` keeps
      the masked dense convs). Without ``filter_groups`` it does nothing.

  Returns:
    A :class:`jaxprune.methods.Method` named ``"clicktrain"``.

  Raises:
    ValueError: a key ``clicktrain`` does not take, ``recompute_batchnorm`` not a
      non-negative int or ``sparse_execution`` not a bool (other bad values fail in
      ``make_tx``).

  Example:
    >>> from jaxprune import clicktrain
    >>> m = clicktrain.method(kernel_prune_ratio=0.65, pool_start_epoch=10)
  """
  targets = {
    "clicktrain": (clicktrain, ("inner", "steps_per_epoch", "schedule")),
    "hooks": (_hook_settings, ()),
  }
  routed = split_config(config, targets, owner="clicktrain")
  batches, sparse = _hook_settings(**routed["hooks"])
  tx_config = routed["clicktrain"]
  sparse = sparse and tx_config.get("filter_groups") is not None

  given, rest = _split_schedule(tx_config)

  def make_tx(inner, run: Run):
    return clicktrain(
      inner, schedule=Schedule.for_run(run.steps_per_epoch, run.epochs, **given), **rest
    )

  return Method(
    name="clicktrain",
    make_tx=make_tx,
    callbacks=_callbacks(batches, sparse, by_name=tx_config.get("layer_filter") is None),
    config={**tx_config, **routed["hooks"]},
  )


def one_shot_method(**config: Any) -> Method:
  """:func:`method` with ``mode="one_shot"``: the authors' released rule (masks from one batch).

  Raises:
    ValueError: ``mode`` given (this preset fixes it), or as :func:`method`.
  """
  if "mode" in config:
    raise ValueError("mode: clicktrain-one-shot fixes mode='one_shot'; use clicktrain for others")
  return method(mode="one_shot", **config)


# The per-layer kernel-prune ratios of the paper's CIFAR-10 runs, one copy for the released
# configs below and the Table 1 rows. VGG: one per pruned conv in order (every conv but the
# stem; VGG-11's and VGG-16's are the authors' released lists). ResNet: one per stage, 55% and
# 65% for the first two and 75% after (the paper's ResNet-32; the table applies it to the
# family's other ResNets too).
PAPER_KERNEL_RATIOS: dict[str, tuple[float, ...]] = {
  "clicktrain-vgg11": (0.35, 0.45, 0.65, 0.75, 0.80, 0.80, 0.85),
  "clicktrain-vgg13": (0.35, 0.40, 0.45, 0.55, 0.65, 0.75, 0.80, 0.80, 0.85),
  "clicktrain-vgg16": (0.35, 0.45, 0.55, 0.55, 0.55, 0.65, 0.65, 0.65, 0.75, 0.80, 0.85, 0.85),
  "clicktrain-resnet": (0.55, 0.65, 0.75),
}


def paper_kernel_ratios(model_name: str) -> Callable[[str, tuple[int, ...]], float]:
  """The paper's kernel-prune ratio of each pruned conv of ``model_name``.

  Given as the ``fn(path, shape)`` that ``kernel_prune_ratio`` takes.

  Args:
    model_name: ``clicktrain-vgg11``, ``-vgg13``, ``-vgg16`` or one of the family's ResNets
      (``clicktrain-resnet32``, ...).

  Raises:
    ValueError: a model with no ratios here; the returned function, for a path that is not a
      pruned conv of that model (the stem, a layer past the list).
  """
  family = "clicktrain-resnet" if model_name.startswith("clicktrain-resnet") else model_name
  if family not in PAPER_KERNEL_RATIOS:
    raise ValueError(
      f"no per-layer ratios for {model_name!r}; known: {sorted(PAPER_KERNEL_RATIOS)}"
    )
  ratios = PAPER_KERNEL_RATIOS[family]
  top = "stages" if family == "clicktrain-resnet" else "features"

  def ratio(path: str, shape: tuple[int, ...]) -> float:
    # stages/<s>/<block>/... or features/<i>/conv/kernel, where features/0 is the stem.
    parts = path.split("/")
    if len(parts) > 1 and parts[0] == top and parts[1].isdigit():
      index = int(parts[1])
      if top == "stages":
        return ratios[min(index, len(ratios) - 1)]
      if 1 <= index <= len(ratios):
        return ratios[index - 1]
    raise ValueError(f"{path!r} is not a conv of {model_name!r} that ClickTrain prunes")

  return ratio


# The authors' released CIFAR-10 configs of the one-shot rule (their cifar10_<arch>_v1 files):
# pool size, per-layer kernel-prune ratios (every conv but the stem, in order), group-lasso λ,
# and the epochs of the mask pick and of the hard prune in their 190-epoch runs.
_RELEASED_EPOCHS = 190
RELEASED_CIFAR10: dict[str, dict[str, Any]] = {
  "vgg11": {
    "one_shot_patterns": 4,
    "kernel_prune_ratio": PAPER_KERNEL_RATIOS["clicktrain-vgg11"],
    "group_lasso_coefficient": 3.5e-4,
    "one_shot_epoch": 65,
    "hard_prune_epoch": 143,
  },
  "vgg16": {
    "one_shot_patterns": 12,
    "kernel_prune_ratio": PAPER_KERNEL_RATIOS["clicktrain-vgg16"],
    "group_lasso_coefficient": 1.5e-4,
    "one_shot_epoch": 150,
    "hard_prune_epoch": 163,
  },
}


def released_method(arch: str, **overrides: Any) -> Method:
  """The authors' released one-shot config for ``clicktrain-<arch>`` on CIFAR-10.

  VGG-16's picks each kernel's pattern from a pool of 12 (``one_shot_patterns=12``), VGG-11's
  from the 4 centre blocks. The pick and hard-prune epochs are placed at the same fractions of
  the run as in their 190 epochs (VGG-16: 150 and 163) unless given. Their runs also switch
  to mixup (α = 0.3) after the hard prune: that is data-side (the loader's soft labels).

  Args:
    arch: a key of :data:`RELEASED_CIFAR10` (``"vgg11"``, ``"vgg16"``).
    **overrides: keywords of :func:`jaxprune.clicktrain.clicktrain` replacing the config's,
      and :func:`method`'s ``recompute_batchnorm``.

  Returns:
    A :class:`jaxprune.methods.Method` named ``"clicktrain"`` in ``mode="one_shot"``.

  Raises:
    ValueError: unknown ``arch``, or as :func:`one_shot_method`.

  Example:
    >>> m = released_method("vgg16")       # 12 patterns, the released per-layer ratios
  """
  if arch not in RELEASED_CIFAR10:
    raise ValueError(f"arch must be one of {sorted(RELEASED_CIFAR10)}, got {arch!r}")
  config = {**RELEASED_CIFAR10[arch], **overrides}
  fixed = {k: RELEASED_CIFAR10[arch][k] for k in ("one_shot_epoch", "hard_prune_epoch")}
  kept = {k: config.pop(k) for k in fixed if k in overrides}  # given: not scaled
  for k in fixed:
    config.pop(k, None)
  base = one_shot_method(**config)
  for key in ("recompute_batchnorm", "sparse_execution"):  # the preset's hook settings
    config.pop(key, None)
  given, rest = _split_schedule(config)

  def make_tx(inner, run: Run):
    schedule = Schedule.scaled(
      run.steps_per_epoch, run.epochs, _RELEASED_EPOCHS, fixed=fixed, **kept, **given
    )
    return clicktrain(inner, schedule=schedule, **rest)

  return dataclasses.replace(base, make_tx=make_tx, config={**base.config, **fixed, **kept})
