"""ClickTrain as one Optax transform wrapping the inner optimizer (ClickTrain §4).

ClickTrain prunes during training: every 3x3 (k x k) kernel keeps 4 weights in one of a small
pool of patterns, and a per-layer fraction of whole kernels is removed (connectivity sparsity).
The algorithm runs as a stage machine over epochs (ClickTrain Fig. 4), :class:`Stage`:

====  ===========  ==========================================================
 0    WARMUP       dense training (stage 1) until the loss derivative over
                   epochs falls below 0.27 (§4.1), or a set epoch.
 1    POOL         dynamic pattern pool generation (DPPG, §4.2): every batch,
                   each kernel's candidate pattern gets +1 competitive score;
                   at the end the top ``pool_size`` patterns of each kernel
                   size (summed over layers: one global pool) form the pool.
 2    FINALIZE     adaptive pattern / kernel finalization (§4.3): every batch
                   each kernel's best pool pattern (Eq. 1) gets a vote unless
                   the loss margin test fails; Eq. 2 kernel scores are summed
                   over the same batches. At the end: pattern = most voted,
                   pruned kernels = the ``ceil(ratio * Cin * Cout)`` lowest
                   summed scores.
 3    REGULARIZE   modified group lasso (§4.4):
                   ``λ Σ_kernels [sqrt(‖W⊙¬P‖² + ε) + sqrt(‖W⊙¬K‖² + ε)]``
                   is added to the loss (its gradient to the gradient).
 4    PRUNED       hard prune from ``hard_prune_epoch`` on: the emitted update
                   is ``mask * (p + u) - p``, so pruned weights are exactly 0
                   after every step, the step entering the stage (the last
                   of epoch ``hard_prune_epoch - 1``) included: the stage and
                   the weights always agree. Gradients are masked before the
                   inner optimizer so its moments get nothing there (they
                   only decay from their values at the prune).
====  ===========  ==========================================================

``mode="one_shot"`` follows the authors' released code instead: at the first
step of ``one_shot_epoch`` the masks are chosen from that one batch's gradient
(pattern = argmax of Eq. 1 over the released fixed pool, ties to the first:
by default the four 2x2 blocks containing the centre, or the first 8 or 12
patterns of their library with ``one_shot_patterns``; kernels = the
``ceil(ratio * Cin * Cout)`` lowest Eq. 2 scores), then REGULARIZE with a fixed λ until ``hard_prune_epoch``, then
PRUNED. The released code also switches to mixup (α = 0.3) after the hard
prune; that is data-side: use ``jaxprune.data.Loader``'s soft labels.

Transitions happen at epoch ends (``steps_per_epoch`` converts), inside
``jit``: the stage, step and loss statistics live in the state. Each step is a
handful of module-level pure stage functions over the per-layer plan
(:class:`_PrunedLayer`), the param / gradient leaves and the per-layer states:
:func:`_pool_step` / :func:`_finalize_step` (per batch), :func:`_select_pools` /
:func:`_finalize_masks` / :func:`_one_shot_masks` (once), :func:`_modify_grads`
(group lasso + gradient mask) and :func:`_hard_mask` (the emitted update). DPPG /
votes and pool selection / finalization run in one ``lax.switch`` on the stage,
the group lasso and masks under one ``lax.cond`` each, so a stage neither
computes nor copies what it does not use — no host round trip per step. The
loss comes in through Optax's extra args: ``update(grads, state, params,
value=loss)`` (``nnx.Optimizer.update(model, grads, value=loss)`` passes it).

Layers: ``layer_filter(path, shape)`` returns ``"pattern"``, ``"kernel"`` or
``None`` per param leaf (``path`` = keys joined by ``/``). The default prunes
every 4-D kernel with ``kh == kw > 1`` and more than 3 input channels with
patterns + kernels, 1x1 convs with kernel (connectivity) pruning only, and
leaves out the stem (3 input channels) and any 1x1 conv on a ``shortcut``
path (the released code prunes every conv except the stem and the 1x1 shortcut convs).

Reading choices (the paper is silent or garbled; tested):

* Loss derivative (§4.1): ``|mean_loss(epoch e) - mean_loss(e - 1)| < 0.27``
  over epoch means of the training loss, checked from the second epoch.
* Loss margin δ (§4.3): see :func:`jaxprune.clicktrain.patterns.loss_margin_ok`; the
  default reads δ as a relative margin (skip the batch's votes when the loss
  rose by more than δ), ``margin_rule="literal"`` is the literal text.
* Kernel finalization is "similar" to pattern finalization in the paper; here
  it sums Eq. 2 over the batches that pass the margin test (one cheap add per
  step; no per-step sort).
* With the loss-derivative trigger (``pool_start_epoch=None``), if the finalization ends
  after ``hard_prune_epoch``, the hard prune happens one epoch after it (at least one epoch
  of regularization), and a run still in warmup at ``hard_prune_epoch`` warns once. A set
  ``pool_start_epoch`` must leave that epoch: ``hard_prune_epoch > pool_start_epoch +
  pool_epochs + finalize_epochs`` (else ``ValueError``).
* Importance work may run every ``importance_every`` steps (default 1) to cut
  overhead; skipped steps neither vote nor add competitive scores.
* A non-finite step (a NaN / Inf loss, gradient leaf or pruned weight) is skipped by the
  importance bookkeeping, whether or not the inner optimizer is wrapped in
  ``optax.apply_if_finite``: it neither adds competitive scores nor votes nor adds Eq. 2
  scores, so no NaN score ever ranks kernels or patterns, and the loss-margin test compares
  with the last finite loss. In ``one_shot`` mode a non-finite pick batch defers the pick
  to the next finite step (a pick from NaN scores would prune kernels by index). Likewise a
  pool generation or finalization stage none of whose batches fed its scores does not end
  (nor does the hard prune come) until an epoch that had one; each such epoch end warns.

The read-outs (masks, stage, pattern usage, compression) are in
:mod:`jaxprune.clicktrain.readouts`.

Example::

    tx = jaxprune.clicktrain.clicktrain(
        optax.sgd(0.1, momentum=0.9), steps_per_epoch=len(loader),
        kernel_prune_ratio=0.5, pool_start_epoch=None, hard_prune_epoch=95)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ...
    optimizer.update(model, grads, value=loss)
    weight_masks = jaxprune.clicktrain.masks(optimizer, params)   # after the hard prune

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import enum
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxprune.clicktrain import importance as _imp
from jaxprune.clicktrain import patterns as _pat
from jaxprune.paths import path_string

__all__ = [
  "FINALIZE",
  "POOL",
  "PRUNED",
  "REGULARIZE",
  "STAGE_NAMES",
  "WARMUP",
  "ClickTrainLayerState",
  "ClickTrainState",
  "Stage",
  "clicktrain",
  "default_layer_filter",
  "full_mask",
]

PyTree = Any
_PATTERN_SIZE = 4  # weights kept per kernel (ClickTrain keeps 4 of 9)


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


class ClickTrainState(NamedTuple):
  count: jax.Array  # steps done
  stage: jax.Array  # Stage.WARMUP .. Stage.PRUNED
  stage_start_epoch: jax.Array  # epoch at which the current stage began
  epoch_loss_sum: jax.Array  # loss summed over the current epoch
  prev_epoch_loss: jax.Array  # mean loss of the last finished epoch (nan: none)
  last_loss: jax.Array  # previous batch loss (nan: none)
  layers: dict[str, ClickTrainLayerState]  # keyed by jaxprune.paths.path_string
  inner_state: optax.OptState


def default_layer_filter(path: str, shape: tuple[int, ...]) -> str | None:
  """ClickTrain layer choice: see the module docstring."""
  if len(shape) != 4:
    return None
  kh, kw, cin, _ = shape
  if cin <= 3:  # the stem reads the image
    return None
  if kh == kw == 1:
    return None if "shortcut" in path or "downsample" in path else "kernel"
  return "pattern" if kh == kw else "kernel"


class _PrunedLayer(NamedTuple):
  """The static plan of one pruned param leaf (host side, fixed by the param shapes)."""

  index: int  # position among the flattened param leaves
  kind: str  # "pattern" or "kernel"
  ratio: float  # kernel-prune ratio
  size: int  # kernel side (0 for kernel-only)
  per_filter: bool = False  # prune the same number of kernels in every filter (§5.2)


_Plan = dict[str, _PrunedLayer]
_Layers = dict[str, ClickTrainLayerState]


class _Config(NamedTuple):
  """The schedule and coefficients of one :func:`clicktrain` (validated there)."""

  mode: str
  steps_per_epoch: int
  hard_prune_epoch: int
  pool_start_epoch: int | None
  loss_derivative_threshold: float
  pool_epochs: int
  finalize_epochs: int
  pool_size: int
  loss_margin: float
  margin_rule: str
  group_lasso_coefficient: float
  one_shot_epoch: int | None
  one_shot_patterns: int
  importance_every: int
  eps: float


def _ratio(r: Any, name: str | None = None) -> float:
  """A kernel prune ratio as a float; a bool (an int subclass: True would prune every
  kernel) is rejected."""
  if isinstance(r, (bool, np.bool_)):
    where = "" if name is None else f" for {name!r}"
    raise ValueError(f"kernel_prune_ratio{where} must be a number in [0, 1], got {r}")
  return float(r)


def _plan(
  params: PyTree,
  layer_filter,
  kernel_prune_ratio,
  mode: str,
  known: dict[str, float] | None = None,
  per_filter: bool = False,
) -> _Plan:
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  chosen = []
  for i, (path, leaf) in enumerate(leaves):
    name = path_string(path)
    kind = layer_filter(name, tuple(np.shape(leaf)))
    if kind is None:
      continue
    if kind not in ("pattern", "kernel"):
      raise ValueError(f"layer_filter must return 'pattern', 'kernel' or None, got {kind!r}")
    if np.ndim(leaf) != 4:
      raise ValueError(f"layer_filter chose {name!r} of shape {np.shape(leaf)}: not 4-D")
    kh, kw = np.shape(leaf)[:2]
    if kind == "pattern" and (kh != kw or kh * kh < _PATTERN_SIZE or kh < 2):
      raise ValueError(
        f"pattern pruning needs a square kernel of side >= 2: {name!r} {np.shape(leaf)}"
      )
    if kind == "pattern" and mode == "one_shot" and kh != 3:
      raise ValueError(f"mode='one_shot' uses 3x3 centre patterns; {name!r} is {kh}x{kw}")
    chosen.append((name, i, kind, kh))
  if isinstance(kernel_prune_ratio, (int, float)):
    ratios = [_ratio(kernel_prune_ratio)] * len(chosen)
  elif callable(kernel_prune_ratio):
    ratios = [
      _ratio(kernel_prune_ratio(name, tuple(np.shape(leaves[i][1]))), name)
      for name, i, _, _ in chosen
    ]
  else:
    ratios = [_ratio(r) for r in kernel_prune_ratio]
    names = [c[0] for c in chosen]
    if len(ratios) == len(chosen) and known is not None:
      known.update(zip(names, ratios))
    elif known and all(n in known for n in names):
      # A reconfiguration (PruneTrain) removed layers since the sequence was matched to
      # the params: each remaining layer keeps the ratio it was given by name.
      ratios = [known[n] for n in names]
    if len(ratios) != len(chosen):
      raise ValueError(
        f"kernel_prune_ratio has {len(ratios)} entries for {len(chosen)} "
        f"pruned layers: {[c[0] for c in chosen]}"
      )
  for (name, *_), r in zip(chosen, ratios):
    if not 0.0 <= r <= 1.0:
      raise ValueError(f"kernel_prune_ratio for {name!r} must be in [0, 1], got {r}")
  return {
    name: _PrunedLayer(i, kind, r, kh if kind == "pattern" else 0, per_filter)
    for (name, i, kind, kh), r in zip(chosen, ratios)
  }


def _check_layers(plan: _Plan, layers: _Layers, params: PyTree) -> None:
  """The params' pruned layers are those the state was built for, with the same shapes (a
  ``ValueError`` naming the first that is not, instead of a bare ``KeyError`` later). A state
  layer whose param is still there but that the filter no longer chooses (e.g. a PruneTrain
  reconfiguration left it 3 input channels) is left to the plan, which follows the params."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  w_leaves = [leaf for _, leaf in leaves]
  for name, layer in plan.items():
    if name not in layers:
      raise ValueError(
        f"params: pruned layer {name!r} is not in the ClickTrain state (built for "
        f"{sorted(layers)}): params of another structure than tx.init saw"
      )
    want, got = layers[name].pattern_mask.shape, np.shape(w_leaves[layer.index])
    if want != got:
      raise ValueError(
        f"params: {name!r} has shape {got}, the ClickTrain state was built for {want}"
      )
  paths = {path_string(p) for p, _ in leaves}
  for name in layers:
    if name not in paths:
      raise ValueError(
        f"params: the ClickTrain state's pruned layer {name!r} is missing from the params "
        "(params of another structure than tx.init saw)"
      )


def _init_layer(
  leaf: jax.Array, layer: _PrunedLayer, pool_size: int, mode: str
) -> ClickTrainLayerState:
  _, _, cin, cout = leaf.shape
  n_pool = pool_size if (layer.kind == "pattern" and mode == "paper") else 0
  n_pat = _pat.num_patterns(_PATTERN_SIZE, layer.size) if n_pool else 0
  # Fields a layer does not use are None (empty pytree nodes; orbax cannot store
  # zero-size arrays).
  return ClickTrainLayerState(
    competitive_scores=jnp.zeros((n_pat,), jnp.int32) if n_pool else None,
    pool=jnp.zeros((n_pool,), jnp.int32) if n_pool else None,
    votes=jnp.zeros((cin, cout, n_pool), jnp.int32) if n_pool else None,
    kernel_score_sum=jnp.zeros((cin, cout), jnp.float32),
    pattern_id=jnp.full((cin, cout), -1, jnp.int32),
    kernel_keep=jnp.ones((cin, cout), bool),
    pattern_mask=jnp.ones(leaf.shape, leaf.dtype),
  )


def _as_kernels(x: jax.Array) -> jax.Array:
  """HWIO -> (Cin, Cout, kh, kw)."""
  return jnp.moveaxis(x, (0, 1), (-2, -1))


def full_mask(ls: ClickTrainLayerState) -> jax.Array:
  """The weight mask ``P ⊙ K`` of one layer (HWIO; ones where nothing is pruned yet)."""
  return ls.pattern_mask * ls.kernel_keep.astype(ls.pattern_mask.dtype)


def _group_lasso_grad(w: jax.Array, ls: ClickTrainLayerState, eps: float) -> jax.Array:
  """d/dW Σ_kernels [sqrt(‖W⊙¬P‖²+ε) + sqrt(‖W⊙¬K‖²+ε)] (ClickTrain §4.4)."""
  z = w * (1 - ls.pattern_mask)
  gz = z * jax.lax.rsqrt(jnp.sum(z * z, axis=(0, 1), keepdims=True) + eps)
  u = w * (~ls.kernel_keep).astype(w.dtype)
  gu = u * jax.lax.rsqrt(jnp.sum(u * u, axis=(0, 1), keepdims=True) + eps)
  return gz + gu


# ------------------------------------------------------------------ stage functions
# Each takes the plan, the leaves and the per-layer states explicitly and returns new
# per-layer states (or leaves); none reads anything from an enclosing scope.


def _all_finite(loss, plan: _Plan, w_leaves, g_leaves) -> jax.Array:
  """Whether a step may feed the importance bookkeeping: the loss, every gradient leaf (what
  ``optax.apply_if_finite`` checks) and the pruned weights are finite. Scores from a NaN
  step would stay NaN in the sums for good and rank kernels by index."""
  ok = jnp.isfinite(loss)
  for g in g_leaves:
    ok = ok & jnp.all(jnp.isfinite(g))
  for layer in plan.values():
    ok = ok & jnp.all(jnp.isfinite(w_leaves[layer.index]))
  return ok


def _scored(layers: _Layers, plan: _Plan, stage: Stage) -> jax.Array:
  """Whether some batch of the current POOL / FINALIZE stage fed its scores: each scored
  DPPG batch adds +1 per pattern kernel, each counted finalization batch a vote per pattern
  kernel and Eq. 2 scores (> 0 unless every ``g ⊙ w`` is 0). A stage of only non-finite or
  skipped batches has all-zero scores, which would choose the pool / masks by index."""
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


def _warn_when(pred: jax.Array, message: str, epoch: jax.Array) -> None:
  """A ``RuntimeWarning`` from inside ``jit`` when ``pred`` holds; ``{epoch}`` in
  ``message`` is filled with ``epoch``. A no-op step otherwise (one scalar ``cond``)."""

  def warn(e):
    warnings.warn(message.format(epoch=int(e)), RuntimeWarning)

  jax.lax.cond(pred, lambda: jax.debug.callback(warn, epoch), lambda: None)


def _pool_step(layers: _Layers, plan: _Plan, w_leaves, g_leaves) -> _Layers:
  """DPPG steps 1-5 for one batch: +1 competitive score per kernel's candidate (§4.2)."""
  out = dict(layers)
  for name, layer in plan.items():
    if layer.kind != "pattern":
      continue
    imp = _imp.weight_importance(w_leaves[layer.index], g_leaves[layer.index])
    cand = _pat.dppg_candidates(_as_kernels(imp))
    ls = layers[name]
    out[name] = ls._replace(
      competitive_scores=_pat.accumulate_competitive_scores(ls.competitive_scores, cand)
    )
  return out


def _finalize_step(layers: _Layers, plan: _Plan, w_leaves, g_leaves, counted) -> _Layers:
  """One batch of adaptive finalization (§4.3): pattern votes (Eq. 1) and summed Eq. 2
  kernel scores, both only when the batch passes the loss-margin test (``counted``)."""
  out = dict(layers)
  for name, layer in plan.items():
    ls = layers[name]
    w, g = w_leaves[layer.index], g_leaves[layer.index]
    ks = ls.kernel_score_sum + jnp.where(counted, _imp.kernel_scores(w, g), 0.0)
    votes = ls.votes
    if layer.kind == "pattern":
      pool_masks = _pat.pattern_masks_from_ids(ls.pool, layer.size)
      votes = _pat.vote(votes, _imp.pattern_scores(w, g, pool_masks), counted)
    out[name] = ls._replace(kernel_score_sum=ks, votes=votes)
  return out


def _select_pools(layers: _Layers, plan: _Plan, pool_size: int) -> _Layers:
  """End of DPPG: one global pool per kernel size (DPPG step 6)."""
  out = dict(layers)
  for size in sorted({layer.size for layer in plan.values() if layer.kind == "pattern"}):
    names = [n for n, layer in plan.items() if layer.kind == "pattern" and layer.size == size]
    total = sum(layers[n].competitive_scores for n in names)
    pool = _pat.select_pool(total, min(pool_size, total.shape[0]))
    for n in names:
      out[n] = layers[n]._replace(pool=pool)
  return out


def _finalize_masks(layers: _Layers, plan: _Plan) -> _Layers:
  """End of §4.3: pattern = most voted pool pattern, kernels = lowest summed Eq. 2."""
  out = dict(layers)
  for name, layer in plan.items():
    ls = layers[name]
    keep = _pat.kernel_keep_mask(ls.kernel_score_sum, layer.ratio, per_filter=layer.per_filter)
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


def _one_shot_masks(layers: _Layers, plan: _Plan, w_leaves, g_leaves, num_patterns: int) -> _Layers:
  """The released code's rule on one batch: best of its fixed pool (Eq. 1) + lowest Eq. 2."""
  out = dict(layers)
  blocks, block_ids = _pat.one_shot_pool(num_patterns)
  block_ids = jnp.asarray(block_ids)
  for name, layer in plan.items():
    ls = layers[name]
    w, g = w_leaves[layer.index], g_leaves[layer.index]
    scores = _imp.kernel_scores(w, g)
    keep = _pat.kernel_keep_mask(scores, layer.ratio, per_filter=layer.per_filter)
    if layer.kind == "pattern":
      best = jnp.argmax(_imp.pattern_scores(w, g, blocks), axis=-1)  # ties -> first
      pmask = _pat.pattern_mask(best, blocks, dtype=ls.pattern_mask.dtype)
      out[name] = ls._replace(pattern_id=block_ids[best], kernel_keep=keep, pattern_mask=pmask)
    else:
      out[name] = ls._replace(kernel_keep=keep)
  return out


def _map_pruned(fn, pred, plan: _Plan, leaves) -> list:
  """``leaves`` with the pruned layers' entries replaced by ``fn({name: leaf})`` under one
  ``lax.cond`` on ``pred`` (the other stages neither compute nor copy them)."""
  leaves = list(leaves)
  chosen = {name: leaves[layer.index] for name, layer in plan.items()}
  chosen = jax.lax.cond(pred, fn, lambda x: x, chosen)
  for name, layer in plan.items():
    leaves[layer.index] = chosen[name]
  return leaves


def _modify_grads(
  g_leaves, layers: _Layers, plan: _Plan, w_leaves, stage, coefficient: float, eps: float
) -> list:
  """The gradient the inner optimizer sees: ``+ λ ∂(modified group lasso)`` while
  regularizing (§4.4), masked once pruned (so the inner moments get nothing there)."""
  regularizing = stage == REGULARIZE
  pruned = stage == PRUNED

  def reg_and_mask(gs):
    out = {}
    for name, layer in plan.items():
      ls, g, w = layers[name], gs[name], w_leaves[layer.index]
      reg = _group_lasso_grad(w, ls, eps) * (coefficient * regularizing.astype(w.dtype))
      keep = (full_mask(ls) != 0) | ~pruned
      # A select, not a product: a NaN gradient at a pruned position must not reach the
      # inner optimizer's moments (0 · NaN = NaN).
      out[name] = jnp.where(keep, g + reg.astype(g.dtype), jnp.zeros((), g.dtype))
    return out

  return _map_pruned(reg_and_mask, regularizing | pruned, plan, g_leaves)


def _hard_mask(u_leaves, layers: _Layers, plan: _Plan, w_leaves, pruned) -> list:
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


class _Clock(NamedTuple):
  """Where a step sits in the epoch schedule (all traced scalars)."""

  done: jax.Array  # steps done after this one
  epoch_end: jax.Array  # this step ends an epoch
  epochs_done: jax.Array
  loss_sum: jax.Array  # the epoch's loss sum including this step
  mean: jax.Array  # the epoch's mean loss (meaningful at its end)
  in_stage: jax.Array  # epochs spent in the current stage
  loss: jax.Array  # this step's loss (0 when none is given)


def _clock(cfg: _Config, state: ClickTrainState, loss) -> _Clock:
  done = state.count + 1
  spe = cfg.steps_per_epoch
  epochs_done = done // spe
  loss_sum = state.epoch_loss_sum + loss
  return _Clock(
    done=done,
    epoch_end=(done % spe) == 0,
    epochs_done=epochs_done,
    loss_sum=loss_sum,
    mean=loss_sum / spe,
    in_stage=epochs_done - state.stage_start_epoch,
    loss=loss,
  )


def _next_state(
  cfg: _Config, state: ClickTrainState, clock: _Clock, stage, moved, layers, inner_state
) -> ClickTrainState:
  """The state after this step: stage + 1 where a transition (or the hard prune, from
  ``hard_prune_epoch`` at the end of REGULARIZE) ends this step; the epoch's loss bookkeeping."""
  to_pruned = clock.epoch_end & (stage == REGULARIZE) & (clock.epochs_done >= cfg.hard_prune_epoch)
  moved = moved | to_pruned
  return ClickTrainState(
    count=clock.done,
    stage=stage + moved.astype(jnp.int32),
    stage_start_epoch=jnp.where(moved, clock.epochs_done, state.stage_start_epoch),
    epoch_loss_sum=jnp.where(clock.epoch_end, 0.0, clock.loss_sum),
    prev_epoch_loss=jnp.where(clock.epoch_end, clock.mean, state.prev_epoch_loss),
    # A non-finite loss is no reference for the next batch's margin test (§4.3).
    last_loss=jnp.where(jnp.isfinite(clock.loss), clock.loss, state.last_loss),
    layers=layers,
    inner_state=inner_state,
  )


def _paper_step(cfg: _Config, plan: _Plan, state: ClickTrainState, clock: _Clock, w, g):
  """Paper mode, stages 2 and 3: the per-batch importance work, then (at the stage's last
  step) pool selection / finalization, in ONE ``lax.switch`` on the stage.

  Returns the new per-layer states and whether this step ends WARMUP, POOL or FINALIZE.
  """
  stage = state.stage
  if cfg.pool_start_epoch is None:  # §4.1's loss-derivative trigger
    start_pool = (~jnp.isnan(state.prev_epoch_loss)) & (
      jnp.abs(clock.mean - state.prev_epoch_loss) < cfg.loss_derivative_threshold
    )
  else:
    start_pool = clock.epochs_done >= cfg.pool_start_epoch
  to_pool = clock.epoch_end & (stage == WARMUP) & start_pool
  # Only the data-driven trigger can leave the run in warmup at the hard prune epoch (a set
  # pool_start_epoch that late is a ValueError in clicktrain()): say so once, or the run
  # ends dense without a word.
  _warn_when(
    clock.epoch_end
    & (stage == WARMUP)
    & ~to_pool
    & (clock.epochs_done == max(cfg.hard_prune_epoch, 1)),
    "clicktrain: still in warmup after {epoch} epochs (hard_prune_epoch="
    f"{cfg.hard_prune_epoch}): the loss-derivative trigger (|change of the epoch mean loss| "
    f"< loss_derivative_threshold={cfg.loss_derivative_threshold}) has not fired, so nothing "
    "is pruned yet; pool generation starts when it fires and the hard prune comes "
    "pool_epochs + finalize_epochs + 1 epochs later (set pool_start_epoch for a fixed "
    "schedule)",
    clock.epochs_done,
  )
  to_final = clock.epoch_end & (stage == POOL) & (clock.in_stage >= cfg.pool_epochs)
  to_reg = clock.epoch_end & (stage == FINALIZE) & (clock.in_stage >= cfg.finalize_epochs)
  counted = _pat.loss_margin_ok(state.last_loss, clock.loss, cfg.loss_margin, cfg.margin_rule)
  counted = counted | jnp.isnan(state.last_loss)
  do_importance = (state.count % cfg.importance_every) == 0

  # The finiteness check runs inside the POOL / FINALIZE branches only (one pass over the
  # gradients), so the other stages do not pay for it. A stage that fed no scores (every
  # batch non-finite or skipped) does not end: it goes on for another epoch, as one_shot
  # defers its pick, instead of choosing the pool / masks from all-zero scores by index.
  def pool_branch(ls):
    run = do_importance & _all_finite(clock.loss, plan, w, g)
    ls = jax.lax.cond(run, lambda x: _pool_step(x, plan, w, g), lambda x: x, ls)
    end = to_final & _scored(ls, plan, POOL)
    return jax.lax.cond(end, lambda x: _select_pools(x, plan, cfg.pool_size), lambda x: x, ls), end

  def finalize_branch(ls):
    run = do_importance & _all_finite(clock.loss, plan, w, g)
    ls = jax.lax.cond(run, lambda x: _finalize_step(x, plan, w, g, counted), lambda x: x, ls)
    end = to_reg & _scored(ls, plan, FINALIZE)
    return jax.lax.cond(end, lambda x: _finalize_masks(x, plan), lambda x: x, ls), end

  branch = jnp.where(stage == POOL, 1, jnp.where(stage == FINALIZE, 2, 0))
  layers, ended = jax.lax.switch(
    branch, [lambda x: (x, jnp.bool_(False)), pool_branch, finalize_branch], state.layers
  )
  _warn_when(
    (to_final | to_reg) & ~ended,
    "clicktrain: no batch of the pool generation / finalization stage ending after "
    "{epoch} epochs fed its scores (every one non-finite, skipped by importance_every or failing "
    "the loss-margin test): the stage goes on for another epoch instead of choosing patterns "
    "and kernels from all-zero scores",
    clock.epochs_done,
  )
  return layers, to_pool | ended


def _one_shot_step(cfg: _Config, plan: _Plan, state: ClickTrainState, clock: _Clock, w, g):
  """One-shot mode: masks from the first batch of ``one_shot_epoch``, straight to REGULARIZE.
  A non-finite batch defers the pick to the next finite one (NaN scores must not pick).

  Returns the new per-layer states and the stage.
  """
  due = (state.stage == WARMUP) & (state.count >= cfg.one_shot_epoch * cfg.steps_per_epoch)
  pick = jax.lax.cond(due, lambda: _all_finite(clock.loss, plan, w, g), lambda: jnp.bool_(False))
  layers = jax.lax.cond(
    pick,
    lambda ls: _one_shot_masks(ls, plan, w, g, cfg.one_shot_patterns),
    lambda ls: ls,
    state.layers,
  )
  return layers, jnp.where(pick, REGULARIZE, state.stage)


def clicktrain(
  inner: optax.GradientTransformation,
  *,
  steps_per_epoch: int,
  hard_prune_epoch: int,
  mode: str = "paper",
  kernel_prune_ratio: float | Sequence[float] | Callable[[str, tuple[int, ...]], float] = 0.5,
  pool_start_epoch: int | None = None,
  loss_derivative_threshold: float = 0.27,
  pool_epochs: int = 5,
  finalize_epochs: int = 5,
  pool_size: int = 12,
  loss_margin: float = 0.0018,
  margin_rule: str = "relative",
  group_lasso_coefficient: float = 2.5e-4,
  one_shot_epoch: int | None = None,
  one_shot_patterns: int = 4,
  layer_filter: Callable[[str, tuple[int, ...]], str | None] | None = None,
  importance_every: int = 1,
  balanced_kernels: bool = False,
  eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
  """ClickTrain pattern + connectivity pruning around an inner optimizer.

  Args:
      inner: the optimizer (e.g. ``optax.sgd(0.1, momentum=0.9)`` chained with
          weight decay); receives the regularized / masked gradient.
      steps_per_epoch: optimizer steps per epoch (converts the epoch settings).
      hard_prune_epoch: epoch whose every step runs on the pruned weights (paper
          Table 1: 90-98 of 190): the last step of the epoch before it zeroes them and
          enters the pruned stage.
      mode: ``"paper"`` (DPPG + adaptive finalization) or ``"one_shot"``
          (the authors' released code).
      kernel_prune_ratio: fraction of kernels removed per layer: one float,
          a sequence (one per pruned layer, in param flatten order) or
          ``fn(path, shape) -> float``.
      pool_start_epoch: paper mode: epoch at which DPPG starts; ``None`` uses
          the loss-derivative trigger (§4.1, a ``RuntimeWarning`` if it has not fired by
          ``hard_prune_epoch``). When set, ``hard_prune_epoch`` must be larger than
          ``pool_start_epoch + pool_epochs + finalize_epochs``.
      loss_derivative_threshold: the trigger's threshold (0.27 in the paper).
      pool_epochs: epochs of DPPG (stage 2).
      finalize_epochs: epochs of adaptive finalization (stage 3).
      pool_size: N, patterns in the final pool (8 or 12).
      loss_margin: δ of §4.3.
      margin_rule: ``"relative"`` or ``"literal"`` (see
          :func:`jaxprune.clicktrain.patterns.loss_margin_ok`).
      group_lasso_coefficient: λ of the modified group lasso (2.5e-4 in the paper).
      one_shot_epoch: one_shot mode: the epoch whose first batch picks masks (the next
          finite batch if that one's loss or gradient is not finite).
      one_shot_patterns: one_shot mode: size of the fixed pool each kernel picks its
          pattern from, 4, 8 or 12 (:func:`jaxprune.clicktrain.patterns.one_shot_pool`: the
          head of the released library; 4, the centre 2x2 blocks, is the released default,
          their VGG-16 config uses 12).
      layer_filter: ``fn(path, shape) -> "pattern" | "kernel" | None``;
          default :func:`default_layer_filter`.
      importance_every: run the per-batch importance work every this many
          steps (1 = every batch, as in the paper); paper mode: at most the steps of
          the shorter of the pool and finalization stages.
      balanced_kernels: prune ``ceil(ratio * Cin)`` kernels in every filter instead of
          ranking the whole layer, so every filter keeps the same number of weights: the
          load-balance constraint of the paper's sparse kernels (§5.2); off by default, as
          in the released code.
      eps: ε inside the group-lasso square roots.

  Returns:
      An ``optax.GradientTransformationExtraArgs``; its ``update`` needs
      ``params`` and (paper mode) ``value=loss``.

  Raises:
      ValueError: a bad argument (named in the message); from ``update``, params whose
          pruned layers (paths or shapes) are not those ``init`` saw (the first one named).
  """
  if mode not in ("paper", "one_shot"):
    raise ValueError(f"mode must be 'paper' or 'one_shot', got {mode!r}")
  if not isinstance(balanced_kernels, bool):
    raise ValueError(f"balanced_kernels must be a bool, got {balanced_kernels!r}")
  for name, v, lo in (
    ("steps_per_epoch", steps_per_epoch, 1),
    ("hard_prune_epoch", hard_prune_epoch, 0),
    ("pool_epochs", pool_epochs, 1),
    ("finalize_epochs", finalize_epochs, 1),
    ("pool_size", pool_size, 1),
    ("importance_every", importance_every, 1),
  ):
    if not isinstance(v, (int, np.integer)) or v < lo:
      raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
  if pool_start_epoch is not None and (
    not isinstance(pool_start_epoch, (int, np.integer)) or pool_start_epoch < 0
  ):
    raise ValueError(f"pool_start_epoch must be None or an int >= 0, got {pool_start_epoch!r}")
  if isinstance(one_shot_patterns, bool) or one_shot_patterns not in _pat.ONE_SHOT_POOL_SIZES:
    raise ValueError(
      f"one_shot_patterns must be one of {_pat.ONE_SHOT_POOL_SIZES}, got {one_shot_patterns!r}"
    )
  shortest = min(pool_epochs, finalize_epochs) * steps_per_epoch
  if mode == "paper" and importance_every > shortest:
    # A stage of fewer steps than importance_every may hold no importance step: all-zero
    # scores, and the pool / masks would go by index.
    stage = "pool_epochs" if pool_epochs <= finalize_epochs else "finalize_epochs"
    raise ValueError(
      f"importance_every ({importance_every}) must be <= the shortest importance stage, "
      f"{stage} * steps_per_epoch = {shortest} steps, or that stage may score no batch"
    )
  if mode == "paper" and pool_start_epoch is not None:
    # A fixed schedule is known here: masks final at pool_start + pool + finalize, then at
    # least one epoch of regularization (§4.4) before the hard prune. A later hard prune
    # than asked (or a run still in warmup at hard_prune_epoch) is a mis-configuration.
    final = pool_start_epoch + pool_epochs + finalize_epochs
    if hard_prune_epoch <= final:
      raise ValueError(
        f"hard_prune_epoch ({hard_prune_epoch}) must be > pool_start_epoch + pool_epochs + "
        f"finalize_epochs ({pool_start_epoch} + {pool_epochs} + {finalize_epochs} = {final}): "
        "the masks are final only at that epoch and get at least one epoch of regularization"
      )
  if mode == "one_shot":
    if not isinstance(one_shot_epoch, (int, np.integer)) or one_shot_epoch < 0:
      raise ValueError(
        f"one_shot_epoch must be an int >= 0 in mode 'one_shot', got {one_shot_epoch!r}"
      )
    if hard_prune_epoch <= one_shot_epoch:
      raise ValueError(
        f"hard_prune_epoch ({hard_prune_epoch}) must come after one_shot_epoch ({one_shot_epoch})"
      )
  for name, v in (
    ("loss_derivative_threshold", loss_derivative_threshold),
    ("loss_margin", loss_margin),
    ("group_lasso_coefficient", group_lasso_coefficient),
    ("eps", eps),
  ):
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
      raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
  if margin_rule not in ("relative", "literal"):
    raise ValueError(f"margin_rule must be 'relative' or 'literal', got {margin_rule!r}")
  if isinstance(kernel_prune_ratio, (int, float)) and not (
    0.0 <= _ratio(kernel_prune_ratio) <= 1.0
  ):
    raise ValueError(f"kernel_prune_ratio must be in [0, 1], got {kernel_prune_ratio}")
  if pool_size > _pat.num_patterns(_PATTERN_SIZE, 3):
    raise ValueError(f"pool_size must be <= 126, got {pool_size}")
  layer_filter = layer_filter or default_layer_filter
  inner = optax.with_extra_args_support(inner)
  cfg = _Config(
    mode=mode,
    steps_per_epoch=int(steps_per_epoch),
    hard_prune_epoch=hard_prune_epoch,
    pool_start_epoch=pool_start_epoch,
    loss_derivative_threshold=loss_derivative_threshold,
    pool_epochs=pool_epochs,
    finalize_epochs=finalize_epochs,
    pool_size=pool_size,
    loss_margin=loss_margin,
    margin_rule=margin_rule,
    group_lasso_coefficient=group_lasso_coefficient,
    one_shot_epoch=one_shot_epoch,
    one_shot_patterns=int(one_shot_patterns),
    importance_every=importance_every,
    eps=eps,
  )

  # A ratio sequence is matched to the pruned layers (flatten order) at the first init and
  # remembered by name, so a model that later loses layers still finds its ratios.
  ratio_by_name: dict[str, float] = {}

  def init_fn(params):
    plan = _plan(params, layer_filter, kernel_prune_ratio, mode, ratio_by_name, balanced_kernels)
    leaves = jax.tree.leaves(params)
    start = POOL if (mode == "paper" and pool_start_epoch == 0) else WARMUP
    return ClickTrainState(
      count=jnp.zeros([], jnp.int32),
      stage=jnp.asarray(start, jnp.int32),
      stage_start_epoch=jnp.zeros([], jnp.int32),
      epoch_loss_sum=jnp.zeros([], jnp.float32),
      prev_epoch_loss=jnp.full([], jnp.nan, jnp.float32),
      last_loss=jnp.full([], jnp.nan, jnp.float32),
      layers={
        n: _init_layer(leaves[layer.index], layer, pool_size, mode) for n, layer in plan.items()
      },
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, *, value=None, **extra_args):
    if params is None:
      raise ValueError("clicktrain needs params: update(grads, state, params, value=loss)")
    if value is None and mode == "paper":
      raise ValueError("clicktrain(mode='paper') needs the loss: update(..., value=loss)")
    plan = _plan(params, layer_filter, kernel_prune_ratio, mode, ratio_by_name, balanced_kernels)
    loss = jnp.asarray(0.0 if value is None else value, jnp.float32)
    w_leaves = jax.tree.leaves(params)
    _check_layers(plan, state.layers, params)
    g_leaves, g_def = jax.tree.flatten(updates)
    clock = _clock(cfg, state, loss)
    if mode == "paper":
      layers, moved = _paper_step(cfg, plan, state, clock, w_leaves, g_leaves)
      stage = state.stage
    else:
      layers, stage = _one_shot_step(cfg, plan, state, clock, w_leaves, g_leaves)
      moved = jnp.bool_(False)

    g_leaves = _modify_grads(g_leaves, layers, plan, w_leaves, stage, group_lasso_coefficient, eps)
    grads = jax.tree.unflatten(g_def, g_leaves)
    new_updates, inner_state = inner.update(
      grads, state.inner_state, params, value=value, **extra_args
    )
    u_leaves, u_def = jax.tree.flatten(new_updates)
    new_state = _next_state(cfg, state, clock, stage, moved, layers, inner_state)
    # The step that enters PRUNED already emits the hard mask: a state (and every read-out
    # of it) that says "pruned" always comes with weights that are zero where the masks prune.
    u_leaves = _hard_mask(u_leaves, layers, plan, w_leaves, new_state.stage == PRUNED)
    return jax.tree.unflatten(u_def, u_leaves), new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
