"""The ClickTrain transform under non-finite losses, gradients and updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune.clicktrain import importance, patterns, readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct


def test_hard_prune_keeps_pruned_weights_zero_under_non_finite_updates():
  # A NaN / Inf update at a pruned position must not reach the pruned weight (0 · NaN = NaN);
  # kept positions pass the inner update unchanged.
  rng = np.random.default_rng(1)
  p = {"conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 8, 6)), jnp.float32)}}
  g = {"conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 8, 6)), jnp.float32)}}
  tx = ct.clicktrain(
    optax.sgd(0.01, momentum=0.9),
    steps_per_epoch=1,
    mode="one_shot",
    one_shot_epoch=0,
    hard_prune_epoch=1,
    kernel_prune_ratio=0.5,
  )
  state = tx.init(p)
  u, state = tx.update(g, state, p)
  p = optax.apply_updates(p, u)
  assert readouts.stage_name(state) == "pruned"
  mask = np.asarray(readouts.masks(state, p)["conv"]["kernel"]) != 0
  bad = g["conv"]["kernel"].at[~mask].set(jnp.nan).at[np.nonzero(~mask)[0][0], 0, 0, 0].set(jnp.inf)
  u, state = tx.update({"conv": {"kernel": bad}}, state, p)
  new = optax.apply_updates(p, u)
  assert np.all(np.asarray(new["conv"]["kernel"])[~mask] == 0.0)
  assert np.all(np.isfinite(u["conv"]["kernel"]))
  # The inner momentum never saw the NaNs: the next finite step is finite everywhere.
  u, state = tx.update(g, state, new)
  assert np.all(np.isfinite(u["conv"]["kernel"]))
  assert np.all(np.asarray(optax.apply_updates(new, u)["conv"]["kernel"])[~mask] == 0.0)


def _one_epoch_stages(inner):
  """Paper mode, 2 steps per epoch: pool = epoch 0, finalization = epoch 1 (pool size 5,
  ratio 0.5, no hard prune before epoch 10)."""
  return ct.clicktrain(
    inner,
    steps_per_epoch=2,
    hard_prune_epoch=10,
    pool_start_epoch=0,
    pool_epochs=1,
    finalize_epochs=1,
    pool_size=5,
    kernel_prune_ratio=0.5,
  )


def _nonfinite_run(tx, bad_step, kind, steps):
  """Drive ``tx`` on one 3x3x8x8 kernel (params held fixed) with batch ``bad_step``'s gradient
  (``kind="grad"``) or loss (``kind="loss"``) non-finite (``bad_step`` an int or a tuple of
  them); returns the weights, the gradients and the states after every step."""
  bad = set(bad_step) if isinstance(bad_step, tuple) else {bad_step}
  rng = np.random.default_rng(7)
  w = jnp.asarray(rng.normal(size=(3, 3, 8, 8)), jnp.float32)
  gs = [jnp.asarray(rng.normal(size=(3, 3, 8, 8)), jnp.float32) for _ in range(steps)]
  update = jax.jit(tx.update)
  st = tx.init({"conv": {"kernel": w}})
  states = []
  for i, g in enumerate(gs):
    loss = jnp.float32(1.0)
    if i in bad and kind == "grad":
      g = g.at[0, 0, 0, 0].set(jnp.nan).at[1, 1, 2, 3].set(jnp.inf)
    if i in bad and kind == "loss":
      loss = jnp.float32(jnp.nan)
    _, st = update({"conv": {"kernel": g}}, st, {"conv": {"kernel": w}}, value=loss)
    states.append(st)
  return w, gs, states


@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "apply_if_finite"])
@pytest.mark.parametrize("kind", ["grad", "loss"])
@pytest.mark.parametrize("bad_step", [1, 2], ids=["pool", "finalize"])
def test_non_finite_step_neither_votes_nor_adds_scores(guarded, kind, bad_step):
  # Issue reproducer: pool = steps 0-1, finalization = steps 2-3. The non-finite batch must be
  # left out of the DPPG scores, the votes and the summed Eq. 2 scores; the masks come from
  # the finite batches only (before the fix: 64/64 NaN scores, kernels pruned by index).
  inner = optax.sgd(0.1)
  tx = _one_epoch_stages(optax.apply_if_finite(inner, 3) if guarded else inner)
  w, gs, states = _nonfinite_run(tx, bad_step, kind, 4)
  assert int(states[-1].stage) == ct_state.REGULARIZE
  _assert_masks_from(
    states[-1].layers["conv/kernel"], w, gs, {0, 1} - {bad_step}, {2, 3} - {bad_step}
  )


def _assert_masks_from(ls, w, gs, pool_steps, finalize_steps):
  """``ls`` holds the pool, votes, scores and masks of DPPG over the batches ``pool_steps`` and
  finalization over ``finalize_steps`` (pool size 5, ratio 0.5), by NumPy."""
  expect = np.zeros(126, np.int64)
  for i in pool_steps:
    imp = np.moveaxis(np.asarray((gs[i] * w) ** 2), (0, 1), (-2, -1))
    expect += np.bincount(np.asarray(patterns.dppg_candidates(imp)).ravel(), minlength=126)
  np.testing.assert_array_equal(ls.competitive_scores, expect)
  pool = np.asarray(ls.pool)
  np.testing.assert_array_equal(pool, sorted(range(126), key=lambda i: (-expect[i], i))[:5])
  pool_masks = patterns.all_patterns()[pool]
  votes = np.zeros((8, 8, 5), np.int64)
  kscore = np.zeros((8, 8))
  for i in finalize_steps:
    s = np.asarray(importance.pattern_scores(w, gs[i], pool_masks))
    votes += np.eye(5, dtype=np.int64)[s.argmax(-1)]
    kscore += np.asarray(importance.kernel_scores(w, gs[i]))
  np.testing.assert_array_equal(ls.votes, votes)
  np.testing.assert_allclose(ls.kernel_score_sum, kscore, rtol=1e-5)
  np.testing.assert_array_equal(ls.pattern_id, pool[votes.argmax(-1)])
  pruned = sorted(range(64), key=lambda i: (kscore.ravel()[i], i))[:32]
  np.testing.assert_array_equal(np.flatnonzero(~np.asarray(ls.kernel_keep).ravel()), sorted(pruned))


@pytest.mark.parametrize("kind", ["grad", "loss"])
@pytest.mark.parametrize("stage", ["pool", "finalize"])
def test_stage_without_a_finite_batch_goes_on_instead_of_choosing_by_index(stage, kind):
  # Every batch of the stage is non-finite: its scores stay all zero, which would pick the
  # pool / prune kernels by index. The stage goes on for another epoch (with a warning) and
  # the masks come from the finite batches only.
  tx = _one_epoch_stages(optax.sgd(0.1))
  bad = (0, 1) if stage == "pool" else (2, 3)
  done = 1 if stage == "pool" else 2
  with pytest.warns(RuntimeWarning, match=f"stage ending after {done} epochs fed its scores"):
    w, gs, states = _nonfinite_run(tx, bad, kind, 6)
    jax.effects_barrier()
  held = states[bad[1]]  # after the bad stage's last step: nothing was chosen
  assert int(held.stage) == (ct_state.POOL if stage == "pool" else ct_state.FINALIZE)
  assert int(held.stage_start_epoch) == (0 if stage == "pool" else 1)
  ls = held.layers["conv/kernel"]
  assert np.all(np.asarray(ls.pattern_id) == -1) and np.all(np.asarray(ls.kernel_keep))
  assert np.all(np.asarray(ls.pattern_mask) == 1)
  assert [int(s.stage) for s in states[4:]] == [ct_state.FINALIZE, ct_state.REGULARIZE]
  pool_steps, finalize_steps = ({2, 3}, {4, 5}) if stage == "pool" else ({0, 1}, {4, 5})
  _assert_masks_from(states[-1].layers["conv/kernel"], w, gs, pool_steps, finalize_steps)


@pytest.mark.parametrize("kind", ["grad", "loss"])
def test_one_shot_pick_defers_past_a_non_finite_batch(kind, kit):
  # The pick batch (first of epoch 1 = step 2) is non-finite: the masks come from step 3.
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=2,
    hard_prune_epoch=3,
    mode="one_shot",
    one_shot_epoch=1,
    kernel_prune_ratio=0.35,
  )
  w, gs, states = _nonfinite_run(tx, 2, kind, 4)
  assert [int(s.stage) for s in states] == [ct_state.WARMUP] * 3 + [ct_state.REGULARIZE]
  pat, keep, _ = kit.one_shot_reference(w, gs[3], 0.35)
  ls = states[-1].layers["conv/kernel"]
  np.testing.assert_array_equal(ls.pattern_id, patterns.library_pattern_ids()[:4][pat])
  np.testing.assert_array_equal(ls.kernel_keep, keep)
