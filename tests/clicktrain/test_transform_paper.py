"""The ClickTrain transform in paper mode: DPPG pool, finalization votes and kernels, hard prune,
read-outs, state round trips, mixed kernel sizes, balanced kernels."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune._states import named_leaves
from jaxprune.clicktrain import importance, patterns, readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct
from jaxprune.train import checkpoint

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


def test_pool_accumulation_and_global_pool(kit):
  _, p, states = kit.paper_run()
  w = p["block"]["conv1"]["kernel"]
  expect = np.zeros(126, np.int64)
  for i in range(2):
    g = kit.fake_grads(p, i)["block"]["conv1"]["kernel"]
    imp = np.moveaxis(np.asarray((g * w) ** 2), (0, 1), (-2, -1))
    expect += np.bincount(np.asarray(patterns.dppg_candidates(imp)).ravel(), minlength=126)
  st = states[2]
  assert int(st.stage) == ct_state.FINALIZE
  np.testing.assert_array_equal(st.layers[kit.CONV1].competitive_scores, expect)
  assert expect.sum() == 2 * 6 * 8
  pool = sorted(range(126), key=lambda i: (-expect[i], i))[:5]
  np.testing.assert_array_equal(st.layers[kit.CONV1].pool, pool)
  assert st.layers[kit.CONV2].pool is None


def _expected_votes(kit, p, steps, pool_masks):
  w = p["block"]["conv1"]["kernel"]
  votes = np.zeros((6, 8, 5), np.int64)
  kscore = np.zeros((6, 8))
  for i in steps:
    g = kit.fake_grads(p, i)["block"]["conv1"]["kernel"]
    s = np.asarray(importance.pattern_scores(w, g, pool_masks))
    votes += np.eye(5, dtype=np.int64)[s.argmax(-1)]
    kscore += np.asarray(importance.kernel_scores(w, g))
  return votes, kscore


def test_finalization_votes_skip_batches_failing_margin(kit):
  _, p, states = kit.paper_run()
  pool = np.asarray(states[2].layers[kit.CONV1].pool)
  pool_masks = patterns.all_patterns()[pool]
  # after batches 2 and 3: batch 3 (loss 0.9 -> 0.99) did not vote
  votes, _ = _expected_votes(kit, p, [2], pool_masks)
  np.testing.assert_array_equal(states[4].layers[kit.CONV1].votes, votes)
  assert int(states[4].layers[kit.CONV1].votes.sum()) == 48
  votes, kscore = _expected_votes(kit, p, [2, 4, 5], pool_masks)
  st = states[-1]
  assert int(st.stage) == ct_state.REGULARIZE
  ls = st.layers[kit.CONV1]
  np.testing.assert_array_equal(ls.votes, votes)
  np.testing.assert_allclose(ls.kernel_score_sum, kscore, rtol=1e-5)
  np.testing.assert_array_equal(ls.pattern_id, pool[votes.argmax(-1)])
  m = np.asarray(ls.pattern_mask)  # the chosen pattern per kernel
  np.testing.assert_array_equal(
    np.moveaxis(m, (0, 1), (-2, -1)), patterns.all_patterns()[np.asarray(ls.pattern_id)]
  )


def test_kernel_finalization_counts(kit):
  st = kit.paper_run()[2][-1]
  for name, n, ratio in ((kit.CONV1, 6 * 8, kit.RATIOS[0]), (kit.CONV2, 8 * 8, kit.RATIOS[1])):
    keep = np.asarray(st.layers[name].kernel_keep)
    assert (~keep).sum() == math.ceil(ratio * n - 1e-9)
    s = np.asarray(st.layers[name].kernel_score_sum)
    assert s[~keep].max() <= s[keep].min()


def test_group_lasso_gradient_matches_autodiff(kit):
  update, p, states = kit.paper_run()
  st = states[-1]
  assert int(st.stage) == ct_state.REGULARIZE
  g = kit.fake_grads(p, 99)
  u, _ = update(g, st, p, value=jnp.float32(0.9))
  penalty_grad = jax.grad(lambda q: kit.LAMBDA * readouts.group_lasso_penalty(q, st))(p)
  expect = jax.tree.map(jnp.add, g, penalty_grad)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(expect)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(penalty_grad["block"]["conv1"]["kernel"]).max()) > 0
  assert float(jnp.abs(penalty_grad["block"]["conv2"]["kernel"]).max()) > 0


def test_params_of_another_structure_raise_naming_the_first_stray_or_missing_layer(kit):
  tx = ct.clicktrain(optax.sgd(0.1, momentum=0.9), steps_per_epoch=1, hard_prune_epoch=3)
  p = kit.params()
  st = tx.init(p)
  block = dict(p["block"])
  conv1 = block.pop("conv1")
  cases = [
    ({**p, "block": {**block, "conv9": conv1}}, "pruned layer 'block/conv9/kernel' is not in"),
    ({**p, "block": block}, "pruned layer 'block/conv1/kernel' is missing from the params"),
    (
      {**p, "block": {**block, "conv1": {"kernel": jnp.zeros((3, 3, 6, 4))}}},
      r"'block/conv1/kernel' has shape \(3, 3, 6, 4\), the ClickTrain state was built for "
      r"\(3, 3, 6, 8\)",
    ),
  ]
  for q, message in cases:
    with pytest.raises(ValueError, match=message):
      tx.update(jax.tree.map(jnp.zeros_like, q), st, q, value=jnp.float32(1.0))


def test_read_outs_say_pruned_only_once_the_weights_are(kit, one_shot_clicktrain):
  # Against the weights themselves: from the step whose state says "pruned" (the last step of
  # epoch hard_prune_epoch - 1), the weights are zero wherever the masks prune, and
  # compression() is the weights' own count of total / nonzero conv weights.
  tx = one_shot_clicktrain()
  p = kit.params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  stages = []
  for i in range(4):
    u, st = update(kit.fake_grads(p, i), st, p)
    p = optax.apply_updates(p, u)
    stages.append(readouts.stage_name(st))
    if stages[-1] == "pruned":
      m = readouts.masks(st, p)
      for w, keep in zip(jax.tree.leaves(p), jax.tree.leaves(m, is_leaf=lambda x: x is None)):
        if keep is not None:
          assert np.all(np.asarray(w)[np.asarray(keep) == 0] == 0.0), i
      convs = [np.asarray(w) for w in jax.tree.leaves(p) if w.ndim == 4]
      total, nonzero = sum(w.size for w in convs), sum(np.count_nonzero(w) for w in convs)
      assert readouts.compression(st, p) == pytest.approx(total / nonzero), i
  assert stages == ["regularize", "pruned", "pruned", "pruned"]


def test_compression_reports_the_weights_and_planned_compression_the_masks(
  kit, one_shot_clicktrain
):
  # Before the hard prune every weight is still there: compression() says 1.0 (a hand count of
  # the nonzero conv weights) while the final masks plan more, which planned_compression()
  # says; once pruned the two agree with the hand count.
  tx = one_shot_clicktrain()
  p = kit.params()
  st = tx.init(p)

  def by_hand(weights, masks=None):
    convs = [(k, np.asarray(w)) for k, w in named_leaves(weights).items() if np.ndim(w) == 4]
    kept = [w * np.asarray(masks[k]) if masks and masks.get(k) is not None else w for k, w in convs]
    return sum(w.size for w in kept) / sum(np.count_nonzero(w) for w in kept)

  u, st = jax.jit(tx.update)(kit.fake_grads(p, 0), st, p)
  p = optax.apply_updates(p, u)
  assert readouts.stage_name(st) == "regularize"  # masks final, weights not yet pruned
  masks = named_leaves(readouts.masks(st, p))
  assert readouts.compression(st, p) == pytest.approx(by_hand(p)) == pytest.approx(1.0)
  planned = readouts.planned_compression(st, p)
  assert planned == pytest.approx(by_hand(p, masks)) and planned > 1.5
  u, st = jax.jit(tx.update)(kit.fake_grads(p, 1), st, p)
  p = optax.apply_updates(p, u)
  assert readouts.stage_name(st) == "pruned"
  assert readouts.compression(st, p) == pytest.approx(by_hand(p))
  assert readouts.compression(st, p) == pytest.approx(readouts.planned_compression(st, p))


def test_hard_prune_keeps_pruned_weights_exactly_zero(kit):
  spe = 2
  inner = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05, momentum=0.9))
  tx = kit.pruning_tx(inner)  # 2 steps per epoch, hard prune at the end of epoch 4
  p = kit.params()
  st = tx.init(p)
  step = kit.train_step(tx)
  mask0 = None
  for i in range(30):
    p, st = step(p, st, *kit.batch(i))
    if i >= spe * 4:  # the first step of epoch 4 (the hard prune) is done
      masks = readouts.masks(st, p)
      if mask0 is None:
        mask0 = masks
      for name, path in ((kit.CONV1, ("block", "conv1")), (kit.CONV2, ("block", "conv2"))):
        w = np.asarray(p[path[0]][path[1]]["kernel"])
        m = np.asarray(masks[path[0]][path[1]]["kernel"])
        assert np.all(w[m == 0] == 0.0), (i, name)
        assert np.all(m == np.asarray(mask0[path[0]][path[1]]["kernel"]))
  assert int(st.stage) == ct_state.PRUNED
  w = np.asarray(p["block"]["conv1"]["kernel"])
  # 4 of 9 per kept kernel, half of the kernels kept
  assert np.count_nonzero(w) == 4 * 24
  assert readouts.compression(st, p) > 1.5
  assert masks["stem"]["kernel"] is None


def test_state_round_trip(tmp_path, kit):
  st = kit.paper_run()[2][-1]
  leaves, tdef = jax.tree.flatten(st)
  back = jax.tree.unflatten(tdef, leaves)
  assert isinstance(back, ct_state.ClickTrainState)
  for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(back)):
    np.testing.assert_array_equal(a, b)
  ocp = pytest.importorskip("orbax.checkpoint")
  path = tmp_path / "ckpt"
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, st)
  with ocp.StandardCheckpointer() as ckptr:
    restored = ckptr.restore(path, jax.tree.map(ocp.utils.to_shape_dtype_struct, st))
  restored = jax.tree.unflatten(tdef, jax.tree.leaves(restored))
  for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(restored)):
    np.testing.assert_array_equal(a, b)


def test_mixed_kernel_sizes_get_one_pool_per_size(kit):
  rng = np.random.default_rng(3)
  p = {
    "a": {"kernel": jnp.asarray(rng.normal(size=(5, 5, 4, 6)), jnp.float32)},
    "b": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 6, 6)), jnp.float32)},
    "c": {"kernel": jnp.asarray(rng.normal(size=(5, 5, 6, 4)), jnp.float32)},
  }
  tx = ct.clicktrain(
    optax.identity(),
    steps_per_epoch=1,
    hard_prune_epoch=5,
    pool_start_epoch=0,
    pool_epochs=1,
    finalize_epochs=1,
    pool_size=3,
    kernel_prune_ratio=0.5,
    # beyond the paper, chosen by hand: the default leaves 5x5 convs dense (patterns are 3x3)
    layer_filter=lambda path, shape: "pattern",
  )
  st = tx.init(p)
  assert st.layers["a/kernel"].competitive_scores.shape == (math.comb(25, 4),)
  update = jax.jit(tx.update)
  for i in range(2):
    _, st = update(kit.fake_grads(p, i), st, p, value=jnp.float32(1.0))
  assert int(st.stage) == ct_state.REGULARIZE
  a, b, c = (st.layers[k] for k in ("a/kernel", "b/kernel", "c/kernel"))
  # one global pool per kernel size: the summed competitive scores of that size's layers
  total5 = np.asarray(a.competitive_scores) + np.asarray(c.competitive_scores)
  expect5 = sorted(range(total5.size), key=lambda i: (-total5[i], i))[:3]
  np.testing.assert_array_equal(a.pool, expect5)
  np.testing.assert_array_equal(c.pool, expect5)
  assert b.pool.shape == (3,) and int(b.competitive_scores.sum()) == 36
  for ls in (a, b, c):
    m = np.asarray(ls.pattern_mask)
    assert np.all(m.sum((0, 1)) == 4)  # 4 kept weights in every kernel
    assert set(np.unique(np.asarray(ls.pattern_id))) <= set(np.asarray(ls.pool).tolist())


def test_state_round_trip_through_train_checkpoint_store(tmp_path, kit):
  st = kit.paper_run()[2][-1]
  store = checkpoint.CheckpointStore(tmp_path / "ckpt")
  store.save(1, {"opt_state": st}, {"epoch": 1})
  fresh = jax.tree.map(jnp.zeros_like, st)
  arrays, meta = store.restore(1, {"opt_state": fresh})
  back = arrays["opt_state"]
  assert isinstance(back, ct_state.ClickTrainState) and meta["epoch"] == 1
  for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(back)):
    np.testing.assert_array_equal(a, b)


def test_balanced_kernels_prune_the_same_number_in_every_filter():
  # ClickTrain §5.2's load-balance constraint: with balanced_kernels every filter keeps the
  # same number of kernels (so every row of the sparse filter matrix has the same length).
  rng = np.random.default_rng(0)
  p = {"conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 8, 6)), jnp.float32)}}
  g = {"conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 8, 6)), jnp.float32)}}
  for balanced in (True, False):
    tx = ct.clicktrain(
      optax.sgd(0.01),
      steps_per_epoch=1,
      mode="one_shot",
      one_shot_epoch=0,
      hard_prune_epoch=1,
      kernel_prune_ratio=0.3,
      balanced_kernels=balanced,
    )
    state = tx.init(p)
    _, state = tx.update(g, state, p)
    keep = readouts.kernel_masks(state)["conv/kernel"]
    scores = np.asarray(importance.kernel_scores(p["conv"]["kernel"], g["conv"]["kernel"]))
    if balanced:
      assert ((~keep).sum(axis=0) == 3).all()  # ceil(0.3 * 8) in every filter
      for f in range(6):
        assert set(np.flatnonzero(~keep[:, f])) == set(np.argsort(scores[:, f], kind="stable")[:3])
    else:
      assert (~keep).sum() == math.ceil(0.3 * 48)
  with pytest.raises(ValueError, match="balanced_kernels"):
    ct.clicktrain(optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, balanced_kernels=1)
