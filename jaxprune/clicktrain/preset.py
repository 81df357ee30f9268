"""ClickTrain as a :class:`jaxprune.methods.Method`: the registry's ``clicktrain`` and
``clicktrain-one-shot``.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

from typing import Any

from jaxprune.clicktrain.transform import clicktrain
from jaxprune.methods import Method, Run, split_config

__all__ = ["method", "one_shot_method"]

# The paper prunes at epoch 90-98 of 190 (Table 1); the released code picks its masks 30
# epochs before that. Both are placed at the same fractions of a run of another length.
_HARD_PRUNE_FRACTION = 0.5
_ONE_SHOT_LEAD_FRACTION = 30 / 190


def _schedule(config: dict[str, Any], run: Run) -> dict[str, Any]:
  """Fills the epoch settings the user left out, scaled to ``run.epochs``."""
  config = dict(config)
  one_shot = config.get("mode", "paper") == "one_shot"
  if config.get("hard_prune_epoch") is None:
    config["hard_prune_epoch"] = max(2 if one_shot else 1, round(_HARD_PRUNE_FRACTION * run.epochs))
  if one_shot and config.get("one_shot_epoch") is None:
    lead = max(1, round(_ONE_SHOT_LEAD_FRACTION * run.epochs))
    config["one_shot_epoch"] = max(0, config["hard_prune_epoch"] - lead)
  return config


def method(**config: Any) -> Method:
  """ClickTrain's pattern + connectivity pruning (ClickTrain §4) as a method.

  ``make_tx(inner, run)`` returns :func:`jaxprune.clicktrain.clicktrain` around ``inner`` with
  ``steps_per_epoch`` from ``run``. When ``hard_prune_epoch`` is not given it is half the run
  (the paper's 95 of 190 epochs); in ``mode="one_shot"`` a missing ``one_shot_epoch`` comes
  30/190 of the run before it (the released code's lead).

  Args:
    **config: any keyword of :func:`jaxprune.clicktrain.clicktrain` except ``inner`` and
      ``steps_per_epoch`` (``mode``, ``kernel_prune_ratio``, ``hard_prune_epoch``,
      ``pool_start_epoch``, ``pool_epochs``, ``finalize_epochs``, ...).

  Returns:
    A :class:`jaxprune.methods.Method` named ``"clicktrain"``.

  Raises:
    ValueError: a key ``clicktrain`` does not take (bad values fail in ``make_tx``).

  Example:
    >>> from jaxprune import clicktrain
    >>> m = clicktrain.method(kernel_prune_ratio=0.65, pool_start_epoch=10)
  """
  targets = {"clicktrain": (clicktrain, ("inner", "steps_per_epoch"))}
  config = split_config(config, targets, owner="clicktrain")["clicktrain"]

  def make_tx(inner, run: Run):
    return clicktrain(inner, steps_per_epoch=run.steps_per_epoch, **_schedule(config, run))

  return Method(name="clicktrain", make_tx=make_tx, config=config)


def one_shot_method(**config: Any) -> Method:
  """:func:`method` with ``mode="one_shot"``: the authors' released rule (masks from one batch).

  Raises:
    ValueError: ``mode`` given (this preset fixes it), or as :func:`method`.
  """
  if "mode" in config:
    raise ValueError("mode: clicktrain-one-shot fixes mode='one_shot'; use clicktrain for others")
  return method(mode="one_shot", **config)
