"""ClickTrain's step once the masks are final: :func:`specialize_pruned` and its trainer hook.

The transform's update runs the whole stage machine inside ``jit``: the stage is a traced value,
so every step carries the pool, finalization and mask branches under ``lax.switch`` / ``lax.cond``
and returns the per-layer state (votes, Eq. 2 sums, pattern ids, masks) through them. After the
hard prune that is pure overhead: the stage is PRUNED for good (ClickTrain §4.4, the last stage),
the masks never change again, yet XLA copies the per-layer state through the switch's identity
branch at every step (on VGG-11 the finalization votes alone are 49 MB). Measured in
``experiments/results/benchmarks/clicktrain_overhead.md``.

:func:`specialize_pruned` marks the state (a static :class:`~jaxprune.clicktrain.PrunedStep`,
no new arrays): its tree structure changes, ``jit`` traces the update again, and that trace holds
only the pruned stage's work, the same arithmetic as the general step's pruned branches (the
masked gradient, the inner optimizer, the hard mask); XLA fuses the two programs apart, so a float
may differ in its last bit. :class:`PrunedStageStep` does
it in a :class:`~jaxprune.train.Trainer` at the epoch end of the hard prune (and at the start of a
fit resumed after it); the ClickTrain preset attaches it.

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxprune._states import find_states
from jaxprune.clicktrain.state import PRUNED, STAGE_NAMES, ClickTrainState, PrunedStep
from jaxprune.train import Callback, TrainerLike

__all__ = ["PrunedStageStep", "is_specialized", "specialize_pruned"]


def _is_state(x: Any) -> bool:
  return isinstance(x, ClickTrainState)


def specialize_pruned(opt_state: Any) -> Any:
  """``opt_state`` with every ClickTrain state in it marked to run the pruned stage only.

  Call it outside ``jit`` once ClickTrain's stage reads ``"pruned"``; the next update traces a
  step without the stage machine (the per-layer state passes through it untouched), with the
  same results as the general step. A state already marked stays as it is. Checkpoints store
  the same arrays either way; a state restored from one (built from ``tx.init``) is unmarked
  until marked again.

  Args:
    opt_state: an optimizer state holding at least one
      :class:`~jaxprune.clicktrain.ClickTrainState` (inside chains and wrappers; its arrays may
      be NNX Variables, as in ``nnx.Optimizer.opt_state``).

  Returns:
    The same tree, each ClickTrain state with ``pruned_step`` set.

  Raises:
    ValueError: ``opt_state`` holds no ClickTrain state, one that is not in the pruned stage
      (named), or one whose stage is not a concrete value (inside ``jit``).

  Example::

    if clicktrain.stage_name(opt_state) == "pruned":
      opt_state = clicktrain.specialize_pruned(opt_state)   # or optimizer.opt_state = ...
  """
  found = find_states(opt_state, ClickTrainState)
  if not found:
    raise ValueError(
      f"opt_state: no ClickTrainState found in {type(opt_state).__name__} "
      "(was the optimizer built with jaxprune.clicktrain.clicktrain?)"
    )
  for state in found:
    if isinstance(state.stage, jax.core.Tracer):
      raise ValueError("opt_state: specialize_pruned needs a concrete stage; call it outside jit")
    stage = int(np.asarray(state.stage))
    if stage != PRUNED:
      raise ValueError(
        f"opt_state: ClickTrain's stage is {STAGE_NAMES[stage]!r}, not 'pruned': the masks are "
        "not final yet, so the update cannot be specialised to the pruned stage"
      )

  def mark(x):
    return x._replace(pruned_step=PrunedStep()) if _is_state(x) else x

  return jax.tree.map(mark, opt_state, is_leaf=_is_state)


def is_specialized(opt_state: Any) -> bool:
  """Whether every ClickTrain state in ``opt_state`` is marked by :func:`specialize_pruned`.

  False when it holds none.
  """
  found = find_states(opt_state, ClickTrainState)
  return bool(found) and all(s.pruned_step is not None for s in found)


class PrunedStageStep(Callback):
  """Trainer hook: once ClickTrain's stage is ``"pruned"``, the train step is the pruned stage's.

  At the first epoch end that finds the stage ``"pruned"`` (the hard prune's), and at the start
  of a fit resumed after it, it installs :func:`specialize_pruned` of the trainer's optimizer
  state (``trainer.replace``: one recompilation, shared with any other hook that replaces the
  model at the same epoch end). Every record gets ``ct_pruned_step``: whether the next epoch runs
  the specialised step.

  Example::

    trainer = train.Trainer(model, clicktrain.clicktrain(inner, ...),
                            callbacks=[clicktrain.PrunedStageStep()])
  """

  def _specialize(self, trainer: TrainerLike) -> None:
    found = find_states(trainer.opt_state, ClickTrainState)
    if found and any(s.pruned_step is None for s in found):
      if all(int(np.asarray(s.stage)) == PRUNED for s in found):
        trainer.replace(trainer.model, specialize_pruned(trainer.opt_state))

  def on_fit_start(self, trainer: TrainerLike) -> None:
    self._specialize(trainer)

  def on_epoch_end(self, trainer: TrainerLike, epoch: int) -> Mapping[str, Any]:
    del epoch
    self._specialize(trainer)
    return {"ct_pruned_step": is_specialized(trainer.opt_state)}
