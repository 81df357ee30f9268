"""Pattern tables, DPPG, pool accumulation and finalization (ClickTrain §4.2-4.3)."""

import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune.clicktrain import patterns


# ---------------------------------------------------------------- tables
@pytest.mark.parametrize("k,size", [(4, 3), (2, 2), (4, 5), (1, 3)])
def test_all_patterns_count_and_lexicographic_order(k, size):
  pats = patterns.all_patterns(k, size)
  combos = list(itertools.combinations(range(size * size), k))
  assert pats.shape == (math.comb(size * size, k), size, size)
  assert pats.shape[0] == patterns.num_patterns(k, size)
  for i, combo in enumerate(combos):
    assert tuple(np.flatnonzero(pats[i].reshape(-1))) == combo
  # lexicographic: flattened masks read as bit strings strictly decrease
  keys = [tuple(np.flatnonzero(p.reshape(-1))) for p in pats]
  assert keys == sorted(keys)


def test_pattern_index_inverts_table():
  for size in (3, 5):
    combos = list(itertools.combinations(range(size * size), 4))
    pick = np.random.default_rng(0).permutation(len(combos))[:300]
    pos = np.array([combos[i] for i in pick])
    shuffled = np.random.default_rng(1).permuted(pos, axis=1)  # order must not matter
    np.testing.assert_array_equal(patterns.pattern_index(shuffled, size), pick)


def test_library_and_centre_blocks():
  lib = patterns.library_patterns()
  assert lib.shape == (12, 3, 3) and np.all(lib.sum((1, 2)) == 4)
  assert len({tuple(m.ravel()) for m in lib}) == 12
  ids = patterns.library_pattern_ids()
  np.testing.assert_array_equal(patterns.all_patterns()[ids], lib)
  blocks = patterns.centre_block_patterns()
  for b in blocks:  # a 2x2 block containing the centre
    r, c = np.nonzero(b)
    assert b[1, 1] == 1 and np.ptp(r) == 1 and np.ptp(c) == 1
  assert len({tuple(m.ravel()) for m in blocks}) == 4


def test_bad_args():
  with pytest.raises(ValueError, match="k must"):
    patterns.all_patterns(10, 3)
  with pytest.raises(ValueError, match="size must"):
    patterns.all_patterns(4, 0)
  with pytest.raises(ValueError, match="importance"):
    patterns.dppg_candidates(jnp.ones((2, 3, 4)))
  with pytest.raises(ValueError, match="importance"):
    patterns.dppg_candidates(jnp.ones((1, 1)))
  with pytest.raises(ValueError, match="n must"):
    patterns.select_pool(jnp.zeros(126), 0)
  with pytest.raises(ValueError, match="ratio"):
    patterns.kernel_keep_mask(jnp.zeros((2, 2)), 1.5)
  with pytest.raises(ValueError, match="rule"):
    patterns.loss_margin_ok(1.0, 1.0, 0.1, rule="other")


# ---------------------------------------------------------------- DPPG
def _ref_dppg(imp):
  """Plain-Python DPPG on one (k, k) kernel: exhaustive step 4, ties lowest."""
  k = imp.shape[0]
  flat = list(imp.reshape(-1))
  rc = [divmod(i, k) for i in range(k * k)]

  def best(cands):
    b = None
    for i in sorted(cands):
      if b is None or flat[i] > flat[b]:
        b = i
    return b

  p1 = best(range(k * k))
  n8 = [i for i in range(k * k) if max(abs(rc[i][0] - rc[p1][0]), abs(rc[i][1] - rc[p1][1])) == 1]
  p2 = best(n8)
  four = lambda p: {
    i for i in range(k * k) if abs(rc[i][0] - rc[p][0]) + abs(rc[i][1] - rc[p][1]) == 1
  }
  cand = sorted((four(p1) | four(p2)) - {p1, p2})
  top, top_pair = None, None
  for pair in itertools.combinations(cand, 2):  # "all possible combinations"
    s = flat[pair[0]] + flat[pair[1]]
    if top is None or s > top:
      top, top_pair = s, pair
  combo = tuple(sorted((p1, p2) + top_pair))
  return _combo_ids(k)[combo]


_COMBO_IDS = {}


def _combo_ids(k):
  if k not in _COMBO_IDS:
    _COMBO_IDS[k] = {c: i for i, c in enumerate(itertools.combinations(range(k * k), 4))}
  return _COMBO_IDS[k]


def _id(rows):
  m = np.array([[c == "1" for c in r] for r in rows.split("/")])
  return list(itertools.combinations(range(9), 4)).index(tuple(np.flatnonzero(m)))


def test_dppg_hand_made_kernels():
  cases = [
    # p1 = centre, p2 = right of it, best candidates below / below-right
    ([[0, 0, 0], [0, 9, 8], [0, 7, 1]], "000/011/011"),
    # p2 diagonal (centre); position 8 is diagonal to both -> never a candidate
    ([[9, 0, 0], [5, 8, 6], [0, 0, 7]], "100/111/000"),
    # all equal: p1 = 0, p2 = 1, candidates {2, 3, 4} -> 2, 3
    ([[1, 1, 1], [1, 1, 1], [1, 1, 1]], "111/100/000"),
    # p1 ties between 2 and 6 -> 2; p2 ties between 1 and 5 -> 1;
    # candidates {0, 4, 5}: 5 (3) then tie 0/4 (1) -> 0
    ([[1, 3, 5], [0, 1, 3], [5, 0, 1]], "111/001/000"),
  ]
  imp = jnp.array([c for c, _ in cases], jnp.float32)
  got = np.asarray(patterns.dppg_candidates(imp))
  np.testing.assert_array_equal(got, [_id(r) for _, r in cases])
  np.testing.assert_array_equal(got, [_ref_dppg(np.array(c, float)) for c, _ in cases])


@pytest.mark.parametrize("size", [3, 5, 7])
def test_dppg_matches_reference_random(size):
  rng = np.random.default_rng(size)
  # small integers so that ties happen often
  imp = rng.integers(0, 4, size=(6, 5, size, size)).astype(np.float32)
  got = np.asarray(jax.jit(patterns.dppg_candidates)(imp))
  assert got.shape == (6, 5)
  ref = np.array([_ref_dppg(m) for m in imp.reshape(-1, size, size)]).reshape(6, 5)
  np.testing.assert_array_equal(got, ref)


# ---------------------------------------------------------------- pool
def test_competitive_scores_and_pool():
  rng = np.random.default_rng(0)
  batches = [rng.integers(0, 10, size=(4, 6)) for _ in range(5)]
  scores = jnp.zeros(126, jnp.int32)
  for b in batches:
    scores = patterns.accumulate_competitive_scores(scores, b)
  skipped = patterns.accumulate_competitive_scores(scores, batches[0], weight=0)
  np.testing.assert_array_equal(skipped, scores)
  counter = collections.Counter(np.concatenate([b.ravel() for b in batches]).tolist())
  for i in range(126):
    assert int(scores[i]) == counter.get(i, 0)
  pool = np.asarray(patterns.select_pool(scores, 8))
  ref = sorted(range(126), key=lambda i: (-counter.get(i, 0), i))[:8]
  np.testing.assert_array_equal(pool, ref)


def test_select_pool_ties_to_lower_id():
  scores = jnp.zeros(126, jnp.int32).at[jnp.array([50, 7, 90])].set(3)
  np.testing.assert_array_equal(patterns.select_pool(scores, 5), [7, 50, 90, 0, 1])


# ---------------------------------------------------------------- finalization
def test_vote_and_finalize():
  s = jnp.array([[[1.0, 3.0, 3.0], [5.0, 0.0, 1.0]]])  # (1, 2, 3): tie -> position 1
  votes = jnp.zeros((1, 2, 3), jnp.int32)
  votes = patterns.vote(votes, s, True)
  np.testing.assert_array_equal(votes, [[[0, 1, 0], [1, 0, 0]]])
  votes = patterns.vote(votes, s, False)  # skipped batch
  np.testing.assert_array_equal(votes, [[[0, 1, 0], [1, 0, 0]]])
  votes = patterns.vote(votes, jnp.array([[[0.0, 0, 1], [0, 0, 1]]]), True)
  votes = patterns.vote(votes, jnp.array([[[0.0, 0, 1], [0, 0, 1]]]), True)
  np.testing.assert_array_equal(patterns.finalize_patterns(votes), [[2, 2]])


def test_loss_margin_rule():
  delta = 0.0018
  ok = lambda a, b, r="relative": bool(
    patterns.loss_margin_ok(jnp.float32(a), jnp.float32(b), delta, r)
  )
  assert ok(2.0, 1.0)  # loss fell: vote
  assert ok(1.0, 1.001)  # rose by 0.1% < delta: vote
  assert not ok(1.0, 1.01)  # rose by 1%: skip
  assert ok(1.0, 100.0, "literal")  # literal reading: only a 555x jump skips
  assert not ok(1.0, 1000.0, "literal")


@pytest.mark.parametrize(
  "ratio,shape", [(0.35, (10, 10)), (0.5, (3, 5)), (0.0, (4, 4)), (1.0, (2, 3)), (0.55, (7, 9))]
)
def test_kernel_keep_mask_counts(ratio, shape):
  rng = np.random.default_rng(0)
  scores = rng.integers(0, 5, size=shape).astype(np.float32)  # many ties
  keep = np.asarray(patterns.kernel_keep_mask(jnp.asarray(scores), ratio))
  n = scores.size
  n_pruned = math.ceil(round(ratio * n, 9))
  assert (~keep).sum() == n_pruned
  # the pruned set = the n_pruned lowest scores, ties to lower flat index
  order = sorted(range(n), key=lambda i: (scores.ravel()[i], i))
  assert set(np.flatnonzero(~keep.ravel())) == set(order[:n_pruned])


def test_pattern_mask_layout():
  pool = patterns.library_patterns()
  ids = jnp.array([[0, 5], [11, 3]])
  keep = jnp.array([[True, False], [True, True]])
  m = np.asarray(patterns.pattern_mask(ids, pool, keep))
  assert m.shape == (3, 3, 2, 2)
  np.testing.assert_array_equal(m[:, :, 0, 0], pool[0])
  np.testing.assert_array_equal(m[:, :, 0, 1], 0)
  np.testing.assert_array_equal(m[:, :, 1, 0], pool[11])
  np.testing.assert_array_equal(m[:, :, 1, 1], pool[3])


@pytest.mark.parametrize("unrank", [False, True], ids=["table-where-small", "unranked"])
@pytest.mark.parametrize("size", [2, 3, 5])
def test_pattern_masks_from_ids_inverts_index(size, unrank, monkeypatch):
  """Against the itertools listing, on both paths: the gather from the table of every pattern
  (small kernels) and the unranking (large ones; forced for every size by a zero limit)."""
  if unrank:
    monkeypatch.setattr(patterns, "_MASK_TABLE_LIMIT", 0)
  table = patterns.all_patterns(4, size)
  ids = np.arange(len(table)) if size < 5 else np.random.default_rng(0).integers(0, len(table), 500)
  np.testing.assert_array_equal(
    jax.jit(patterns.pattern_masks_from_ids, static_argnums=1)(ids, size), table[ids]
  )


def test_kernel_keep_mask_per_filter_prunes_the_same_number_in_every_filter():
  rng = np.random.default_rng(0)
  scores = rng.random((10, 6)).astype(np.float32)
  scores[:, 2] = 1.0  # a filter of ties: the lower input channels go first
  keep = np.asarray(patterns.kernel_keep_mask(jnp.asarray(scores), 0.35, per_filter=True))
  pruned_per_filter = (~keep).sum(axis=0)
  assert (pruned_per_filter == 4).all()  # ceil(0.35 * 10)
  for f in range(6):  # by a plain loop: the 4 lowest of each filter, ties to the lower index
    order = sorted(range(10), key=lambda c: (scores[c, f], c))
    assert set(np.flatnonzero(~keep[:, f])) == set(order[:4])
  # The layer-wide default prunes ceil(0.35 * 60) = 21, unevenly spread.
  layer = np.asarray(patterns.kernel_keep_mask(jnp.asarray(scores), 0.35))
  assert (~layer).sum() == 21
  with pytest.raises(ValueError, match="scores must be"):
    patterns.kernel_keep_mask(jnp.ones((2, 3, 4)), 0.5, per_filter=True)


@pytest.mark.parametrize(
  "positions", [[0, 1, 1, 4], [0, 1, 2, 9], [-1, 0, 1, 2]], ids=["repeat", "past-end", "negative"]
)
def test_pattern_index_rejects_invalid_positions_instead_of_minus_one(positions):
  with pytest.raises(ValueError, match="positions"):
    patterns.pattern_index(np.array([positions]), 3)


@pytest.mark.parametrize("bad", [-1, math.comb(9, 4)])
def test_pattern_masks_from_ids_rejects_invalid_ids_instead_of_non_binary_mask(bad):
  with pytest.raises(ValueError, match="ids"):
    patterns.pattern_masks_from_ids(np.array([0, bad]), 3)
  # The last valid id is still accepted and gives a binary 4-of-9 mask (hand count).
  mask = np.asarray(patterns.pattern_masks_from_ids(np.array([math.comb(9, 4) - 1]), 3))
  assert set(np.unique(mask)) <= {0.0, 1.0} and mask.sum() == 4


@pytest.mark.parametrize("num_patterns", [4, 8, 12])
def test_one_shot_pools_from_the_released_library(num_patterns):
  masks, ids = patterns.one_shot_pool(num_patterns)
  assert masks.shape == (num_patterns, 3, 3) and ids.shape == (num_patterns,)
  flat = masks.reshape(num_patterns, 9)
  assert len({tuple(m) for m in flat}) == num_patterns  # distinct
  assert set(np.unique(flat)) == {0.0, 1.0}
  np.testing.assert_array_equal(flat.sum(axis=1), 4)  # each keeps 4 of 9
  # ids index all_patterns(4, 3), and the pool is the head of the 12-pattern library
  np.testing.assert_array_equal(patterns.all_patterns(4, 3)[ids], masks)
  np.testing.assert_array_equal(masks, patterns.library_patterns()[:num_patterns])
  # 4 is the released default: the four 2x2 blocks around the centre
  np.testing.assert_array_equal(patterns.one_shot_pool()[0], patterns.centre_block_patterns())


@pytest.mark.parametrize("bad", [0, 5, 9, 16, True, "12"])
def test_one_shot_pool_bad_sizes(bad):
  with pytest.raises(ValueError, match=r"^num_patterns must be one of \(4, 8, 12\)"):
    patterns.one_shot_pool(bad)
