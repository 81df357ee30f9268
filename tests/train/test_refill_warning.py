"""The Trainer warns when pruned weights are non-zero at an epoch end (a transform chained
after the masking re-filled them), and stays quiet when the masking comes last."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt
from jaxprune import masking
from jaxprune.clicktrain import readouts


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.c1 = nnx.Conv(1, 4, (3, 3), use_bias=False, rngs=rngs)  # stem: not pruned
    self.c2 = nnx.Conv(4, 6, (3, 3), use_bias=False, rngs=rngs)  # pattern + kernel pruned
    self.head = nnx.Linear(6, 3, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.c2(nnx.relu(self.c1(x))))
    return self.head(x.mean((1, 2)))


def _batches():
  rng = np.random.default_rng(0)
  return [
    (rng.normal(size=(8, 6, 6, 1)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32))
    for _ in range(2)
  ]


def _fit(tx, epochs=3):
  trainer = jt.Trainer(_Net(nnx.Rngs(0)), tx, progress=False)
  trainer.fit(_batches(), epochs=epochs)
  return trainer


def _pruned_nonzero(trainer):
  m = readouts.masks(trainer.opt_state, trainer.params)
  return masking.count_refilled(m, trainer.params)[0]


def test_trainer_warns_when_adamw_after_clicktrain_refills_and_not_with_mask_last(
  one_shot_clicktrain,
):
  adamw = optax.adamw(1e-2, weight_decay=1e-2)
  with pytest.warns(RuntimeWarning, match=r"pruned weights are non-zero \(first in 'c2/kernel'\)"):
    bad = _fit(optax.chain(one_shot_clicktrain(), adamw))
  assert readouts.stage_name(bad.opt_state) == "pruned"
  assert _pruned_nonzero(bad) > 0  # the warning was right
  m = readouts.masks(bad.opt_state, bad.params)

  # Same run (same model, data and one-shot masks) with the mask transform last: no warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    good = _fit(optax.chain(one_shot_clicktrain(), adamw, masking.mask(m)))
  assert readouts.stage_name(good.opt_state) == "pruned"
  for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(readouts.masks(good.opt_state, good.params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _pruned_nonzero(good) == 0


def test_trainer_quiet_through_clicktrains_own_hard_prune(one_shot_clicktrain):
  # ClickTrain alone: from the end of epoch 1 the state says "pruned" and the weights are
  # masked; that must not warn.
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    trainer = _fit(one_shot_clicktrain())
  assert readouts.stage_name(trainer.opt_state) == "pruned"
  assert _pruned_nonzero(trainer) == 0
  w = np.asarray(trainer.params["c2"]["kernel"])
  assert np.count_nonzero(w) == 4 * 12  # 4 of 9 per kept kernel, half of 4 x 6 kernels kept
  assert jnp.isfinite(w).all()
