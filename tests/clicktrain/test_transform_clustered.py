"""ClickTrain's aligned mode with clustered filter groups (``filter_grouping="clustered"``)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune import clicktrain
from jaxprune.clicktrain import importance, patterns, readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct
from jaxprune.clicktrain._groups import cluster_filters, group_ids, group_sum, lift
from jaxprune.clicktrain.execution.aligned_layout import build_aligned_layout
from jaxprune.state_slicing import ChannelSlices

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


def _unit_rows(x):
  n = np.linalg.norm(x, axis=1, keepdims=True)
  return x / np.where(n > 0, n, 1.0)


def _np_partition(ks, ps, groups):
  """NumPy reference of the clustering: the leading eigenvector of the filters' centred Gram
  matrix (``eigh``, not power iteration), the filters ordered along it and cut in equal chunks;
  as a set of groups (the direction's sign does not change the chunks' sets)."""
  ks = np.asarray(ks, np.float64)
  cout = ks.shape[1]
  blocks = [_unit_rows(ks.T)]
  if ps is not None:
    ps = np.asarray(ps, np.float64)
    total = ps.sum(-1, keepdims=True)
    dist = ps / np.where(total > 0, total, 1.0)
    blocks.append(_unit_rows(dist.transpose(1, 0, 2).reshape(cout, -1)))
  x = np.concatenate(blocks, 1)
  x = x - x.mean(0, keepdims=True)
  _, vecs = np.linalg.eigh(x @ x.T)
  order = np.argsort(vecs[:, -1], kind="stable")
  size = cout // groups
  return {tuple(sorted(order[k * size : (k + 1) * size].tolist())) for k in range(groups)}


def _as_groups(ids):
  ids = np.asarray(ids)
  return {tuple(np.flatnonzero(ids == k).tolist()) for k in np.unique(ids)}


@pytest.mark.parametrize("groups", [None, 2])
def test_consecutive_ids_are_stored_in_every_stage(kit, groups):
  _, states, _ = kit.run(kit.paper_tx(filter_groups=groups))
  _, explicit, _ = kit.run(kit.paper_tx(filter_groups=groups, filter_grouping="consecutive"))
  assert int(states[-1].stage) == ct_state.REGULARIZE
  for st in states:
    for ls in st.layers.values():
      cout = ls.kernel_keep.shape[1]
      want = np.arange(cout) if groups is None else group_ids(cout, groups)
      np.testing.assert_array_equal(ls.filter_group, want)
  jax.tree.map(np.testing.assert_array_equal, explicit[-1], states[-1])  # the default, bit for bit


def test_lifting_with_ids_is_the_numpy_sum_over_each_group():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 8, 3)).astype(np.float32)
  ids = np.array([1, 0, 1, 0, 0, 1, 1, 0], np.int32)
  want = np.stack([x[:, ids == k].sum(1) for k in range(2)], 1)
  np.testing.assert_allclose(group_sum(jnp.asarray(x), 2, axis=1, ids=ids), want, rtol=1e-6)
  np.testing.assert_allclose(lift(jnp.asarray(x), 2, axis=1, ids=ids), want[:, ids], rtol=1e-6)


def test_filters_that_agree_are_grouped():
  # Filters 0 and 2 prefer channels 0-1 and pattern 0, filters 1 and 3 channels 2-3 and
  # pattern 2: the two groups are {0, 2} and {1, 3}, numbered by their lowest filter.
  ks = np.array([[5, 1, 5, 1], [4, 1, 4, 1], [1, 6, 1, 6], [1, 5, 1, 5]], np.float32)
  ps = np.zeros((4, 4, 3), np.float32)
  ps[:, [0, 2], 0] = 3.0
  ps[:, [1, 3], 2] = 2.0
  ids = jax.jit(cluster_filters, static_argnums=2)(ks, ps, 2)
  np.testing.assert_array_equal(ids, [0, 1, 0, 1])
  np.testing.assert_array_equal(cluster_filters(ks, None, 2), [0, 1, 0, 1])  # kernel-only
  # Nothing to tell the filters apart: the consecutive groups.
  np.testing.assert_array_equal(cluster_filters(np.ones((4, 4)), None, 2), [0, 0, 1, 1])


def test_one_shot_groups_filters_whose_weights_agree(kit):
  # The same through the transform: (g ⊙ w) of filter 2 is that of filter 0 (x 1.5), of
  # filter 3 that of filter 1, so their Eq. 1 / Eq. 2 profiles agree.
  rng = np.random.default_rng(3)
  w = rng.normal(size=(3, 3, 6, 4)).astype(np.float32)
  w[..., 2], w[..., 3] = 1.5 * w[..., 0], w[..., 1]
  p = {"conv": {"kernel": jnp.asarray(w)}}
  g = {"conv": {"kernel": jnp.asarray(w)}}
  tx = kit.one_shot_tx(2, filter_grouping="clustered")
  _, st = jax.jit(tx.update)(g, tx.init(p), p)
  assert clicktrain.filter_partition(st) == {"conv/kernel": ((0, 2), (1, 3))}


def test_one_shot_clustered_matches_a_numpy_group_rule(kit):
  groups, ratio = 2, 0.35
  tx = kit.one_shot_tx(groups, kernel_prune_ratio=ratio, filter_grouping="clustered")
  p = kit.params()
  g = kit.fake_grads(p, 0)
  _, st = jax.jit(tx.update)(g, tx.init(p), p)
  w1, g1 = p["block"]["conv1"]["kernel"], g["block"]["conv1"]["kernel"]
  blocks, ids = patterns.one_shot_pool(4)
  eq1 = np.asarray(importance.pattern_scores(w1, g1, jnp.asarray(blocks)), np.float64)
  eq2 = np.asarray(importance.kernel_scores(w1, g1), np.float64)
  ls = st.layers[kit.CONV1]
  partition = _as_groups(ls.filter_group)
  assert partition == _np_partition(eq2, eq1, groups)
  assert partition != _as_groups(group_ids(8, groups))  # not the consecutive groups
  cin = eq2.shape[0]
  for filters in map(list, partition):
    best = np.argmax(eq1[:, filters].sum(1), axis=1)  # Eq. 1 summed over the group's kernels
    ks = eq2[:, filters].sum(1)
    pruned = sorted(range(cin), key=lambda c: (ks[c], c))[: math.ceil(ratio * cin)]
    keep = np.ones(cin, bool)
    keep[pruned] = False
    np.testing.assert_array_equal(
      np.asarray(ls.pattern_id)[:, filters], np.repeat(ids[best][:, None], len(filters), 1)
    )
    np.testing.assert_array_equal(
      np.asarray(ls.kernel_keep)[:, filters], np.repeat(keep[:, None], len(filters), 1)
    )


def test_paper_mode_clusters_the_per_kernel_sums_and_lifts_them(kit):
  groups, lam, eps = 2, 0.01, 1e-8
  # Before the partition is chosen every quantity is per kernel: the pool, votes and Eq. 2
  # sums are the paper mode's.
  p, fine, _ = kit.run(kit.paper_tx())
  _, states, update = kit.run(kit.paper_tx(filter_groups=groups, filter_grouping="clustered"))
  st = states[-1]
  assert int(st.stage) == ct_state.REGULARIZE
  partitions = readouts.filter_partition(st)
  for name, ratio in ((kit.CONV1, 0.25), (kit.CONV2, 0.55)):
    ls, ref = st.layers[name], fine[-1].layers[name]
    ids = np.asarray(ls.filter_group)
    cout = ids.shape[0]
    np.testing.assert_array_equal(np.bincount(ids, minlength=groups), [cout // groups] * groups)
    assert (
      set(partitions[name])
      == _as_groups(ids)
      == _np_partition(ref.kernel_score_sum, ref.votes, groups)
    )
    ks = np.asarray(ref.kernel_score_sum, np.float64)
    for filters in partitions[name]:
      np.testing.assert_allclose(
        np.asarray(ls.kernel_score_sum)[:, filters],
        np.repeat(ks[:, filters].sum(1, keepdims=True), len(filters), 1),
        rtol=1e-5,
      )
      if ref.votes is not None:
        votes = np.asarray(ref.votes)[:, filters].sum(1)  # (Cin, N)
        np.testing.assert_array_equal(np.asarray(ls.votes)[:, filters[0]], votes)
        np.testing.assert_array_equal(
          np.asarray(ls.pattern_id)[:, filters[0]], np.asarray(ref.pool)[np.argmax(votes, 1)]
        )
    # The masks share one pattern per (group, channel) of the clustered groups.
    mask = np.asarray(ls.pattern_mask * ls.kernel_keep)
    layout = build_aligned_layout(mask, partitions[name])
    cin = mask.shape[2]
    for group in layout.groups:
      assert len(group.channels) == cin - math.ceil(ratio * cin)
  # The group lasso's norms run over the clustered groups, each weighted by sqrt(|g|).
  w = np.asarray(p["block"]["conv1"]["kernel"], np.float64)
  ls = st.layers[kit.CONV1]
  ids = np.asarray(ls.filter_group)
  g = np.asarray(kit.fake_grads(p, 6)["block"]["conv1"]["kernel"], np.float64)
  want = g.copy()
  for m in (1 - np.asarray(ls.pattern_mask), (~np.asarray(ls.kernel_keep)).astype(float)):
    z = w * m
    sq = (z * z).sum((0, 1))  # (Cin, Cout)
    norms = np.stack([sq[:, ids == k].sum(1) for k in range(groups)], 1)[:, ids]
    size = np.bincount(ids, minlength=groups)[ids]  # filters in each filter's group
    want += lam * np.sqrt(size) * z / np.sqrt(norms + eps)
  np.testing.assert_allclose(update["block"]["conv1"]["kernel"], want, rtol=2e-5, atol=1e-7)


def test_the_partition_follows_its_filters_through_channel_removal(kit):
  p = kit.params()
  tx = kit.one_shot_tx(2, filter_grouping="clustered")
  _, st = jax.jit(tx.update)(kit.fake_grads(p, 0), tx.init(p), p)
  kept_out = np.array([0, 3, 4, 6, 7])
  new_p = jax.tree.map(lambda x: x, p)
  new_p["block"]["conv1"]["kernel"] = p["block"]["conv1"]["kernel"][..., kept_out]
  new_p["block"]["conv2"]["kernel"] = p["block"]["conv2"]["kernel"][:, :, kept_out]
  slices = ChannelSlices(
    {("block", "conv1"): (None, kept_out), ("block", "conv2"): (kept_out, None)}, p, new_p
  )
  sliced = slices.slice_state(st)
  np.testing.assert_array_equal(
    sliced.layers[kit.CONV1].filter_group, np.asarray(st.layers[kit.CONV1].filter_group)[kept_out]
  )
  np.testing.assert_array_equal(
    sliced.layers[kit.CONV2].filter_group, st.layers[kit.CONV2].filter_group
  )
  partition = readouts.filter_partition(sliced)[kit.CONV1]
  mask = readouts.masks(sliced, new_p)["block"]["conv1"]["kernel"]
  build_aligned_layout(mask, partition)  # still shared within each (now uneven) group


def test_bad_filter_grouping_raises():
  kw = {"steps_per_epoch": 1, "hard_prune_epoch": 2, "mode": "one_shot", "one_shot_epoch": 0}
  with pytest.raises(ValueError, match="filter_grouping.*'nearest'"):
    ct.clicktrain(optax.sgd(0.0), filter_groups=2, filter_grouping="nearest", **kw)
  with pytest.raises(ValueError, match="filter_grouping='clustered'.*filter_groups"):
    ct.clicktrain(optax.sgd(0.0), filter_grouping="clustered", **kw)
