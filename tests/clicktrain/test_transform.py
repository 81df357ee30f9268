"""The ClickTrain transform: stage machine, DPPG pool, finalization, group lasso, hard prune."""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune.clicktrain import importance, patterns, readouts
from jaxprune.clicktrain import transform as ct
from jaxprune.train import checkpoint


def _params(seed=0):
  rng = np.random.default_rng(seed)
  n = lambda *shape, scale: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
  return {
    "stem": {"kernel": n(3, 3, 3, 6, scale=0.3)},
    "block": {
      "conv1": {"kernel": n(3, 3, 6, 8, scale=0.2)},
      "conv2": {"kernel": n(1, 1, 8, 8, scale=0.3)},
      "shortcut": {"kernel": n(1, 1, 6, 8, scale=0.3)},
    },
    "head": {"kernel": n(8, 3, scale=0.3), "bias": jnp.zeros(3)},
  }


def _conv(x, w):
  return jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _loss(p, x, y):
  h = jax.nn.relu(_conv(x, p["stem"]["kernel"]))
  b = jax.nn.relu(_conv(h, p["block"]["conv1"]["kernel"]))
  b = _conv(b, p["block"]["conv2"]["kernel"]) + _conv(h, p["block"]["shortcut"]["kernel"])
  logits = jax.nn.relu(b).mean((1, 2)) @ p["head"]["kernel"] + p["head"]["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(i):
  rng = np.random.default_rng(100 + i)
  return jnp.asarray(rng.normal(size=(8, 6, 6, 3)), jnp.float32), jnp.arange(8) % 3


def _fake_grads(params, i):
  rng = np.random.default_rng(1000 + i)
  return jax.tree.map(lambda l: jnp.asarray(rng.normal(size=l.shape), l.dtype), params)


CONV1, CONV2 = "block/conv1/kernel", "block/conv2/kernel"


def test_default_layer_filter():
  st = ct.clicktrain(optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3).init(_params())
  assert set(st.layers) == {CONV1, CONV2}  # no stem, no 1x1 shortcut, no dense
  assert st.layers[CONV1].votes.shape == (6, 8, 12)
  assert st.layers[CONV2].votes is None  # 1x1: kernel pruning only


def test_stage_schedule_fixed_epochs():
  spe = 3
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=spe,
    hard_prune_epoch=6,
    pool_start_epoch=2,
    pool_epochs=1,
    finalize_epochs=2,
  )
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  stages = []
  for i in range(8 * spe):
    stages.append(int(st.stage))
    _, st = update(_fake_grads(p, i), st, p, value=jnp.float32(1.0))
  per_epoch = [stages[e * spe : (e + 1) * spe] for e in range(8)]
  assert all(len(set(s)) == 1 for s in per_epoch)  # transitions only at epoch ends
  assert [s[0] for s in per_epoch] == [
    ct.WARMUP,
    ct.WARMUP,
    ct.POOL,
    ct.FINALIZE,
    ct.FINALIZE,
    ct.REGULARIZE,
    ct.PRUNED,
    ct.PRUNED,
  ]


def test_loss_derivative_trigger():
  spe = 2
  tx = ct.clicktrain(optax.sgd(0.0), steps_per_epoch=spe, hard_prune_epoch=50)
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  # epoch means: 3.0, 2.0 (Δ=1.0), 1.6 (Δ=0.4), 1.4 (Δ=0.2 < 0.27 -> pool from epoch 4)
  losses = [3.1, 2.9, 2.2, 1.8, 1.5, 1.7, 1.2, 1.6, 1.0, 1.0]
  stages = []
  for i, l in enumerate(losses):
    _, st = update(_fake_grads(p, i), st, p, value=jnp.float32(l))
    stages.append(int(st.stage))
  assert stages[:7] == [ct.WARMUP] * 7
  assert stages[7] == ct.POOL and int(st.stage_start_epoch) == 4


def test_run_still_in_warmup_at_the_hard_prune_epoch_warns_once():
  # The epoch mean loss rises by 1 every epoch: the loss-derivative trigger never fires and
  # the run would stay dense past hard_prune_epoch without a word.
  tx = ct.clicktrain(optax.sgd(0.0), steps_per_epoch=1, hard_prune_epoch=3)
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(6):
      _, st = update(_fake_grads(p, i), st, p, value=jnp.float32(i))
      jax.effects_barrier()
      if i == 1:
        assert not caught  # not before the end of epoch hard_prune_epoch - 1
  messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert len(messages) == 1, messages
  assert messages[0].startswith("clicktrain: still in warmup after 3 epochs (hard_prune_epoch=3)")
  assert int(st.stage) == ct.WARMUP


def test_importance_every_longer_than_a_stage_raises():
  # A 2-epoch finalization of 3 steps each (6 steps) with importance_every=7 may score no
  # batch at all (all-zero scores: masks by index); 6 scores at least one whatever the phase.
  kwargs = dict(steps_per_epoch=3, hard_prune_epoch=20, pool_epochs=4, finalize_epochs=2)
  ct.clicktrain(optax.sgd(0.1), importance_every=6, **kwargs)
  with pytest.raises(
    ValueError,
    match=r"importance_every \(7\) must be <= the shortest importance stage, "
    r"finalize_epochs \* steps_per_epoch = 6 steps",
  ):
    ct.clicktrain(optax.sgd(0.1), importance_every=7, **kwargs)
  # one_shot mode has no per-batch importance work: no limit.
  ct.clicktrain(optax.sgd(0.1), mode="one_shot", one_shot_epoch=1, importance_every=7, **kwargs)


def test_fixed_schedule_that_misses_the_hard_prune_epoch_raises():
  # Masks final at pool_start + pool + finalize, one epoch of regularization before the hard
  # prune: hard_prune_epoch = 5 needs pool_start_epoch <= 2 (the boundary schedule prunes at
  # exactly hard_prune_epoch: test_stage_schedule_fixed_epochs).
  kwargs = dict(steps_per_epoch=1, hard_prune_epoch=5, pool_epochs=1, finalize_epochs=1)
  ct.clicktrain(optax.sgd(0.1), pool_start_epoch=2, **kwargs)
  for start in (3, 7):  # 7: still in warmup at the hard prune epoch
    with pytest.raises(
      ValueError,
      match=rf"hard_prune_epoch \(5\) must be > pool_start_epoch \+ pool_epochs \+ "
      rf"finalize_epochs \({start} \+ 1 \+ 1 = {start + 2}\)",
    ):
      ct.clicktrain(optax.sgd(0.1), pool_start_epoch=start, **kwargs)


# One shared paper-mode run (fixed params, fake gradients, identity inner optimizer so
# that the emitted update is the modified gradient): epoch 0 = DPPG, epochs 1-2 =
# finalization, then regularization. Batch 3's loss rises 10% -> it must not vote.
LOSSES = [1.0, 1.0, 0.9, 0.99, 0.98, 0.97]
RATIOS = (0.25, 0.55)  # conv1, conv2 in flatten order
LAMBDA = 0.01


@functools.lru_cache(maxsize=None)
def _paper_run():
  tx = ct.clicktrain(
    optax.identity(),
    steps_per_epoch=2,
    hard_prune_epoch=50,
    pool_start_epoch=0,
    pool_epochs=1,
    finalize_epochs=2,
    pool_size=5,
    kernel_prune_ratio=RATIOS,
    group_lasso_coefficient=LAMBDA,
  )
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  states = [st]
  for i, l in enumerate(LOSSES):
    _, st = update(_fake_grads(p, i), st, p, value=jnp.float32(l))
    states.append(st)
  return update, p, states


def test_pool_accumulation_and_global_pool():
  _, p, states = _paper_run()
  w = p["block"]["conv1"]["kernel"]
  expect = np.zeros(126, np.int64)
  for i in range(2):
    g = _fake_grads(p, i)["block"]["conv1"]["kernel"]
    imp = np.moveaxis(np.asarray((g * w) ** 2), (0, 1), (-2, -1))
    expect += np.bincount(np.asarray(patterns.dppg_candidates(imp)).ravel(), minlength=126)
  st = states[2]
  assert int(st.stage) == ct.FINALIZE
  np.testing.assert_array_equal(st.layers[CONV1].competitive_scores, expect)
  assert expect.sum() == 2 * 6 * 8
  pool = sorted(range(126), key=lambda i: (-expect[i], i))[:5]
  np.testing.assert_array_equal(st.layers[CONV1].pool, pool)
  assert st.layers[CONV2].pool is None


def _expected_votes(p, steps, pool_masks):
  w = p["block"]["conv1"]["kernel"]
  votes = np.zeros((6, 8, 5), np.int64)
  kscore = np.zeros((6, 8))
  for i in steps:
    g = _fake_grads(p, i)["block"]["conv1"]["kernel"]
    s = np.asarray(importance.pattern_scores(w, g, pool_masks))
    votes += np.eye(5, dtype=np.int64)[s.argmax(-1)]
    kscore += np.asarray(importance.kernel_scores(w, g))
  return votes, kscore


def test_finalization_votes_skip_batches_failing_margin():
  _, p, states = _paper_run()
  pool = np.asarray(states[2].layers[CONV1].pool)
  pool_masks = patterns.all_patterns()[pool]
  # after batches 2 and 3: batch 3 (loss 0.9 -> 0.99) did not vote
  votes, _ = _expected_votes(p, [2], pool_masks)
  np.testing.assert_array_equal(states[4].layers[CONV1].votes, votes)
  assert int(states[4].layers[CONV1].votes.sum()) == 48
  votes, kscore = _expected_votes(p, [2, 4, 5], pool_masks)
  st = states[-1]
  assert int(st.stage) == ct.REGULARIZE
  ls = st.layers[CONV1]
  np.testing.assert_array_equal(ls.votes, votes)
  np.testing.assert_allclose(ls.kernel_score_sum, kscore, rtol=1e-5)
  np.testing.assert_array_equal(ls.pattern_id, pool[votes.argmax(-1)])
  m = np.asarray(ls.pattern_mask)  # the chosen pattern per kernel
  np.testing.assert_array_equal(
    np.moveaxis(m, (0, 1), (-2, -1)), patterns.all_patterns()[np.asarray(ls.pattern_id)]
  )


def test_kernel_finalization_counts():
  st = _paper_run()[2][-1]
  for name, n, ratio in ((CONV1, 6 * 8, RATIOS[0]), (CONV2, 8 * 8, RATIOS[1])):
    keep = np.asarray(st.layers[name].kernel_keep)
    assert (~keep).sum() == math.ceil(ratio * n - 1e-9)
    s = np.asarray(st.layers[name].kernel_score_sum)
    assert s[~keep].max() <= s[keep].min()


@pytest.mark.parametrize("mode", ["paper", "one_shot"])
def test_per_layer_ratio_callable_and_errors(mode):
  # The callable is asked once per pruned layer with its path and shape, and each layer then
  # prunes ceil(ratio(path, shape) · Cin · Cout) kernels.
  table = {CONV1: 0.3, CONV2: 0.7}
  calls = set()

  def ratio(path, shape):
    calls.add((path, tuple(shape)))
    return table[path]

  schedule = (
    dict(pool_start_epoch=0, pool_epochs=1, finalize_epochs=1, pool_size=5)
    if mode == "paper"
    else dict(one_shot_epoch=0)
  )
  tx = ct.clicktrain(
    optax.identity(),
    steps_per_epoch=1,
    hard_prune_epoch=5,
    mode=mode,
    kernel_prune_ratio=ratio,
    **schedule,
  )
  p = _params()
  st = tx.init(p)
  assert set(st.layers) == {CONV1, CONV2}
  assert calls == {(CONV1, (3, 3, 6, 8)), (CONV2, (1, 1, 8, 8))}
  for i in range(2 if mode == "paper" else 1):
    _, st = tx.update(_fake_grads(p, i), st, p, value=jnp.float32(1.0))
  assert int(st.stage) == ct.REGULARIZE
  for name, (cin, cout) in ((CONV1, (6, 8)), (CONV2, (8, 8))):
    pruned = int((~np.asarray(st.layers[name].kernel_keep)).sum())
    assert pruned == math.ceil(table[name] * cin * cout) == {CONV1: 15, CONV2: 45}[name]
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(
      optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=[0.5]
    ).init(_params())
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(
      optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=[0.5, 1.5]
    ).init(_params())


def test_group_lasso_gradient_matches_autodiff():
  update, p, states = _paper_run()
  st = states[-1]
  assert int(st.stage) == ct.REGULARIZE
  g = _fake_grads(p, 99)
  u, _ = update(g, st, p, value=jnp.float32(0.9))
  penalty_grad = jax.grad(lambda q: LAMBDA * readouts.group_lasso_penalty(q, st))(p)
  expect = jax.tree.map(jnp.add, g, penalty_grad)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(expect)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  assert float(jnp.abs(penalty_grad["block"]["conv1"]["kernel"]).max()) > 0
  assert float(jnp.abs(penalty_grad["block"]["conv2"]["kernel"]).max()) > 0


def test_params_of_another_structure_raise_naming_the_first_stray_or_missing_layer():
  tx = ct.clicktrain(optax.sgd(0.1, momentum=0.9), steps_per_epoch=1, hard_prune_epoch=3)
  p = _params()
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


def test_read_outs_say_pruned_only_once_the_weights_are():
  # Against the weights themselves: from the step whose state says "pruned" (the last step of
  # epoch hard_prune_epoch - 1), the weights are zero wherever the masks prune, and
  # compression() is the weights' own count of total / nonzero conv weights.
  tx = ct.clicktrain(
    optax.sgd(0.05, momentum=0.9),
    steps_per_epoch=2,
    mode="one_shot",
    one_shot_epoch=0,
    hard_prune_epoch=1,
    kernel_prune_ratio=0.5,
  )
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  stages = []
  for i in range(4):
    u, st = update(_fake_grads(p, i), st, p)
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


def test_hard_prune_keeps_pruned_weights_exactly_zero():
  spe = 2
  inner = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05, momentum=0.9))
  tx = ct.clicktrain(
    inner,
    steps_per_epoch=spe,
    hard_prune_epoch=4,
    pool_start_epoch=1,
    pool_epochs=1,
    finalize_epochs=1,
    pool_size=6,
    kernel_prune_ratio=0.5,
  )
  p = _params()
  st = tx.init(p)

  @jax.jit
  def step(p, st, x, y):
    l, g = jax.value_and_grad(_loss)(p, x, y)
    u, st = tx.update(g, st, p, value=l)
    return optax.apply_updates(p, u), st

  mask0 = None
  for i in range(30):
    p, st = step(p, st, *_batch(i))
    if i >= spe * 4:  # the first step of epoch 4 (the hard prune) is done
      masks = readouts.masks(st, p)
      if mask0 is None:
        mask0 = masks
      for name, path in ((CONV1, ("block", "conv1")), (CONV2, ("block", "conv2"))):
        w = np.asarray(p[path[0]][path[1]]["kernel"])
        m = np.asarray(masks[path[0]][path[1]]["kernel"])
        assert np.all(w[m == 0] == 0.0), (i, name)
        assert np.all(m == np.asarray(mask0[path[0]][path[1]]["kernel"]))
  assert int(st.stage) == ct.PRUNED
  w = np.asarray(p["block"]["conv1"]["kernel"])
  # 4 of 9 per kept kernel, half of the kernels kept
  assert np.count_nonzero(w) == 4 * 24
  assert readouts.compression(st, p) > 1.5
  assert masks["stem"]["kernel"] is None


# The released code's pattern table, transcribed from it (rows top -> bottom); a pool of
# 4, 8 or 12 is its head.
_RELEASED_TABLE = (
  "000/011/011", "000/110/110", "011/011/000", "110/110/000",
  "000/001/111", "000/111/010", "010/011/010", "010/110/010",
  "111/010/000", "000/100/111", "111/100/000", "000/101/011",
)  # fmt: skip


def _one_shot_reference(w, g, ratio, num_patterns=4):
  """NumPy re-implementation of the released code's rule on one batch."""
  w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
  blocks = [
    np.array([[c == "1" for c in r] for r in s.split("/")], float)
    for s in _RELEASED_TABLE[:num_patterns]
  ]
  kh, kw, cin, cout = w.shape
  pat = np.zeros((cin, cout), int)
  ks = np.zeros((cin, cout))
  for c in range(cin):
    for f in range(cout):
      t = g[:, :, c, f] * w[:, :, c, f]
      scores = [np.sum((t * b) ** 2) for b in blocks]
      pat[c, f] = int(np.argmax(scores))
      ks[c, f] = np.sum(t**2)
  n_pruned = math.ceil(ratio * cin * cout)
  flat = sorted(range(cin * cout), key=lambda i: (ks.ravel()[i], i))[:n_pruned]
  keep = np.ones(cin * cout, bool)
  keep[flat] = False
  mask = np.stack([blocks[i] for i in pat.ravel()]).reshape(cin, cout, 3, 3)
  return pat, keep.reshape(cin, cout), np.moveaxis(mask, (2, 3), (0, 1)) * keep.reshape(cin, cout)


@pytest.mark.parametrize("num_patterns", [4, 8, 12])
def test_one_shot_matches_released_rule(num_patterns):
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
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  for i in range(spe + 1):
    _, st = update(_fake_grads(p, i), st, p)
    assert int(st.stage) == (ct.WARMUP if i < spe else ct.REGULARIZE)
  g = _fake_grads(p, spe)  # the first batch of epoch 1
  pat, keep, mask = _one_shot_reference(
    p["block"]["conv1"]["kernel"], g["block"]["conv1"]["kernel"], 0.35, num_patterns
  )
  ls = st.layers[CONV1]
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
  assert set(np.flatnonzero(~np.asarray(st.layers[CONV2].kernel_keep).ravel())) == set(
    sorted(range(64), key=lambda i: (ks.ravel()[i], i))[:n]
  )


def test_one_shot_ties_go_to_first_pattern():
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=1,
    hard_prune_epoch=3,
    mode="one_shot",
    one_shot_epoch=0,
    kernel_prune_ratio=0.0,
  )
  p = jax.tree.map(jnp.ones_like, _params())
  st = tx.init(p)
  _, st = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, p), st, p)
  assert np.all(np.asarray(st.layers[CONV1].pattern_id) == patterns.library_pattern_ids()[0])


def test_state_round_trip(tmp_path):
  st = _paper_run()[2][-1]
  leaves, tdef = jax.tree.flatten(st)
  back = jax.tree.unflatten(tdef, leaves)
  assert isinstance(back, ct.ClickTrainState)
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


def test_bad_arguments():
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="mode"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, mode="admm")
  with pytest.raises(ValueError, match="steps_per_epoch"):
    ct.clicktrain(sgd, steps_per_epoch=0, hard_prune_epoch=3)
  with pytest.raises(ValueError, match="one_shot_epoch"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, mode="one_shot")
  for bad in (0, 6, 16, True, 4.5):
    with pytest.raises(ValueError, match=r"^one_shot_patterns must be one of \(4, 8, 12\)"):
      ct.clicktrain(
        sgd,
        steps_per_epoch=1,
        hard_prune_epoch=3,
        mode="one_shot",
        one_shot_epoch=1,
        one_shot_patterns=bad,
      )
  with pytest.raises(ValueError, match="hard_prune_epoch"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=2, mode="one_shot", one_shot_epoch=2)
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=-0.1)
  with pytest.raises(ValueError, match="group_lasso"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, group_lasso_coefficient=-1.0)
  with pytest.raises(ValueError, match="margin_rule"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, margin_rule="x")
  with pytest.raises(ValueError, match="pool_size"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, pool_size=0)
  with pytest.raises(ValueError, match="layer_filter"):
    ct.clicktrain(
      sgd, steps_per_epoch=1, hard_prune_epoch=3, layer_filter=lambda path, shape: "yes"
    ).init(_params())
  tx = ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3)
  p = _params()
  with pytest.raises(ValueError, match="loss"):
    tx.update(p, tx.init(p), p)
  with pytest.raises(ValueError, match="params"):
    tx.update(p, tx.init(p), value=1.0)


def test_mixed_kernel_sizes_get_one_pool_per_size():
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
  )
  st = tx.init(p)
  assert st.layers["a/kernel"].competitive_scores.shape == (math.comb(25, 4),)
  update = jax.jit(tx.update)
  for i in range(2):
    _, st = update(_fake_grads(p, i), st, p, value=jnp.float32(1.0))
  assert int(st.stage) == ct.REGULARIZE
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


def test_state_round_trip_through_train_checkpoint_store(tmp_path):
  st = _paper_run()[2][-1]
  store = checkpoint.CheckpointStore(tmp_path / "ckpt")
  store.save(1, {"opt_state": st}, {"epoch": 1})
  fresh = jax.tree.map(jnp.zeros_like, st)
  arrays, meta = store.restore(1, {"opt_state": fresh})
  back = arrays["opt_state"]
  assert isinstance(back, ct.ClickTrainState) and meta["epoch"] == 1
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
  assert int(states[-1].stage) == ct.REGULARIZE
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
  assert int(held.stage) == (ct.POOL if stage == "pool" else ct.FINALIZE)
  assert int(held.stage_start_epoch) == (0 if stage == "pool" else 1)
  ls = held.layers["conv/kernel"]
  assert np.all(np.asarray(ls.pattern_id) == -1) and np.all(np.asarray(ls.kernel_keep))
  assert np.all(np.asarray(ls.pattern_mask) == 1)
  assert [int(s.stage) for s in states[4:]] == [ct.FINALIZE, ct.REGULARIZE]
  pool_steps, finalize_steps = ({2, 3}, {4, 5}) if stage == "pool" else ({0, 1}, {4, 5})
  _assert_masks_from(states[-1].layers["conv/kernel"], w, gs, pool_steps, finalize_steps)


@pytest.mark.parametrize("kind", ["grad", "loss"])
def test_one_shot_pick_defers_past_a_non_finite_batch(kind):
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
  assert [int(s.stage) for s in states] == [ct.WARMUP] * 3 + [ct.REGULARIZE]
  pat, keep, _ = _one_shot_reference(w, gs[3], 0.35)
  ls = states[-1].layers["conv/kernel"]
  np.testing.assert_array_equal(ls.pattern_id, patterns.library_pattern_ids()[:4][pat])
  np.testing.assert_array_equal(ls.kernel_keep, keep)


def _np_group_lasso(w, pattern_mask, kernel_keep, eps):
  """ClickTrain §4.4 by a plain loop over kernels, in float64: the value
  Σ_kernels [sqrt(‖W⊙¬P‖² + ε) + sqrt(‖W⊙¬K‖² + ε)] and its hand-derived gradient
  (d sqrt(‖v‖² + ε) / dv = v / sqrt(‖v‖² + ε), per kernel)."""
  w, pm = np.asarray(w, np.float64), np.asarray(pattern_mask, np.float64)
  keep = np.asarray(kernel_keep)
  value, grad = 0.0, np.zeros_like(w)
  for c in range(w.shape[2]):
    for f in range(w.shape[3]):
      k = w[:, :, c, f]
      for v in (k * (1 - pm[:, :, c, f]), k * (0.0 if keep[c, f] else 1.0)):
        norm = math.sqrt(float(np.sum(v * v)) + eps)
        value += norm
        grad[:, :, c, f] += v / norm
  return value, grad


def test_group_lasso_penalty_and_gradient_match_a_plain_loop():
  # The penalty and the gradient the transform adds while regularizing, against the NumPy
  # loop (not against autodiff of the same formula); the hand-derived gradient is itself
  # checked by central differences of the loop's value.
  update, p, states = _paper_run()
  st = states[-1]
  assert int(st.stage) == ct.REGULARIZE
  eps = 1e-8
  named = {CONV1: p["block"]["conv1"]["kernel"], CONV2: p["block"]["conv2"]["kernel"]}
  total, grads = 0.0, {}
  for name, w in named.items():
    ls = st.layers[name]
    assert (~np.asarray(ls.kernel_keep)).any()  # both terms are live
    value, grads[name] = _np_group_lasso(w, ls.pattern_mask, ls.kernel_keep, eps)
    total += value
  np.testing.assert_allclose(float(readouts.group_lasso_penalty(p, st, eps)), total, rtol=1e-5)
  # Central differences on a few entries of conv1: pruned-kernel, off-pattern and kept.
  w = np.asarray(named[CONV1], np.float64)
  ls = st.layers[CONV1]
  pm = np.asarray(ls.pattern_mask)
  pruned_kernel = tuple(np.argwhere(~np.asarray(ls.kernel_keep))[0])
  kept_kernel = tuple(np.argwhere(np.asarray(ls.kernel_keep))[0])
  off = tuple(np.argwhere(pm[:, :, kept_kernel[0], kept_kernel[1]] == 0)[0])
  on = tuple(np.argwhere(pm[:, :, kept_kernel[0], kept_kernel[1]] == 1)[0])
  h = 1e-6
  for idx in ((1, 1) + pruned_kernel, off + kept_kernel, on + kept_kernel):
    wp, wm = w.copy(), w.copy()
    wp[idx] += h
    wm[idx] -= h
    fd = (
      _np_group_lasso(wp, pm, ls.kernel_keep, eps)[0]
      - _np_group_lasso(wm, pm, ls.kernel_keep, eps)[0]
    ) / (2 * h)
    np.testing.assert_allclose(grads[CONV1][idx], fd, rtol=1e-6, atol=1e-8)
  assert grads[CONV1][on + kept_kernel] == 0.0  # a kept weight of a kept kernel: no pull
  # The transform adds λ × the loop's gradient (identity inner optimizer), and the private
  # helper computes it.
  g = _fake_grads(p, 99)
  u, _ = update(g, st, p, value=jnp.float32(0.9))
  for name, path in ((CONV1, ("block", "conv1")), (CONV2, ("block", "conv2"))):
    added = np.asarray(u[path[0]][path[1]]["kernel"]) - np.asarray(g[path[0]][path[1]]["kernel"])
    np.testing.assert_allclose(added, LAMBDA * grads[name], rtol=1e-4, atol=1e-7)
    direct = ct._group_lasso_grad(named[name], st.layers[name], eps)
    np.testing.assert_allclose(direct, grads[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
  "inner, moments",
  [
    (optax.sgd(0.01, momentum=0.9), {"trace": 0.9}),
    (optax.adam(0.01), {"mu": 0.9, "nu": 0.999}),
  ],
  ids=["momentum", "adam"],
)
def test_pruned_stage_masks_gradients_before_the_inner_optimizer(inner, moments):
  # Once pruned, the inner optimizer sees a zero gradient at pruned positions (the hard mask
  # alone would keep the weights at 0 but let its moments follow the gradient there). Large
  # gradients everywhere make any leak visible.
  rng = np.random.default_rng(2)
  p = {"conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 8, 6)), jnp.float32)}}
  big = lambda i: {
    "conv": {"kernel": jnp.asarray(np.random.default_rng(i).normal(size=(3, 3, 8, 6)) * 1e3)}
  }
  tx = ct.clicktrain(
    inner,
    steps_per_epoch=1,
    mode="one_shot",
    one_shot_epoch=0,
    hard_prune_epoch=1,
    kernel_prune_ratio=0.5,
  )
  update = jax.jit(tx.update)
  u, state = update(big(0), tx.init(p), p)  # the pick + one regularized step, then pruned
  p = optax.apply_updates(p, u)
  assert readouts.stage_name(state) == "pruned"
  pruned = np.asarray(readouts.masks(state, p)["conv"]["kernel"]) == 0
  assert 0 < pruned.sum() < pruned.size
  get = lambda st, key: np.asarray(optax.tree_utils.tree_get(st.inner_state, key)["conv"]["kernel"])
  at_prune = {key: get(state, key) for key in moments}
  assert all(np.abs(m[pruned]).min() > 0 for m in at_prune.values())
  # From the prune on the moments at pruned positions only decay: m_t = β^t · m_prune (the
  # moment updates add (1 - β)·g or g, here exactly 0).
  for i in range(1, 4):
    u, state = update(big(i), state, p)
    p = optax.apply_updates(p, u)
    for key, beta in moments.items():
      expect = at_prune[key][pruned]
      for _ in range(i):
        expect = np.float32(beta) * expect
      np.testing.assert_array_equal(get(state, key)[pruned], expect)
  # A fresh inner state (moments all zero) stays exactly zero at pruned positions while the
  # kept ones move.
  state = state._replace(inner_state=inner.init(p))
  for i in range(4, 7):
    u, state = update(big(i), state, p)
    p = optax.apply_updates(p, u)
  for key in moments:
    m = get(state, key)
    assert np.all(m[pruned] == 0.0), key
    assert np.all(m[~pruned] != 0.0), key
  assert np.all(np.asarray(p["conv"]["kernel"])[pruned] == 0.0)


@pytest.mark.parametrize(
  "ratio",
  [True, [True, 0.5], lambda path, shape: True],
  ids=["scalar", "sequence", "callable"],
)
def test_bool_kernel_prune_ratio_is_rejected_not_pruning_every_kernel(ratio):
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(
      optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=ratio
    ).init(_params())
