"""ClickTrain's stage work: what each stage computes per step (ClickTrain §4.2-4.4), as pure
functions of the plan, the param / gradient leaves and the per-layer states.

Each takes what it reads explicitly and returns new per-layer states (or leaves); none reads
anything from an enclosing scope. :mod:`jaxprune.clicktrain._stage_machine` decides which run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprune.clicktrain import importance as _imp
from jaxprune.clicktrain import patterns as _pat
from jaxprune.clicktrain._groups import cluster_filters, first_filters, group_sum, lift
from jaxprune.clicktrain._plan import Layers, Plan
from jaxprune.clicktrain.state import (
  POOL,
  PRUNED,
  REGULARIZE,
  ClickTrainLayerState,
  Stage,
  full_mask,
)

__all__ = [
  "all_finite",
  "decay_pruned",
  "finalize_masks",
  "finalize_step",
  "group_lasso_grad",
  "hard_mask",
  "modify_grads",
  "one_shot_masks",
  "pool_step",
  "scored",
  "select_pools",
]


def _as_kernels(x: jax.Array) -> jax.Array:
  """HWIO -> (Cin, Cout, kh, kw)."""
  return jnp.moveaxis(x, (0, 1), (-2, -1))


def group_lasso_grad(
  w: jax.Array, ls: ClickTrainLayerState, eps: float, groups: int = 0
) -> jax.Array:
  """d/dW Σ_kernels [sqrt(‖W⊙¬P‖²+ε) + sqrt(‖W⊙¬K‖²+ε)] (ClickTrain §4.4).

  With ``groups`` (aligned mode) a "kernel" is a (filter group, input channel) pair: the
  squared norms are summed over the group's filters (the state's ``filter_group`` ids) before
  the square root, and each pair's term is weighted by ``sqrt(|g|)``, the number of filters in
  its group (Yuan & Lin's group-size weight). Without it a norm over ``|g|`` kernels of like
  size pulls each weight ``sqrt(|g|)`` times more weakly than the paper's per-kernel norm (22x
  for a 512-filter layer at ``G = 1``), the weights the hard prune removes are still large
  when it comes, and the network collapses there. With it each weight feels the paper mode's
  pull when its group's kernels are alike; one filter per group is the paper mode exactly.
  """
  ids = ls.filter_group
  # sqrt(filters in each filter's group), (Cout,): 1 in the paper mode (lift is the identity).
  weight = jnp.sqrt(lift(jnp.ones(w.shape[-1:], w.dtype), groups, ids=ids))
  z = w * (1 - ls.pattern_mask)
  gz = z * jax.lax.rsqrt(lift(jnp.sum(z * z, axis=(0, 1), keepdims=True), groups, ids=ids) + eps)
  u = w * (~ls.kernel_keep).astype(w.dtype)
  gu = u * jax.lax.rsqrt(lift(jnp.sum(u * u, axis=(0, 1), keepdims=True), groups, ids=ids) + eps)
  return (gz + gu) * weight


def _kernel_keep(scores: jax.Array, layer, ids: jax.Array) -> jax.Array:
  """Adaptive kernel finalization (Eq. 2 scores, lowest pruned) at the layer's granularity:
  per kernel, or (aligned mode) per (group, input channel) with the same number pruned in
  every group, so the groups run as one batched product (the §5.2 load balance, lifted).
  ``scores`` are lifted (equal within each group of ``ids``)."""
  if not layer.groups:
    return _pat.kernel_keep_mask(scores, layer.ratio, per_filter=layer.per_filter)
  first = first_filters(ids, layer.groups)  # one column per group
  keep = _pat.kernel_keep_mask(jnp.take(scores, first, axis=1), layer.ratio, per_filter=True)
  return jnp.take(keep, ids, axis=1)


def _lifted_groups(layer) -> int:
  """The groups the per-batch quantities are summed over before the partition is final: the
  layer's groups, or 0 (per kernel) while a clustered partition is still to be chosen."""
  return 0 if layer.clustered else layer.groups


def _clustered(ls: ClickTrainLayerState, layer, kernel_scores, pattern_scores):
  """Clustered aligned mode, where the patterns are finalized: the balanced partition chosen
  from the per-kernel scores, and those scores lifted to it (``filter_group`` stored)."""
  ids = cluster_filters(kernel_scores, pattern_scores, layer.groups)
  lifted_ps = None if pattern_scores is None else lift(pattern_scores, layer.groups, 1, ids)
  return ids, lift(kernel_scores, layer.groups, ids=ids), lifted_ps


def all_finite(loss, plan: Plan, w_leaves, g_leaves) -> jax.Array:
  """Whether a step may feed the importance bookkeeping.

  The loss, every gradient leaf (what ``optax.apply_if_finite`` checks) and the pruned weights are
  finite. Scores from a NaN step would stay NaN in the sums for good and rank kernels by index.
  """
  ok = jnp.isfinite(loss)
  for g in g_leaves:
    ok = ok & jnp.all(jnp.isfinite(g))
  for layer in plan.values():
    ok = ok & jnp.all(jnp.isfinite(w_leaves[layer.index]))
  return ok


def scored(layers: Layers, plan: Plan, stage: Stage) -> jax.Array:
  """Whether some batch of the current POOL / FINALIZE stage fed its scores.

  Each scored DPPG batch adds +1 per pattern kernel, each counted finalization batch a vote per
  pattern kernel and Eq. 2 scores (> 0 unless every ``g ⊙ w`` is 0). A stage of only non-finite or
  skipped batches has all-zero scores, which would choose the pool / masks by index.
  """
  ok = jnp.bool_(False)
  if stage == POOL:
    pattern = [n for n, layer in plan.items() if layer.kind == "pattern"]
    if not pattern:  # no pool to choose
      return jnp.bool_(True)
    for n in pattern:
      ok = ok | jnp.any(layers[n].competitive_scores > 0)
    return ok
  if not plan:
    return jnp.bool_(True)
  for n in plan:
    ok = ok | jnp.any(layers[n].kernel_score_sum > 0)
    if layers[n].votes is not None:
      ok = ok | jnp.any(layers[n].votes > 0)
  return ok


def pool_step(layers: Layers, plan: Plan, w_leaves, g_leaves) -> Layers:
  """DPPG steps 1-5 for one batch: +1 competitive score per kernel's candidate (§4.2)."""
  out = dict(layers)
  for name, layer in plan.items():
    if layer.kind != "pattern":
      continue
    imp = _imp.weight_importance(w_leaves[layer.index], g_leaves[layer.index])
    ls = layers[name]
    if _lifted_groups(layer):  # one candidate per (group, input channel), summed importance
      imp = group_sum(imp, layer.groups, ids=ls.filter_group)
    cand = _pat.dppg_candidates(_as_kernels(imp))
    out[name] = ls._replace(
      competitive_scores=_pat.accumulate_competitive_scores(ls.competitive_scores, cand)
    )
  return out


def finalize_step(layers: Layers, plan: Plan, w_leaves, g_leaves, counted) -> Layers:
  """One batch of adaptive finalization (§4.3).

  Pattern votes (Eq. 1) and summed Eq. 2 kernel scores, both only when the batch passes the
  loss-margin test (``counted``). Per (group, input channel) in the aligned mode; per kernel while a
  clustered partition is still to be chosen (:func:`finalize_masks` chooses it from these).
  """
  out = dict(layers)
  for name, layer in plan.items():
    ls = layers[name]
    w, g = w_leaves[layer.index], g_leaves[layer.index]
    groups, ids = _lifted_groups(layer), ls.filter_group
    ks = ls.kernel_score_sum + jnp.where(
      counted, lift(_imp.kernel_scores(w, g), groups, ids=ids), 0.0
    )
    votes = ls.votes
    if layer.kind == "pattern":
      pool_masks = _pat.pattern_masks_from_ids(ls.pool, layer.size)
      scores = lift(_imp.pattern_scores(w, g, pool_masks), groups, axis=1, ids=ids)
      votes = _pat.vote(votes, scores, counted)
    out[name] = ls._replace(kernel_score_sum=ks, votes=votes)
  return out


def select_pools(layers: Layers, plan: Plan, pool_size: int) -> Layers:
  """End of DPPG: one global pool per kernel size (DPPG step 6)."""
  out = dict(layers)
  for size in sorted({layer.size for layer in plan.values() if layer.kind == "pattern"}):
    names = [n for n, layer in plan.items() if layer.kind == "pattern" and layer.size == size]
    total = sum(layers[n].competitive_scores for n in names)
    pool = _pat.select_pool(total, min(pool_size, total.shape[0]))
    for n in names:
      out[n] = layers[n]._replace(pool=pool)
  return out


def finalize_masks(layers: Layers, plan: Plan) -> Layers:
  """End of §4.3: pattern = most voted pool pattern, kernels = lowest summed Eq. 2.

  Clustered aligned mode: the filter groups are chosen here, from the per-kernel Eq. 2 sums
  and votes of the finalization stage (the last point where they differ between the filters,
  and the first where the groups decide anything lasting), and the sums and votes are lifted
  to the groups before the choice (a group's pattern: the most votes over its kernels).
  """
  out = dict(layers)
  for name, layer in plan.items():
    ls = layers[name]
    if layer.clustered:
      ids, ks, votes = _clustered(ls, layer, ls.kernel_score_sum, ls.votes)
      ls = ls._replace(filter_group=ids, kernel_score_sum=ks, votes=votes)
    keep = _kernel_keep(ls.kernel_score_sum, layer, ls.filter_group)
    if layer.kind == "pattern":
      best = _pat.finalize_patterns(ls.votes)  # pool position per kernel
      pid = ls.pool[best]
      pmask = _pat.pattern_mask(
        best, _pat.pattern_masks_from_ids(ls.pool, layer.size), dtype=ls.pattern_mask.dtype
      )
      out[name] = ls._replace(pattern_id=pid, kernel_keep=keep, pattern_mask=pmask)
    else:
      out[name] = ls._replace(kernel_keep=keep)
  return out


def one_shot_masks(layers: Layers, plan: Plan, w_leaves, g_leaves, num_patterns: int) -> Layers:
  """The released code's rule on one batch: best of its fixed pool (Eq. 1) + lowest Eq. 2."""
  out = dict(layers)
  blocks, block_ids = _pat.one_shot_pool(num_patterns)
  block_ids = jnp.asarray(block_ids)
  for name, layer in plan.items():
    ls = layers[name]
    w, g = w_leaves[layer.index], g_leaves[layer.index]
    ks = _imp.kernel_scores(w, g)
    scores = _imp.pattern_scores(w, g, blocks) if layer.kind == "pattern" else None
    ids = ls.filter_group
    if layer.clustered:  # the partition from this batch's per-kernel scores, then lifted
      ids, ks, scores = _clustered(ls, layer, ks, scores)
      ls = ls._replace(filter_group=ids)
    else:
      ks = lift(ks, layer.groups, ids=ids)
      scores = None if scores is None else lift(scores, layer.groups, axis=1, ids=ids)
    keep = _kernel_keep(ks, layer, ids)
    if layer.kind == "pattern":
      best = jnp.argmax(scores, axis=-1)  # ties -> first
      pmask = _pat.pattern_mask(best, blocks, dtype=ls.pattern_mask.dtype)
      out[name] = ls._replace(pattern_id=block_ids[best], kernel_keep=keep, pattern_mask=pmask)
    else:
      out[name] = ls._replace(kernel_keep=keep)
  return out


def _switch_pruned(branches, index, plan: Plan, leaves) -> list:
  """``leaves`` with the pruned layers' entries replaced by ``branches[index]({name: leaf})``
  under one ``lax.switch`` (the branches not taken neither compute nor copy them), or, for an
  ``index`` known when tracing (a Python int: the pruned-stage step), that branch alone."""
  leaves = list(leaves)
  chosen = {name: leaves[layer.index] for name, layer in plan.items()}
  if isinstance(index, int):
    chosen = branches[index](chosen)
  else:
    chosen = jax.lax.switch(index, branches, chosen)
  for name, layer in plan.items():
    leaves[layer.index] = chosen[name]
  return leaves


def _map_pruned(fn, pred, plan: Plan, leaves) -> list:
  """``leaves`` with the pruned layers' entries replaced by ``fn({name: leaf})`` where
  ``pred`` holds (:func:`_switch_pruned` of the identity and ``fn``; a Python bool decides
  when tracing)."""
  index = int(pred) if isinstance(pred, bool) else pred.astype(jnp.int32)
  return _switch_pruned([lambda x: x, fn], index, plan, leaves)


def modify_grads(
  g_leaves, layers: Layers, plan: Plan, w_leaves, stage, coefficient, eps: float
) -> list:
  """The gradient the inner optimizer sees.

  ``+ λ ∂(modified group lasso)`` while regularizing (§4.4), masked once pruned (so the inner
  moments get nothing there). Each stage computes only its own part: the pruned stage, where every
  later step runs, does not form the penalty's gradient to multiply it by zero.
  """

  def regularize(gs):
    out = {}
    for name, layer in plan.items():
      ls, g, w = layers[name], gs[name], w_leaves[layer.index]
      reg = group_lasso_grad(w, ls, eps, layer.groups) * jnp.asarray(coefficient, w.dtype)
      out[name] = g + reg.astype(g.dtype)
    return out

  def mask(gs):
    # A select, not a product: a NaN gradient at a pruned position must not reach the
    # inner optimizer's moments (0 · NaN = NaN).
    return {
      name: jnp.where(full_mask(layers[name]) != 0, gs[name], jnp.zeros((), gs[name].dtype))
      for name in plan
    }

  if isinstance(stage, int):  # known when tracing (the pruned-stage step): no switch
    branch = 1 if stage == REGULARIZE else 2 if stage == PRUNED else 0
  else:
    branch = jnp.where(stage == REGULARIZE, 1, jnp.where(stage == PRUNED, 2, 0))
  return _switch_pruned([lambda gs: gs, regularize, mask], branch, plan, g_leaves)


def hard_mask(u_leaves, layers: Layers, plan: Plan, w_leaves, pruned) -> list:
  """Hard prune: emit ``mask ⊙ (p + u) − p`` so that ``p + update`` is exactly 0 where pruned.

  Written as a select, not a product: a kept entry passes ``u`` bit for bit, and a pruned one
  gets ``−p`` whatever ``u`` holds (``0 · NaN`` would turn a pruned weight into NaN).
  """

  def hard(us):
    out = {}
    for name, layer in plan.items():
      p = w_leaves[layer.index]
      keep = full_mask(layers[name]) != 0
      out[name] = jnp.where(keep, us[name], -p.astype(us[name].dtype))
    return out

  return _map_pruned(hard, pruned, plan, u_leaves)


def decay_pruned(u_leaves, layers: Layers, plan: Plan, w_leaves, ratio, decaying) -> list:
  """The soft prune's window: shrinks the dropped weights by ``ratio``.

  Emits ``ratio · (p + u) − p`` where the masks prune, so the dropped weights shrink by ``ratio``
  (the schedule's share left after this step over the share before it) and reach exactly 0 at the
  prune; kept entries pass ``u`` bit for bit.
  """

  def decay(us):
    out = {}
    for name, layer in plan.items():
      p, u = w_leaves[layer.index], us[name]
      keep = full_mask(layers[name]) != 0
      shrunk = (p.astype(u.dtype) + u) * ratio.astype(u.dtype) - p.astype(u.dtype)
      out[name] = jnp.where(keep, u, shrunk)
    return out

  return _map_pruned(decay, decaying, plan, u_leaves)

