"""The ClickTrain transform in one-shot mode against the released code's rule."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune.clicktrain import importance, patterns, readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct


@pytest.mark.parametrize("num_patterns", [4, 8, 12])
def test_one_shot_matches_released_rule(num_patterns, kit):
  spe = 2
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=spe,
    hard_prune_epoch=3,
    mode="one_shot",
    one_shot_epoch=1,
    one_shot_patterns=num_patterns,
    kernel_prune_ratio=0.35,
  )
  p = kit.params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  for i in range(spe + 1):
    _, st = update(kit.fake_grads(p, i), st, p)
    assert int(st.stage) == (ct_state.WARMUP if i < spe else ct_state.REGULARIZE)
  g = kit.fake_grads(p, spe)  # the first batch of epoch 1
  pat, keep, mask = kit.one_shot_reference(
    p["block"]["conv1"]["kernel"], g["block"]["conv1"]["kernel"], 0.35, num_patterns
  )
  ls = st.layers[kit.CONV1]
  pool_ids = patterns.one_shot_pool(num_patterns)[1]
  np.testing.assert_array_equal(ls.pattern_id, pool_ids[pat])
  # Only pool patterns are used, and a bigger pool is actually used beyond the first four.
  assert set(np.unique(ls.pattern_id)) <= set(pool_ids.tolist())
  if num_patterns > 4:
    assert pat.max() >= 4
  np.testing.assert_array_equal(ls.kernel_keep, keep)
  np.testing.assert_array_equal(readouts.masks(st, p)["block"]["conv1"]["kernel"], mask)
  ks = np.asarray(
    importance.kernel_scores(p["block"]["conv2"]["kernel"], g["block"]["conv2"]["kernel"])
  )
  n = math.ceil(0.35 * 64)
  assert set(np.flatnonzero(~np.asarray(st.layers[kit.CONV2].kernel_keep).ravel())) == set(
    sorted(range(64), key=lambda i: (ks.ravel()[i], i))[:n]
  )


def test_one_shot_ties_go_to_first_pattern(kit):
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=1,
    hard_prune_epoch=3,
    mode="one_shot",
    one_shot_epoch=0,
    kernel_prune_ratio=0.0,
  )
  p = jax.tree.map(jnp.ones_like, kit.params())
  st = tx.init(p)
  _, st = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, p), st, p)
  assert np.all(np.asarray(st.layers[kit.CONV1].pattern_id) == patterns.library_pattern_ids()[0])
