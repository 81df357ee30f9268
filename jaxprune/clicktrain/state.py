"""The state of :func:`jaxprune.clicktrain.clicktrain`: its stages and the per-layer masks and
scores (ClickTrain Fig. 4, §4.1-4.4).

Checkpoints and PruneTrain's reconfiguration read these types by field: their field names and
order are part of the checkpoint format.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import jax
import optax

from jaxprune.clicktrain.schedule import Schedule
from jaxprune.train.optim import EpochLengthState

__all__ = [
  "FINALIZE",
  "PATTERN_SIZE",
  "POOL",
  "PRUNED",
  "REGULARIZE",
  "STAGE_NAMES",
  "WARMUP",
  "ClickTrainLayerState",
  "ClickTrainState",
  "PrunedStep",
  "Stage",
  "full_mask",
]

PATTERN_SIZE = 4  # weights kept per kernel (ClickTrain keeps 4 of 9)


class Stage(enum.IntEnum):
  """ClickTrain's stages, in order (the state's ``stage`` holds the int)."""

  WARMUP = 0  # dense training (§4.1)
  POOL = 1  # DPPG (§4.2)
  FINALIZE = 2  # pattern / kernel votes (§4.3)
  REGULARIZE = 3  # modified group lasso (§4.4)
  PRUNED = 4  # hard prune, masks kept


WARMUP, POOL, FINALIZE, REGULARIZE, PRUNED = Stage
STAGE_NAMES = tuple(s.name.lower() for s in Stage)


class ClickTrainLayerState(NamedTuple):
  """Per pruned layer. DPPG / vote fields are None where unused (1x1 layers, one_shot)."""

  competitive_scores: jax.Array | None  # (C(k*k, 4),) int32, DPPG step 4-5
  pool: jax.Array | None  # (N,) int32 ids into all_patterns(4, k)
  votes: jax.Array | None  # (Cin, Cout, N) int32, §4.3
  kernel_score_sum: jax.Array  # (Cin, Cout) float32, Eq. 2 summed
  pattern_id: jax.Array  # (Cin, Cout) int32 id into all_patterns(4, k); -1 = none
  kernel_keep: jax.Array  # (Cin, Cout) bool
  pattern_mask: jax.Array  # (kh, kw, Cin, Cout) P (ones before it is final)
  # (Cout,) int32: each filter's group in the aligned mode (consecutive runs, or the clustered
  # partition once chosen: filter_grouping="clustered"); arange(Cout) (one filter per group)
  # in the paper mode. Present in every mode and stage, so the tree keeps one structure.
  filter_group: jax.Array


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class PrunedStep:
  """Marks a state whose stage is PRUNED for good (:func:`~jaxprune.clicktrain.specialize_pruned`).

  Static (no leaves): a state holding it has another tree structure, so ``jit`` traces the update
  anew, and there the update runs only the pruned stage's work (the masked gradient, the inner
  optimizer, the hard mask); the per-layer state passes through untouched. Checkpoints store the
  same arrays with or without it.
  """


class ClickTrainState(NamedTuple):
  count: jax.Array  # steps done
  stage: jax.Array  # Stage.WARMUP .. Stage.PRUNED
  stage_start_epoch: jax.Array  # epoch at which the current stage began
  epoch_loss_sum: jax.Array  # loss summed over the current epoch
  prev_epoch_loss: jax.Array  # mean loss of the last finished epoch (nan: none)
  last_loss: jax.Array  # previous batch loss (nan: none)
  layers: dict[str, ClickTrainLayerState]  # keyed by jaxprune.paths.path_string
  inner_state: optax.OptState
  # The steps per epoch the epoch settings were converted with (the trainer names a training
  # loader with another number of batches per epoch) and the reference steps done, advanced
  # by the learning rate's step increment: the schedule's epochs follow the trainer's.
  epoch_length: EpochLengthState
  schedule: Schedule  # the epoch settings; static (no leaves)
  # Static: None, or the mark that the stage is PRUNED for good and the update is specialised to
  # it (set from outside jit once the masks are final; PRUNED is the last stage).
  pruned_step: PrunedStep | None = None


def full_mask(ls: ClickTrainLayerState) -> jax.Array:
  """The weight mask ``P ⊙ K`` of one layer (HWIO; ones where nothing is pruned yet)."""
  return ls.pattern_mask * ls.kernel_keep.astype(ls.pattern_mask.dtype)
