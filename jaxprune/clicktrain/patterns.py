"""Kernel patterns and the ClickTrain pattern machinery (ClickTrain §4.2, §4.3).

A *pattern* keeps ``k`` of the ``size x size`` positions of one conv kernel
(ClickTrain keeps 4 of 9). Patterns are identified by an integer: the index in
:func:`all_patterns`, which lists every ``k``-subset of the row-major flat
positions ``0 .. size*size - 1`` in lexicographic order of the sorted position
tuples (the order of ``itertools.combinations``). For ``size=3, k=4`` index 0
keeps positions (0, 1, 2, 3) (the top row and the left of the middle row) and
index 125 keeps (5, 6, 7, 8).

The pieces, in the order ClickTrain uses them:

* :func:`dppg_candidates` — dynamic pattern pool generation (DPPG, §4.2,
  steps 1-4): one candidate pattern per kernel from per-weight importance.
* :func:`accumulate_competitive_scores` / :func:`select_pool` — step 5-6: each
  kernel's candidate adds 1 to that pattern's competitive score; accumulated
  over batches, the top ``N`` (8 or 12) patterns form the pool.
* :func:`vote` / :func:`finalize_patterns` — adaptive pattern finalization
  (§4.3): per batch each kernel's best pool pattern (Eq. 1) gets a vote, unless
  the loss margin test fails; the final pattern is the most voted one.
* :func:`kernel_keep_mask` — adaptive kernel finalization: the user-set
  fraction of kernels with the lowest Eq. 2 score are pruned.
* :func:`pattern_mask` — per-kernel pattern ids to an HWIO weight mask.

Everything after :func:`all_patterns` is jit-able and vectorised over kernels.

Example::

    from jaxprune.clicktrain import importance, patterns

    imp = importance.weight_importance(w, g)               # HWIO
    cand = patterns.dppg_candidates(jnp.moveaxis(imp, (0, 1), (-2, -1)))
    scores = patterns.accumulate_competitive_scores(
        jnp.zeros(patterns.num_patterns(4, 3), jnp.int32), cand)
    pool = patterns.select_pool(scores, 12)                # ids into all_patterns

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
  "all_patterns",
  "num_patterns",
  "pattern_index",
  "pattern_masks_from_ids",
  "library_patterns",
  "library_pattern_ids",
  "ONE_SHOT_POOL_SIZES",
  "one_shot_pool",
  "centre_block_patterns",
  "LIBRARY_12",
  "dppg_candidates",
  "accumulate_competitive_scores",
  "select_pool",
  "loss_margin_ok",
  "vote",
  "finalize_patterns",
  "kernel_keep_mask",
  "pattern_mask",
]

# The authors' 12-pattern library (rows top -> bottom, 1 = kept), in the order of
# their released code's pattern table. The first four are the four 2x2 blocks
# containing the centre. Their "one_shot" rule draws its fixed pool from the head
# of this list: 4, 8 or 12 patterns (`num_patterns`, see `one_shot_pool`).
LIBRARY_12: tuple[str, ...] = (
  "000/011/011",
  "000/110/110",
  "011/011/000",
  "110/110/000",
  "000/001/111",
  "000/111/010",
  "010/011/010",
  "010/110/010",
  "111/010/000",
  "000/100/111",
  "111/100/000",
  "000/101/011",
)


def _check_k_size(k: int, size: int) -> None:
  if not isinstance(size, (int, np.integer)) or size < 1:
    raise ValueError(f"size must be a positive int, got {size!r}")
  if not isinstance(k, (int, np.integer)) or not 1 <= k <= size * size:
    raise ValueError(f"k must be an int in [1, size*size={size * size}], got {k!r}")


def num_patterns(k: int = 4, size: int = 3) -> int:
  """Number of ``k``-of-``size**2`` patterns, ``C(size**2, k)``."""
  _check_k_size(k, size)
  return math.comb(size * size, k)


@functools.lru_cache(maxsize=None)
def _all_patterns_np(k: int, size: int) -> np.ndarray:
  n = size * size
  combos = np.array(list(itertools.combinations(range(n), k)), np.int64)
  masks = np.zeros((len(combos), n), np.float32)
  np.put_along_axis(masks, combos, 1.0, axis=1)
  masks.setflags(write=False)
  return masks.reshape(len(combos), size, size)


def all_patterns(k: int = 4, size: int = 3) -> np.ndarray:
  """Every ``k``-of-``size**2`` binary mask, in lexicographic order.

  Pattern ``i`` keeps the flat (row-major) positions
  ``list(itertools.combinations(range(size*size), k))[i]``.

  Args:
      k: kept positions per pattern.
      size: kernel side.

  Returns:
      float32 NumPy array ``(C(size**2, k), size, size)`` of 0/1 (read-only).

  Raises:
      ValueError: ``size < 1`` or ``k`` outside ``[1, size**2]``.
  """
  _check_k_size(k, size)
  if math.comb(size * size, k) > 5_000_000:
    raise ValueError(f"all_patterns(k={k}, size={size}) is too large to list")
  return _all_patterns_np(int(k), int(size))


# Largest table of every pattern (values) that pattern_masks_from_ids gathers from; larger
# kernels unrank their ids instead of embedding a constant that size in the program.
_MASK_TABLE_LIMIT = 1 << 16


@functools.lru_cache(maxsize=None)
def _binomial_table(n: int, k: int) -> np.ndarray:
  """``table[a, b] = C(a, b)`` for ``a <= n``, ``b <= k`` (0 when ``a < b``)."""
  return np.array([[math.comb(a, b) for b in range(k + 1)] for a in range(n + 1)], np.int64)


@functools.lru_cache(maxsize=None)
def _rank_by_bitmask(n: int, k: int) -> np.ndarray:
  """``table[sum(1 << c for c in combo)] = lexicographic rank of combo`` (-1 elsewhere)."""
  table = np.full(1 << n, -1, np.int32)
  for rank, combo in enumerate(itertools.combinations(range(n), k)):
    table[sum(1 << c for c in combo)] = rank
  return table


def pattern_index(positions: jnp.ndarray, size: int = 3) -> jnp.ndarray:
  """Index into ``all_patterns(k, size)`` of the pattern keeping ``positions``.

  Lexicographic rank of a combination ``c_0 < ... < c_{k-1}`` of ``n``:
  ``C(n, k) - 1 - sum_i C(n - 1 - c_i, k - i)`` (combinatorial number
  system), so no table of all patterns is built.

  Args:
      positions: int array ``(..., k)`` of distinct flat positions in ``[0, size**2)``, any
          order. Concrete positions are checked; traced ones cannot be, and an invalid set
          then gives an unspecified id (``-1`` for 3x3 kernels).
      size: kernel side.

  Returns:
      int32 array ``(...,)``.

  Raises:
      ValueError: concrete ``positions`` out of range or repeated within a pattern.
  """
  positions = jnp.asarray(positions, jnp.int32)
  k = positions.shape[-1]
  _check_k_size(k, size)
  n = size * size
  if not isinstance(positions, jax.core.Tracer) and positions.size:
    p = np.asarray(positions)
    if p.min() < 0 or p.max() >= n:
      raise ValueError(f"positions: must lie in [0, {n}) for size={size}, got {p.min()}..{p.max()}")
    if np.any(np.diff(np.sort(p, axis=-1), axis=-1) == 0):
      raise ValueError("positions: must be distinct within each pattern, got a repeat")
  if n <= 16:
    # Small kernels (3x3): the kept set as a bit mask indexes a table of ranks; no
    # per-kernel sort (XLA's sort is the slowest op of DPPG on CPU).
    bits = jnp.sum(jnp.left_shift(1, positions), axis=-1)
    return jnp.asarray(_rank_by_bitmask(n, k))[bits]
  positions = jnp.sort(positions, axis=-1)
  table = jnp.asarray(_binomial_table(n, k), jnp.int32)
  i = jnp.arange(k)
  terms = table[n - 1 - positions, k - i]
  return (math.comb(n, k) - 1 - jnp.sum(terms, axis=-1)).astype(jnp.int32)


def pattern_masks_from_ids(ids: jnp.ndarray, size: int = 3, k: int = 4) -> jnp.ndarray:
  """Masks ``(..., size, size)`` of pattern ids (the inverse of :func:`pattern_index`).

  Unranks the lexicographic index slot by slot, so no table of all
  ``C(size**2, k)`` patterns is built (211 876 for 7x7): jit-able.

  Args:
      ids: int array of pattern ids in ``[0, C(size**2, k))``. Concrete ids are checked
          (``-1``, "no pattern yet" in ClickTrain's state, is not a pattern); traced ids
          cannot be, and an out-of-range id then gives an unspecified, possibly non-binary
          mask.
      size: kernel side.
      k: kept positions per pattern.

  Returns:
      float32 masks ``(..., size, size)``.

  Raises:
      ValueError: concrete ``ids`` outside ``[0, C(size**2, k))``.
  """
  _check_k_size(k, size)
  n = size * size
  if not isinstance(ids, jax.core.Tracer) and np.size(ids):
    i = np.asarray(ids)
    if i.min() < 0 or i.max() >= math.comb(n, k):
      raise ValueError(
        f"ids: must lie in [0, {math.comb(n, k)}) for size={size}, k={k}, got {i.min()}..{i.max()}"
      )
  if math.comb(n, k) * n <= _MASK_TABLE_LIMIT:
    # Small kernels (3x3: 126 x 9 values): one gather from the table of every pattern. The
    # unranking below costs some 40 HLO ops per slot and runs per layer and stage; for
    # ResNet-8 it made a fifth of the ClickTrain step's program (not of its compile time,
    # which follows the step's kernel count).
    return jnp.asarray(_all_patterns_np(k, size))[jnp.asarray(ids, jnp.int32)]
  table = jnp.asarray(_binomial_table(n, k), jnp.int32)
  rank = jnp.asarray(ids, jnp.int32)[..., None]
  cs = jnp.arange(n)
  prev = jnp.full(rank.shape, -1, jnp.int32)
  mask = jnp.zeros(rank.shape[:-1] + (n,), jnp.float32)
  for i in range(k):
    # combos whose slot i is c (slots before fixed): C(n - 1 - c, k - 1 - i)
    counts = jnp.where(cs > prev, table[jnp.clip(n - 1 - cs, 0, n), k - 1 - i], 0)
    cum = jnp.cumsum(counts, axis=-1)
    c = jnp.sum(cum <= rank, axis=-1, keepdims=True)
    rank = rank - jnp.sum(jnp.where(cs < c, counts, 0), axis=-1, keepdims=True)
    mask = mask + jax.nn.one_hot(c[..., 0], n, dtype=jnp.float32)
    prev = c
  return mask.reshape(mask.shape[:-1] + (size, size))


def _parse(rows: str) -> np.ndarray:
  return np.array([[c == "1" for c in r] for r in rows.split("/")], np.float32)


def library_patterns() -> np.ndarray:
  """The authors' 12 patterns (``LIBRARY_12``) as ``(12, 3, 3)`` float32 masks."""
  return np.stack([_parse(r) for r in LIBRARY_12])


def library_pattern_ids() -> np.ndarray:
  """``LIBRARY_12`` as int32 indices into ``all_patterns(4, 3)`` (host-side NumPy)."""
  flat = library_patterns().reshape(12, 9)
  table = all_patterns(4, 3).reshape(-1, 9)
  return np.array([int(np.flatnonzero((table == m).all(1))[0]) for m in flat], np.int32)


# The pool sizes of the released code: its table builds pools of the first 4, 8 or 12 entries.
ONE_SHOT_POOL_SIZES: tuple[int, ...] = (4, 8, 12)


def one_shot_pool(num_patterns: int = 4) -> tuple[np.ndarray, np.ndarray]:
  """The fixed pattern pool of the released code's one-shot rule.

  Their pattern table holds the 12 patterns of ``LIBRARY_12`` in this order and a
  ``num_patterns`` of 4, 8 or 12 takes the first that many (4, the default there and here:
  the four 2x2 centre blocks; their VGG-16 config uses 12). Every pattern keeps 4 of 9.

  Args:
    num_patterns: 4, 8 or 12.

  Returns:
    ``(masks, ids)``: ``(num_patterns, 3, 3)`` float32 masks and their int32 indices
    into ``all_patterns(4, 3)``.

  Raises:
    ValueError: ``num_patterns`` not in ``ONE_SHOT_POOL_SIZES``.
  """
  if isinstance(num_patterns, bool) or num_patterns not in ONE_SHOT_POOL_SIZES:
    raise ValueError(f"num_patterns must be one of {ONE_SHOT_POOL_SIZES}, got {num_patterns!r}")
  return library_patterns()[:num_patterns], library_pattern_ids()[:num_patterns]


def centre_block_patterns() -> np.ndarray:
  """The four 2x2 blocks of a 3x3 kernel that contain the centre, ``(4, 3, 3)``.

  Order (bottom-right, bottom-left, top-right, top-left) is the first four of
  ``LIBRARY_12``, the fixed pool of the authors' released code; ties in the
  ``one_shot`` argmax go to the first.
  """
  return one_shot_pool(4)[0]


@functools.lru_cache(maxsize=None)
def _neighbour_tables(size: int) -> tuple[np.ndarray, np.ndarray]:
  """Boolean ``(n, n)`` tables: 8-neighbourhood and 4-neighbourhood."""
  n = size * size
  r, c = np.divmod(np.arange(n), size)
  dr = np.abs(r[:, None] - r[None, :])
  dc = np.abs(c[:, None] - c[None, :])
  eight = np.maximum(dr, dc) == 1
  four = dr + dc == 1
  return eight, four


def _masked_argmax(x: jnp.ndarray, allowed: jnp.ndarray) -> jnp.ndarray:
  # jnp.argmax returns the first maximum: ties go to the lowest flat index.
  return jnp.argmax(jnp.where(allowed, x, -jnp.inf), axis=-1)


def dppg_candidates(importance: jnp.ndarray) -> jnp.ndarray:
  """Each kernel's DPPG candidate pattern (ClickTrain §4.2, steps 1-4).

  1. p1 = the position of highest importance;
  2. p2 = the best of p1's 8 neighbours (horizontal, vertical, diagonal);
  3. candidate positions = the 4-neighbours (up/down/left/right) of p1 and
     p2, excluding p1 and p2 (the paper drops diagonals here on purpose);
  4. the best 4-position pattern containing p1, p2 and two candidates — the
     score (Eq. 1) is a sum over kept positions, so it is the two best
     candidates.

  Ties go to the lowest flat (row-major) index at every step.

  Args:
      importance: per-weight importance ``(..., k, k)``, ``k >= 2`` (3, 5, 7
          all work); e.g. ``(g*w)**2`` of an HWIO kernel moved to
          ``(Cin, Cout, kh, kw)``.

  Returns:
      int32 ``(...,)`` indices into ``all_patterns(4, k)``.

  Raises:
      ValueError: the last two axes are not square of side ``>= 2``.
  """
  shape = jnp.shape(importance)
  if len(shape) < 2 or shape[-1] != shape[-2] or shape[-1] < 2:
    raise ValueError(f"importance must have shape (..., k, k) with k >= 2, got {shape}")
  size = shape[-1]
  eight, four = (jnp.asarray(t) for t in _neighbour_tables(size))
  x = jnp.reshape(importance, shape[:-2] + (size * size,))
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  p1 = jnp.argmax(x, axis=-1)
  p2 = _masked_argmax(x, eight[p1])
  n = size * size
  taken = jax.nn.one_hot(p1, n, dtype=bool) | jax.nn.one_hot(p2, n, dtype=bool)
  cand = (four[p1] | four[p2]) & ~taken
  c1 = _masked_argmax(x, cand)
  c2 = _masked_argmax(x, cand & ~jax.nn.one_hot(c1, n, dtype=bool))
  return pattern_index(jnp.stack([p1, p2, c1, c2], axis=-1), size)


def accumulate_competitive_scores(
  scores: jnp.ndarray, candidates: jnp.ndarray, weight: jnp.ndarray | int = 1
) -> jnp.ndarray:
  """Add ``weight`` to each kernel's candidate pattern score (DPPG step 4-5).

  Args:
      scores: ``(num_patterns,)`` competitive scores so far.
      candidates: int pattern ids of any shape (one per kernel).
      weight: added per candidate (0 skips the batch without a branch).

  Returns:
      updated scores, ``scores``' dtype.
  """
  counts = jnp.bincount(jnp.ravel(candidates), length=scores.shape[0])
  return scores + (counts * weight).astype(scores.dtype)


def select_pool(scores: jnp.ndarray, n: int) -> jnp.ndarray:
  """Ids of the ``n`` patterns with the highest competitive score (DPPG step 6).

  Ties go to the lower pattern id; the result is sorted by score, highest
  first (so pool position 0 is the most competitive pattern).

  Raises:
      ValueError: ``n`` outside ``[1, len(scores)]``.
  """
  if not 1 <= n <= scores.shape[0]:
    raise ValueError(f"n must be in [1, {scores.shape[0]}], got {n}")
  order = jnp.argsort(-scores.astype(jnp.float32), stable=True)
  return order[:n].astype(jnp.int32)


def loss_margin_ok(
  loss_prev: jnp.ndarray, loss_cur: jnp.ndarray, delta: float, rule: str = "relative"
) -> jnp.ndarray:
  """ClickTrain §4.3 loss margin test: may this batch's best patterns vote?

  The paper: "if the loss in the previous batch divided by the value in the
  current batch is smaller than 0.0018 (default δ), we will not count the
  highest-scoring patterns", with the stated purpose of skipping batches
  "where the loss is obviously increasing". Read literally (``rule="literal"``)
  the test ``loss_prev / loss_cur < δ`` only fires when the loss grows more
  than 555-fold, which contradicts that purpose at δ = 0.0018. We read δ as a
  relative margin (``rule="relative"``, the default): the batch votes unless
  the loss rose by more than δ relative to the previous batch,
  i.e. unless ``loss_prev / loss_cur < 1 - δ``.

  Args:
      loss_prev: previous batch loss.
      loss_cur: current batch loss.
      delta: the margin δ.
      rule: ``"relative"`` or ``"literal"``.

  Returns:
      bool scalar: True if the batch votes.
  """
  ratio = loss_prev / loss_cur
  if rule == "relative":
    return ~(ratio < 1.0 - delta)
  if rule == "literal":
    return ~(ratio < delta)
  raise ValueError(f"rule must be 'relative' or 'literal', got {rule!r}")


def vote(
  votes: jnp.ndarray, pool_scores: jnp.ndarray, counted: jnp.ndarray | bool = True
) -> jnp.ndarray:
  """One batch of adaptive pattern finalization (ClickTrain §4.3).

  Args:
      votes: ``(..., N)`` int vote counts per kernel and pool position.
      pool_scores: ``(..., N)`` Eq. 1 scores of the pool patterns.
      counted: False skips the batch (loss margin test failed).

  Returns:
      updated votes: each kernel's highest-scoring pool pattern (ties to
      the lower pool position) gets +1 if ``counted``.
  """
  best = jnp.argmax(pool_scores, axis=-1)
  onehot = jax.nn.one_hot(best, votes.shape[-1], dtype=votes.dtype)
  return votes + onehot * jnp.asarray(counted, votes.dtype)


def finalize_patterns(votes: jnp.ndarray) -> jnp.ndarray:
  """Pool position of each kernel's most voted pattern (ties to lower position)."""
  return jnp.argmax(votes, axis=-1).astype(jnp.int32)


def _num_pruned(n: int, ratio: float) -> int:
  # ceil with a small tolerance so that e.g. 0.35 * 100 (= 35.000000000000004)
  # prunes 35 kernels, as the ratio means.
  return min(n, max(0, math.ceil(ratio * n - 1e-9)))


def kernel_keep_mask(scores: jnp.ndarray, ratio: float, *, per_filter: bool = False) -> jnp.ndarray:
  """Adaptive kernel finalization: prune the lowest-scoring kernels (Eq. 2).

  Args:
      scores: ``(Cin, Cout)`` kernel scores (per batch or accumulated).
      ratio: fraction of the layer's kernels to prune; exactly
          ``ceil(ratio * Cin * Cout)`` are pruned, the lowest scores first,
          ties to the lower flat (row-major ``(Cin, Cout)``) index.
      per_filter: prune ``ceil(ratio * Cin)`` kernels in *every* filter (output channel)
          instead, the lowest scores of that filter first (ties to the lower input
          channel). Every filter then keeps the same number of weights: the load-balance
          constraint of the paper's sparse kernels (ClickTrain §5.2: "all the filters in the
          same layer have the same number of un-pruned weights"). The released code ranks
          the whole layer (the default).

  Returns:
      bool ``(Cin, Cout)``: True = kernel kept.

  Raises:
      ValueError: ``ratio`` outside ``[0, 1]``, or ``scores`` not 2-D with ``per_filter``.
  """
  if not 0.0 <= float(ratio) <= 1.0:
    raise ValueError(f"ratio must be in [0, 1], got {ratio}")
  if per_filter:
    if jnp.ndim(scores) != 2:
      raise ValueError(f"scores must be (Cin, Cout) with per_filter, got shape {jnp.shape(scores)}")
    cin = scores.shape[0]
    n_pruned = _num_pruned(cin, float(ratio))
    order = jnp.argsort(scores, axis=0, stable=True)  # per filter, lowest first
    rank = jnp.argsort(order, axis=0, stable=True)  # each kernel's rank in its filter
    return rank >= n_pruned
  n = int(np.prod(scores.shape))
  n_pruned = _num_pruned(n, float(ratio))
  order = jnp.argsort(jnp.ravel(scores), stable=True)
  keep = jnp.ones((n,), bool).at[order[:n_pruned]].set(False)
  return keep.reshape(scores.shape)


def pattern_mask(
  pattern_ids: jnp.ndarray,
  patterns: jnp.ndarray,
  kernel_keep: jnp.ndarray | None = None,
  dtype=jnp.float32,
) -> jnp.ndarray:
  """HWIO weight mask from per-kernel pattern ids (and kernel keep mask).

  Args:
      pattern_ids: int ``(Cin, Cout)`` indices into ``patterns``.
      patterns: ``(P, kh, kw)`` masks (e.g. a pool, or ``all_patterns``).
      kernel_keep: optional bool ``(Cin, Cout)``; pruned kernels are all 0.
      dtype: mask dtype.

  Returns:
      ``(kh, kw, Cin, Cout)`` mask.
  """
  # Built in HWIO, one kernel position at a time, not gathered as (Cin, Cout, kh, kw) and
  # transposed: XLA makes such a transpose free by giving the mask a transposed layout, and
  # where the mask leaves a lax.cond (ClickTrain's pick, finalization) the branch not taken
  # then pays a physical transpose of every pruned layer's mask at every step (measured: the
  # pruned stage's update on VGG-11 4x slower).
  table = jnp.asarray(patterns, dtype)
  kh, kw = table.shape[1:]
  m = jnp.stack([table[:, a, b][pattern_ids] for a in range(kh) for b in range(kw)])
  m = m.reshape(kh, kw, *pattern_ids.shape)
  if kernel_keep is not None:
    m = m * kernel_keep.astype(dtype)
  return m
