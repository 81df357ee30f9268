"""ClickTrain as one Optax transform wrapping the inner optimizer (ClickTrain §4).

ClickTrain (Zhang et al., ICS'21) prunes during training: every 3x3 (k x k)
kernel keeps 4 weights in one of a small pool of patterns, and a per-layer
fraction of whole kernels is removed (connectivity sparsity). The algorithm
runs as a stage machine over epochs (ClickTrain Fig. 4 / slides):

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
                   after every step; gradients are masked before the inner
                   optimizer so its moments stay zero there too.
====  ===========  ==========================================================

``mode="one_shot"`` follows the authors' released code instead: at the first
step of ``one_shot_epoch`` the masks are chosen from that one batch's gradient
(pattern = argmax of Eq. 1 over the four 2x2 blocks containing the centre,
ties to the first; kernels = the ``ceil(ratio * Cin * Cout)`` lowest Eq. 2
scores), then REGULARIZE with a fixed λ until ``hard_prune_epoch``, then
PRUNED. The released code also switches to mixup (α = 0.3) after the hard
prune; that is data-side: use ``jaxprune.data.Loader``'s soft labels.

Transitions happen at epoch ends (``steps_per_epoch`` converts), inside
``jit``: the stage, step and loss statistics live in the state; DPPG /
votes and pool selection / finalization run in one ``lax.switch`` on the
stage, the group lasso and masks under one ``lax.cond`` each, so a stage
neither computes nor copies what it does not use — no host round trip per
step. The loss comes in
through Optax's extra args: ``update(grads, state, params, value=loss)``
(``nnx.Optimizer.update(model, grads, value=loss)`` passes it).

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
* If the finalization ends after ``hard_prune_epoch``, the hard prune happens
  one epoch after it (at least one epoch of regularization).
* Importance work may run every ``importance_every`` steps (default 1) to cut
  overhead; skipped steps neither vote nor add competitive scores.

Example::

    tx = jaxprune.clicktrain.clicktrain(
        optax.sgd(0.1, momentum=0.9), steps_per_epoch=len(loader),
        kernel_prune_ratio=0.5, pool_start_epoch=None, hard_prune_epoch=95)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ...
    optimizer.update(model, grads, value=loss)
    weight_masks = masks(optimizer.opt_state, params)   # after the hard prune
"""

from __future__ import annotations

import math
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
  "clicktrain",
  "ClickTrainState",
  "ClickTrainLayerState",
  "WARMUP",
  "POOL",
  "FINALIZE",
  "REGULARIZE",
  "PRUNED",
  "STAGE_NAMES",
  "default_layer_filter",
  "masks",
  "pattern_ids",
  "kernel_masks",
  "pattern_usage",
  "group_lasso_penalty",
  "compression",
  "flops_saved",
  "stage_name",
]

PyTree = Any
WARMUP, POOL, FINALIZE, REGULARIZE, PRUNED = 0, 1, 2, 3, 4
STAGE_NAMES = ("warmup", "pool", "finalize", "regularize", "pruned")
_PATTERN_SIZE = 4  # weights kept per kernel (ClickTrain keeps 4 of 9)


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
  stage: jax.Array  # WARMUP .. PRUNED
  stage_start_epoch: jax.Array  # epoch at which the current stage began
  epoch_loss_sum: jax.Array  # loss summed over the current epoch
  prev_epoch_loss: jax.Array  # mean loss of the last finished epoch (nan: none)
  last_loss: jax.Array  # previous batch loss (nan: none)
  layers: dict[str, ClickTrainLayerState]
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


class _Layer(NamedTuple):
  index: int  # position among the flattened param leaves
  kind: str  # "pattern" or "kernel"
  ratio: float  # kernel-prune ratio
  size: int  # kernel side (0 for kernel-only)


def _plan(params: PyTree, layer_filter, kernel_prune_ratio, mode: str) -> dict[str, _Layer]:
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
    ratios = [float(kernel_prune_ratio)] * len(chosen)
  elif callable(kernel_prune_ratio):
    ratios = [
      float(kernel_prune_ratio(name, tuple(np.shape(leaves[i][1])))) for name, i, _, _ in chosen
    ]
  else:
    ratios = [float(r) for r in kernel_prune_ratio]
    if len(ratios) != len(chosen):
      raise ValueError(
        f"kernel_prune_ratio has {len(ratios)} entries for {len(chosen)} "
        f"pruned layers: {[c[0] for c in chosen]}"
      )
  for (name, *_), r in zip(chosen, ratios):
    if not 0.0 <= r <= 1.0:
      raise ValueError(f"kernel_prune_ratio for {name!r} must be in [0, 1], got {r}")
  return {
    name: _Layer(i, kind, r, kh if kind == "pattern" else 0)
    for (name, i, kind, kh), r in zip(chosen, ratios)
  }


def _init_layer(leaf: jax.Array, layer: _Layer, pool_size: int, mode: str) -> ClickTrainLayerState:
  kh, kw, cin, cout = leaf.shape
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


def _full_mask(ls: ClickTrainLayerState) -> jax.Array:
  return ls.pattern_mask * ls.kernel_keep.astype(ls.pattern_mask.dtype)


def _group_lasso_grad(w: jax.Array, ls: ClickTrainLayerState, eps: float) -> jax.Array:
  """d/dW Σ_kernels [sqrt(‖W⊙¬P‖²+ε) + sqrt(‖W⊙¬K‖²+ε)] (ClickTrain §4.4)."""
  z = w * (1 - ls.pattern_mask)
  gz = z * jax.lax.rsqrt(jnp.sum(z * z, axis=(0, 1), keepdims=True) + eps)
  u = w * (~ls.kernel_keep).astype(w.dtype)
  gu = u * jax.lax.rsqrt(jnp.sum(u * u, axis=(0, 1), keepdims=True) + eps)
  return gz + gu


def group_lasso_penalty(params: PyTree, state: ClickTrainState, eps: float = 1e-8) -> jax.Array:
  """The modified group lasso term (without λ) for the current masks (§4.4)."""
  params = _pure(params)
  leaves = jax.tree.leaves(params)
  by_name = _leaf_names(params)
  total = jnp.float32(0)
  for name, ls in state.layers.items():
    w = leaves[by_name[name]]
    z = w * (1 - ls.pattern_mask)
    u = w * (~ls.kernel_keep).astype(w.dtype)
    total += jnp.sum(jnp.sqrt(jnp.sum(z * z, axis=(0, 1)) + eps))
    total += jnp.sum(jnp.sqrt(jnp.sum(u * u, axis=(0, 1)) + eps))
  return total


def _pure(params: PyTree) -> PyTree:
  """NNX ``State`` of Variables -> the pure tree the optimizer sees (paths match)."""
  try:
    from flax import nnx

    if isinstance(params, nnx.State):
      return nnx.as_pure(params)
  except ImportError:  # pragma: no cover
    pass
  return params


def _leaf_names(params: PyTree) -> dict[str, int]:
  params = _pure(params)
  return {
    path_string(p): i for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0])
  }


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
  layer_filter: Callable[[str, tuple[int, ...]], str | None] | None = None,
  importance_every: int = 1,
  eps: float = 1e-8,
) -> optax.GradientTransformationExtraArgs:
  """ClickTrain pattern + connectivity pruning around an inner optimizer.

  Args:
      inner: the optimizer (e.g. ``optax.sgd(0.1, momentum=0.9)`` chained with
          weight decay); receives the regularized / masked gradient.
      steps_per_epoch: optimizer steps per epoch (converts the epoch settings).
      hard_prune_epoch: epoch from whose first step the masks are applied
          (paper Table 1: 90-98 of 190).
      mode: ``"paper"`` (DPPG + adaptive finalization) or ``"one_shot"``
          (the authors' released code).
      kernel_prune_ratio: fraction of kernels removed per layer: one float,
          a sequence (one per pruned layer, in param flatten order) or
          ``fn(path, shape) -> float``.
      pool_start_epoch: paper mode: epoch at which DPPG starts; ``None`` uses
          the loss-derivative trigger (§4.1).
      loss_derivative_threshold: the trigger's threshold (0.27 in the paper).
      pool_epochs: epochs of DPPG (stage 2).
      finalize_epochs: epochs of adaptive finalization (stage 3).
      pool_size: N, patterns in the final pool (8 or 12).
      loss_margin: δ of §4.3.
      margin_rule: ``"relative"`` or ``"literal"`` (see
          :func:`jaxprune.clicktrain.patterns.loss_margin_ok`).
      group_lasso_coefficient: λ of the modified group lasso (2.5e-4 in the paper).
      one_shot_epoch: one_shot mode: the epoch whose first batch picks masks.
      layer_filter: ``fn(path, shape) -> "pattern" | "kernel" | None``;
          default :func:`default_layer_filter`.
      importance_every: run the per-batch importance work every this many
          steps (1 = every batch, as in the paper).
      eps: ε inside the group-lasso square roots.

  Returns:
      An ``optax.GradientTransformationExtraArgs``; its ``update`` needs
      ``params`` and (paper mode) ``value=loss``.

  Raises:
      ValueError: a bad argument (named in the message).
  """
  if mode not in ("paper", "one_shot"):
    raise ValueError(f"mode must be 'paper' or 'one_shot', got {mode!r}")
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
  if isinstance(kernel_prune_ratio, (int, float)) and not 0.0 <= kernel_prune_ratio <= 1.0:
    raise ValueError(f"kernel_prune_ratio must be in [0, 1], got {kernel_prune_ratio}")
  if pool_size > _pat.num_patterns(_PATTERN_SIZE, 3):
    raise ValueError(f"pool_size must be <= 126, got {pool_size}")
  layer_filter = layer_filter or default_layer_filter
  inner = optax.with_extra_args_support(inner)
  spe = int(steps_per_epoch)

  def plan(params):
    return _plan(params, layer_filter, kernel_prune_ratio, mode)

  def init_fn(params):
    layers = plan(params)
    leaves = jax.tree.leaves(params)
    start = POOL if (mode == "paper" and pool_start_epoch == 0) else WARMUP
    return ClickTrainState(
      count=jnp.zeros([], jnp.int32),
      stage=jnp.asarray(start, jnp.int32),
      stage_start_epoch=jnp.zeros([], jnp.int32),
      epoch_loss_sum=jnp.zeros([], jnp.float32),
      prev_epoch_loss=jnp.full([], jnp.nan, jnp.float32),
      last_loss=jnp.full([], jnp.nan, jnp.float32),
      layers={name: _init_layer(leaves[l.index], l, pool_size, mode) for name, l in layers.items()},
      inner_state=inner.init(params),
    )

  # ---------------------------------------------------------------- per-step work
  def pool_step(layers, plan_, w_leaves, g_leaves):
    out = dict(layers)
    for name, l in plan_.items():
      if l.kind != "pattern":
        continue
      imp = _imp.weight_importance(w_leaves[l.index], g_leaves[l.index])
      cand = _pat.dppg_candidates(_as_kernels(imp))
      ls = layers[name]
      out[name] = ls._replace(
        competitive_scores=_pat.accumulate_competitive_scores(ls.competitive_scores, cand)
      )
    return out

  def finalize_step(layers, plan_, w_leaves, g_leaves, counted):
    out = dict(layers)
    for name, l in plan_.items():
      ls = layers[name]
      w, g = w_leaves[l.index], g_leaves[l.index]
      ks = ls.kernel_score_sum + jnp.where(counted, _imp.kernel_scores(w, g), 0.0)
      votes = ls.votes
      if l.kind == "pattern":
        pool_masks = _pat.pattern_masks_from_ids(ls.pool, l.size)
        votes = _pat.vote(votes, _imp.pattern_scores(w, g, pool_masks), counted)
      out[name] = ls._replace(kernel_score_sum=ks, votes=votes)
    return out

  def select_pools(layers, plan_):
    """End of DPPG: one global pool per kernel size (DPPG step 6)."""
    out = dict(layers)
    for size in sorted({l.size for l in plan_.values() if l.kind == "pattern"}):
      names = [n for n, l in plan_.items() if l.kind == "pattern" and l.size == size]
      total = sum(layers[n].competitive_scores for n in names)
      pool = _pat.select_pool(total, min(pool_size, total.shape[0]))
      for n in names:
        out[n] = layers[n]._replace(pool=pool)
    return out

  def finalize_masks(layers, plan_):
    out = dict(layers)
    for name, l in plan_.items():
      ls = layers[name]
      keep = _pat.kernel_keep_mask(ls.kernel_score_sum, l.ratio)
      if l.kind == "pattern":
        best = _pat.finalize_patterns(ls.votes)  # pool position per kernel
        pid = ls.pool[best]
        pmask = _pat.pattern_mask(
          best, _pat.pattern_masks_from_ids(ls.pool, l.size), dtype=ls.pattern_mask.dtype
        )
        out[name] = ls._replace(pattern_id=pid, kernel_keep=keep, pattern_mask=pmask)
      else:
        out[name] = ls._replace(kernel_keep=keep)
    return out

  def one_shot_masks(layers, plan_, w_leaves, g_leaves):
    """The released code's rule on one batch: centre blocks + lowest Eq. 2."""
    out = dict(layers)
    blocks = _pat.centre_block_patterns()
    block_ids = jnp.asarray(_pat.library_pattern_ids()[:4])
    for name, l in plan_.items():
      ls = layers[name]
      w, g = w_leaves[l.index], g_leaves[l.index]
      keep = _pat.kernel_keep_mask(_imp.kernel_scores(w, g), l.ratio)
      if l.kind == "pattern":
        best = jnp.argmax(_imp.pattern_scores(w, g, blocks), axis=-1)  # ties -> first
        pmask = _pat.pattern_mask(best, blocks, dtype=ls.pattern_mask.dtype)
        out[name] = ls._replace(pattern_id=block_ids[best], kernel_keep=keep, pattern_mask=pmask)
      else:
        out[name] = ls._replace(kernel_keep=keep)
    return out

  # ---------------------------------------------------------------- update
  def update_fn(updates, state, params=None, *, value=None, **extra_args):
    if params is None:
      raise ValueError("clicktrain needs params: update(grads, state, params, value=loss)")
    plan_ = plan(params)
    if value is None and mode == "paper":
      raise ValueError("clicktrain(mode='paper') needs the loss: update(..., value=loss)")
    loss = jnp.asarray(0.0 if value is None else value, jnp.float32)
    w_leaves = jax.tree.leaves(params)
    g_leaves, g_def = jax.tree.flatten(updates)
    count, stage, layers = state.count, state.stage, state.layers
    do_importance = (count % importance_every) == 0

    # Epoch-end bookkeeping: which transition (if any) ends this step.
    done = count + 1
    epoch_end = (done % spe) == 0
    epochs_done = done // spe
    loss_sum = state.epoch_loss_sum + loss
    mean = loss_sum / spe
    in_stage = epochs_done - state.stage_start_epoch
    if mode == "paper":
      if pool_start_epoch is None:
        start_pool = (~jnp.isnan(state.prev_epoch_loss)) & (
          jnp.abs(mean - state.prev_epoch_loss) < loss_derivative_threshold
        )
      else:
        start_pool = epochs_done >= pool_start_epoch
      to_pool = epoch_end & (stage == WARMUP) & start_pool
      to_final = epoch_end & (stage == POOL) & (in_stage >= pool_epochs)
      to_reg = epoch_end & (stage == FINALIZE) & (in_stage >= finalize_epochs)
      counted = _pat.loss_margin_ok(state.last_loss, loss, loss_margin, margin_rule)
      counted = counted | jnp.isnan(state.last_loss)

      # Stages 2 and 3: the per-batch importance work, then (at the stage's last
      # step) pool selection / finalization, in ONE lax.switch on the stage so that
      # the other stages neither compute nor copy the per-layer state.
      def pool_branch(ls):
        ls = jax.lax.cond(
          do_importance, lambda x: pool_step(x, plan_, w_leaves, g_leaves), lambda x: x, ls
        )
        return jax.lax.cond(to_final, lambda x: select_pools(x, plan_), lambda x: x, ls)

      def finalize_branch(ls):
        ls = jax.lax.cond(
          do_importance,
          lambda x: finalize_step(x, plan_, w_leaves, g_leaves, counted),
          lambda x: x,
          ls,
        )
        return jax.lax.cond(to_reg, lambda x: finalize_masks(x, plan_), lambda x: x, ls)

      branch = jnp.where(stage == POOL, 1, jnp.where(stage == FINALIZE, 2, 0))
      layers = jax.lax.switch(branch, [lambda x: x, pool_branch, finalize_branch], layers)
    else:
      to_pool = to_final = to_reg = jnp.bool_(False)
      pick = (stage == WARMUP) & (count == one_shot_epoch * spe)
      layers = jax.lax.cond(
        pick, lambda ls: one_shot_masks(ls, plan_, w_leaves, g_leaves), lambda ls: ls, layers
      )
      stage = jnp.where(pick, REGULARIZE, stage)

    # Gradient: + λ ∂(modified group lasso) while regularizing; masked once pruned.
    # One cond over the pruned layers' gradients: stages 0-2 skip it entirely.
    regularizing = stage == REGULARIZE
    pruned = stage == PRUNED

    def reg_and_mask(gs):
      out = {}
      for name, l in plan_.items():
        ls, g, w = layers[name], gs[name], w_leaves[l.index]
        reg = _group_lasso_grad(w, ls, eps) * (group_lasso_coefficient * regularizing.astype(w.dtype))
        m = jnp.where(pruned, _full_mask(ls), 1).astype(g.dtype)
        out[name] = (g + reg.astype(g.dtype)) * m
      return out

    g_leaves = list(g_leaves)
    pruned_grads = {name: g_leaves[l.index] for name, l in plan_.items()}
    pruned_grads = jax.lax.cond(regularizing | pruned, reg_and_mask, lambda gs: gs, pruned_grads)
    for name, l in plan_.items():
      g_leaves[l.index] = pruned_grads[name]
    grads = jax.tree.unflatten(g_def, g_leaves)
    new_updates, inner_state = inner.update(
      grads, state.inner_state, params, value=value, **extra_args
    )

    # Hard prune: emit mask * (p + u) - p so that p + update is exactly 0 where pruned.
    def hard(us):
      out = {}
      for name, l in plan_.items():
        p = w_leaves[l.index]
        m = _full_mask(layers[name]).astype(p.dtype)
        out[name] = (m * (p + us[name]) - p).astype(us[name].dtype)
      return out

    u_leaves, u_def = jax.tree.flatten(new_updates)
    pruned_updates = {name: u_leaves[l.index] for name, l in plan_.items()}
    pruned_updates = jax.lax.cond(pruned, hard, lambda us: us, pruned_updates)
    for name, l in plan_.items():
      u_leaves[l.index] = pruned_updates[name]
    new_updates = jax.tree.unflatten(u_def, u_leaves)

    to_pruned = epoch_end & (stage == REGULARIZE) & (epochs_done >= hard_prune_epoch)
    moved = to_pool | to_final | to_reg | to_pruned
    new_stage = stage + moved.astype(jnp.int32)
    new_state = ClickTrainState(
      count=done,
      stage=new_stage,
      stage_start_epoch=jnp.where(moved, epochs_done, state.stage_start_epoch),
      epoch_loss_sum=jnp.where(epoch_end, 0.0, loss_sum),
      prev_epoch_loss=jnp.where(epoch_end, mean, state.prev_epoch_loss),
      last_loss=loss,
      layers=layers,
      inner_state=inner_state,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# -------------------------------------------------------------------- helpers
def stage_name(state: ClickTrainState) -> str:
  """Name of the current stage (host side)."""
  return STAGE_NAMES[int(state.stage)]


def _find_state(opt_state: Any) -> ClickTrainState:
  if isinstance(opt_state, ClickTrainState):
    return opt_state
  for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ClickTrainState)):
    if isinstance(leaf, ClickTrainState):
      return leaf
  raise ValueError("no ClickTrainState found in opt_state")


def pattern_ids(opt_state: Any) -> dict[str, np.ndarray]:
  """Per pattern layer: ``(Cin, Cout)`` ids into ``all_patterns(4, k)`` (-1 = not final)."""
  st = _find_state(opt_state)
  return {
    n: np.asarray(ls.pattern_id)
    for n, ls in st.layers.items()
    if ls.pattern_id.size and ls.pattern_mask.shape[0] > 1
  }


def kernel_masks(opt_state: Any) -> dict[str, np.ndarray]:
  """Per pruned layer: bool ``(Cin, Cout)``, True = kernel kept."""
  st = _find_state(opt_state)
  return {n: np.asarray(ls.kernel_keep) for n, ls in st.layers.items()}


def masks(opt_state: Any, params: PyTree) -> PyTree:
  """A pytree like ``params``: the weight mask ``P ⊙ K`` for pruned layers, None elsewhere.

  Accepted by ``jaxprune.flops`` (``masks=``) and ``compression_ratio``.
  """
  st = _find_state(opt_state)
  params = _pure(params)
  names = _leaf_names(params)
  by_index = {names[n]: _full_mask(ls) for n, ls in st.layers.items()}
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [by_index.get(i) for i in range(len(leaves))])


def pattern_usage(opt_state: Any) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """Per kernel size: (pattern ids, number of kept kernels using each), most used first."""
  st = _find_state(opt_state)
  per_size: dict[int, list[np.ndarray]] = {}
  for ls in st.layers.values():
    k = ls.pattern_mask.shape[0]
    if k < 2:
      continue
    pid = np.asarray(ls.pattern_id)[np.asarray(ls.kernel_keep)]
    per_size.setdefault(k, []).append(pid[pid >= 0])
  out = {}
  for k, arrs in per_size.items():
    ids, counts = np.unique(np.concatenate(arrs), return_counts=True)
    order = np.argsort(-counts, kind="stable")
    out[k] = (ids[order], counts[order])
  return out


def compression(opt_state: Any, params: PyTree) -> float:
  """Conv compression ratio (total / nonzero conv weights) with the current masks."""
  from jaxprune import flops

  params = _pure(params)
  return flops.compression_ratio(params, masks(opt_state, params))


def flops_saved(model: Any, opt_state: Any, input_shape: Sequence[int]) -> dict[str, float]:
  """Training and inference FLOPs saved by the masks (ClickTrain Table 1 columns).

  Returns fractions per step once hard-pruned: ``{"training": .., "inference": ..}``
  (1 - masked / dense FLOPs, conv and dense layers, multiply-add = 2).
  """
  from flax import nnx
  from jaxprune import flops

  weight_masks = masks(opt_state, nnx.state(model, nnx.Param))
  dense_t = flops.training_flops_per_step(model, input_shape)
  dense_i = flops.inference_flops(model, input_shape)
  sparse_t = flops.training_flops_per_step(model, input_shape, masks=weight_masks)
  sparse_i = flops.inference_flops(model, input_shape, masks=weight_masks)
  return {"training": 1.0 - sparse_t / dense_t, "inference": 1.0 - sparse_i / dense_i}
