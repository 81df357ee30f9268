"""ClickTrain as one Optax transform wrapping the inner optimizer (ClickTrain §4).

:func:`clicktrain` runs ClickTrain's stage machine (:mod:`~jaxprune.clicktrain._stage_machine`
over the stages of :class:`~jaxprune.clicktrain.state.Stage`: dense warm-up, dynamic pattern
pool generation, adaptive pattern / kernel finalization, modified group lasso, hard prune)
inside ``jit`` around any inner optimizer; ``mode="one_shot"`` is the authors' released
rule instead. How the paper is read (triggers, margins, non-finite steps) is in
``docs/design.md``, section ClickTrain; the read-outs are in :mod:`jaxprune.clicktrain.readouts`.

Example::

    tx = jaxprune.clicktrain.clicktrain(
        optax.sgd(0.1, momentum=0.9), steps_per_epoch=len(loader),
        kernel_prune_ratio=0.5, pool_start_epoch=None, hard_prune_epoch=95)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    ...
    optimizer.update(model, grads, value=loss)
    weight_masks = jaxprune.clicktrain.masks(optimizer, params)   # after the hard prune

    # The same settings as one value, the paper mode's in their sub-config:
    cfg = jaxprune.clicktrain.Config(
        jaxprune.clicktrain.Schedule(steps_per_epoch=len(loader), hard_prune_epoch=95),
        kernel_prune_ratio=0.5, paper=jaxprune.clicktrain.PaperMode(pool_size=8))
    tx = jaxprune.clicktrain.clicktrain(optax.sgd(0.1, momentum=0.9), config=cfg)

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import dataclasses
import inspect
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxprune.clicktrain import _stage_machine, _stage_work
from jaxprune.clicktrain._plan import (
  ChosenLayers,
  check_filter_groups,
  check_layers,
  check_not_empty,
  init_layer,
  make_plan,
)
from jaxprune.clicktrain.config import (
  Config,
  default_layer_filter,
  name_chosen_projections,
  unsupported_kernels,
  uses_choose_layer,
)
from jaxprune.clicktrain.schedule import Schedule
from jaxprune.clicktrain.state import POOL, PRUNED, REGULARIZE, WARMUP, ClickTrainState
from jaxprune.train.optim import epoch_length_state

__all__ = ["clicktrain"]

# The keywords of clicktrain() that are the schedule's fields.
_SCHEDULE_KEYS = tuple(f.name for f in dataclasses.fields(Schedule))


def _warn_layer_choice(cfg: Config, params: Any) -> None:
  """Says once what the library's layer rule decided without being asked (ClickTrain §4.1)."""
  if not uses_choose_layer(cfg.layer_filter):
    return  # the user's own layer_filter decides
  skipped = unsupported_kernels(params)
  if skipped:
    warnings.warn(
      f"clicktrain leaves {', '.join(skipped)} dense: its patterns are 4 of a 3x3 kernel's 9 "
      "weights (ClickTrain §4.1) and the paper prunes no other kernel size; pass a "
      "layer_filter returning 'kernel' (connectivity pruning) or 'pattern' to prune them",
      UserWarning,
      stacklevel=3,
    )
  by_name = name_chosen_projections(params) if cfg.layer_filter is default_layer_filter else []
  if by_name:
    warnings.warn(
      f"clicktrain prunes the 1x1 convs {', '.join(by_name)} (connectivity): their names "
      "suggest a skip path, but the transform sees parameters only and leaves dense just the "
      "ones named 'shortcut' / 'downsample'. If one is a projection shortcut (left dense in the "
      "paper's code), pass "
      "layer_filter=clicktrain.layer_filter_for(model, input_shape), which decides by structure",
      UserWarning,
      stacklevel=3,
    )


def _passes_updates_through(inner: optax.GradientTransformationExtraArgs, state, params) -> bool:
  """Whether ``inner.update`` returns the very updates it is given (``optax.identity()``).

  Traced abstractly (``jax.eval_shape``: nothing is computed), with the params as the probe
  updates: an identity returns its input leaves themselves. An inner whose update cannot run
  on such a probe (it needs an extra argument, or any other failure of the probe's own) is
  taken as not passing through: the probe only names a mistake, it never stops ``init``.
  """
  same = []

  def probe(updates):
    out, _ = inner.update(updates, state, params)
    leaves_in, leaves_out = jax.tree.leaves(updates), jax.tree.leaves(out)
    same.append(len(leaves_in) == len(leaves_out) and all(map(operator.is_, leaves_in, leaves_out)))
    return out

  try:
    jax.eval_shape(probe, params)
  except Exception:  # noqa: BLE001 - see the docstring: no probe, no warning
    return False
  return bool(same and same[0])


def _warn_pass_through_inner() -> None:
  """ClickTrain §4.4's hard prune emits updates that zero the pruned weights exactly, and the
  masked gradients after it keep them zero, only when nothing transforms them afterwards."""
  warnings.warn(
    "clicktrain's inner transform returns its updates unchanged (optax.identity()): placed "
    "first in a chain, optax.chain(clicktrain(optax.identity()), optax.adamw(...)), the next "
    "transform rescales the hard prune's updates and the pruned weights come back. Wrap the "
    "optimizer instead, clicktrain(optax.adamw(...), ...), so the masks act on the final "
    "update (an identity inner is right only to read the masked gradients themselves)",
    UserWarning,
    stacklevel=3,
  )


def clicktrain(
  inner: optax.GradientTransformation,
  *,
  steps_per_epoch: int | None = None,
  hard_prune_epoch: int | None = None,
  mode: str | None = None,
  kernel_prune_ratio: float
  | Sequence[float]
  | Mapping[str, float]
  | Callable[[str, tuple[int, ...]], float] = 0.5,
  pool_start_epoch: int | None = None,
  loss_derivative_threshold: float | None = None,
  pool_epochs: int | None = None,
  finalize_epochs: int | None = None,
  pool_size: int = 12,
  loss_margin: float = 0.0018,
  margin_rule: str = "relative",
  group_lasso_coefficient: float = 2.5e-4,
  group_lasso_ramp: str = "constant",
  one_shot_epoch: int | None = None,
  one_shot_patterns: int = 4,
  layer_filter: Callable[[str, tuple[int, ...]], str | None] | None = None,
  importance_every: int = 1,
  balanced_kernels: bool = False,
  filter_groups: int | None = None,
  filter_grouping: str = "consecutive",
  eps: float = 1e-8,
  total_epochs: int | None = None,
  prune_window_epochs: int | None = None,
  schedule: Schedule | None = None,
  config: Config | None = None,
) -> optax.GradientTransformationExtraArgs:
  """ClickTrain pattern + connectivity pruning around an inner optimizer.

  Args:
      inner: the optimizer (e.g. ``optax.sgd(0.1, momentum=0.9)`` chained with
          weight decay); receives the regularized / masked gradient.
      steps_per_epoch: optimizer steps per epoch (converts the epoch settings). This and
          every epoch setting below (``hard_prune_epoch``, ``mode``, ``pool_start_epoch``,
          ``loss_derivative_threshold``, ``pool_epochs``, ``finalize_epochs``,
          ``one_shot_epoch``, ``total_epochs``, ``prune_window_epochs``) are the fields of one
          :class:`~jaxprune.clicktrain.Schedule`; give them here or as ``schedule``.
      hard_prune_epoch: epochs trained before the hard prune (paper Table 1: 90-98 of
          190): the last step of epoch ``hard_prune_epoch`` zeroes the pruned weights and
          enters the pruned stage, and every later epoch trains pruned. Like every epoch
          setting here it counts completed epochs, which is the 1-based epoch number of the
          trainer's records: the record with ``epoch == hard_prune_epoch`` is the epoch that
          ends with the prune (the preset's hook marks it ``ct_hard_prune``).
      mode: ``"paper"`` (DPPG + adaptive finalization, the default) or ``"one_shot"``
          (the authors' released code).
      kernel_prune_ratio: fraction of kernels removed per layer: one float, a sequence (one
          per pruned layer, in param flatten order), a mapping ``{layer path: ratio}`` or
          ``fn(path, shape) -> float``. A sequence fits the model it was written for; a model
          that loses layers (PruneTrain's reconfiguration) needs the ratios by path
          (:func:`~jaxprune.clicktrain.ratios_by_name` turns one into the other), since
          ``init`` is a pure function of the params it is given.
      pool_start_epoch: paper mode: epochs of warm-up before DPPG (it runs from epoch
          ``pool_start_epoch + 1`` of the records; 0: from the first step); ``None`` uses
          the loss-derivative trigger (§4.1, a ``RuntimeWarning`` if it has not fired by
          ``hard_prune_epoch``). A trigger that fires less than ``pool_epochs +
          finalize_epochs + 1`` epochs before ``hard_prune_epoch`` does not cut the stages
          short: the hard prune moves later, to the end of the first regularized epoch
          (``RuntimeWarning`` when the trigger fires, naming that epoch). When set,
          ``hard_prune_epoch`` must be larger than ``pool_start_epoch + pool_epochs +
          finalize_epochs``.
      loss_derivative_threshold: the trigger's threshold (default 0.27, the paper's).
      pool_epochs: epochs of DPPG (stage 2; default 5).
      finalize_epochs: epochs of adaptive finalization (stage 3; default 5).
      pool_size: N, patterns in the final pool (8 or 12).
      loss_margin: δ of §4.3.
      margin_rule: ``"relative"`` or ``"literal"`` (see
          :func:`jaxprune.clicktrain.patterns.loss_margin_ok`).
      group_lasso_coefficient: λ of the modified group lasso (2.5e-4 in the paper).
      group_lasso_ramp: beyond the paper, how λ grows over the regularize stage:
          ``"constant"`` (default, the paper: λ from its first step), ``"linear"`` or
          ``"cubic"`` (``λ · (1 − (1 − t)³)``, ``t`` the share of the stage done, from its
          start to ``hard_prune_epoch``: a gentle pull first, the full one before the prune;
          after Zhu & Gupta's cubic sparsity ramp and growing regularization, Wang et al.
          ICLR'21).
      one_shot_epoch: one_shot mode: epochs trained before the masks are picked, by the
          first batch of epoch ``one_shot_epoch + 1`` of the records (the next finite batch
          if that one's loss or gradient is not finite).
      one_shot_patterns: one_shot mode: size of the fixed pool each kernel picks its
          pattern from, 4, 8 or 12 (:func:`jaxprune.clicktrain.patterns.one_shot_pool`: the
          head of the released library; 4, the centre 2x2 blocks, is the released default,
          their VGG-16 config uses 12).
      layer_filter: ``fn(path, shape) -> "pattern" | "kernel" | None``;
          default :func:`~jaxprune.clicktrain.config.default_layer_filter`.
      importance_every: run the per-batch importance work every this many
          steps (1 = every batch, as in the paper); paper mode: at most the steps of
          the shorter of the pool and finalization stages.
      balanced_kernels: prune ``ceil(ratio * Cin)`` kernels in every filter instead of
          ranking the whole layer, so every filter keeps the same number of weights: the
          load-balance constraint of the paper's sparse kernels (§5.2); off by default, as
          in the released code.
      filter_groups: beyond the paper, the *aligned* mode: the filters of every pruned
          layer form this many groups of consecutive output channels (it must divide them;
          1 = all filters one group), and within a group each input channel is pruned or
          keeps one pattern shared by the group's filters. Every per-kernel quantity (Eq. 1,
          Eq. 2, DPPG importance, votes, group-lasso norms) is summed over the group, and each
          group prunes ``ceil(ratio * Cin)`` channels. The pruned layers then run as dense
          matrix products (:class:`~jaxprune.clicktrain.execution.AlignedConv`). With
          PruneTrain's reconfiguration, give it ``channel_multiple=filter_groups`` so the
          widths stay divisible.
          ``None`` (default): the paper's per-kernel patterns.
      filter_grouping: aligned mode: how the ``filter_groups`` groups are formed.
          ``"consecutive"`` (default): runs of consecutive filters, fixed from the start.
          ``"clustered"``: a balanced partition into groups of ``Cout / filter_groups``
          filters whose Eq. 2 kernel scores and pattern preferences agree, chosen once per
          layer when the patterns are finalized (paper mode: at the end of the finalization
          stage, from the per-kernel Eq. 2 sums and votes, which are kept per kernel until
          then; one_shot: from the picking batch's per-kernel scores), then used by every
          lifting (:func:`jaxprune.clicktrain.filter_partition` reads it; see
          ``docs/design.md``, aligned mode). The layer's outputs keep their order: the
          aligned layers permute them back.
      eps: ε inside the group-lasso square roots.
      total_epochs: the planned length of the run in epochs (the ClickTrain preset passes
          ``methods.Run.epochs``), only to check the schedule: a ``RuntimeWarning`` when the
          transform is built if the hard prune cannot come inside it (e.g.
          ``hard_prune_epoch=3`` in a 4-epoch run with the default 5 + 5 pool and
          finalization epochs after the trigger). ``None``: not checked.
      prune_window_epochs: beyond the paper, a soft hard prune: over the last this many
          epochs before ``hard_prune_epoch`` the weights the masks drop decay linearly to zero
          (each step multiplies them by the share left, :meth:`Schedule.kept_fraction
          <jaxprune.clicktrain.Schedule.kept_fraction>`; a decaying mask, Kao et al. 2022)
          instead of all at once at the prune; in the one-shot mode the masks are picked again
          at each epoch end in the window (from that step's batch, as at ``one_shot_epoch``),
          so a kernel or pattern may still change, and a weight the new masks keep stops
          decaying. The masks then freeze at the prune as without a window. 0 (default): the
          paper's one-step prune. Must fit inside regularization.
      schedule: the epoch settings as one :class:`~jaxprune.clicktrain.Schedule` (what the
          presets build, :meth:`~jaxprune.clicktrain.Schedule.for_run`), instead of the
          keywords; the state keeps it (:func:`jaxprune.clicktrain.schedule_of`).
      config: every setting above as one :class:`~jaxprune.clicktrain.Config` (its
          ``schedule``, the sub-configs :class:`~jaxprune.clicktrain.PaperMode`,
          :class:`~jaxprune.clicktrain.OneShot` and :class:`~jaxprune.clicktrain.Aligned`, and
          the rest), instead of the keywords: ``clicktrain(inner, config=cfg)``. There
          ``pool_size``, ``loss_margin`` and ``margin_rule`` are the ``PaperMode``'s fields,
          ``one_shot_patterns`` the ``OneShot``'s ``patterns``, ``filter_groups`` and
          ``filter_grouping`` the ``Aligned``'s ``filter_groups`` and ``grouping`` (``None``:
          no ``filter_groups``), the epoch settings the ``Schedule``'s.

  Returns:
      An ``optax.GradientTransformationExtraArgs``; its ``update`` needs
      ``params`` and (paper mode) ``value=loss``.

  Raises:
      ValueError: a bad argument (named in the message), or ``config`` together with a
          keyword set away from its default (or ``schedule``); from ``init``, params with no
          layer to prune (a model without convs, or whose convs ``layer_filter`` all leaves
          dense: the message lists the 4-D kernels found); from ``update``, params whose pruned
          layers (paths or shapes) are not those ``init`` saw (the first one named).
  """
  options = dict(locals())  # every keyword but inner, by name: a new option is a Config field
  inner = optax.with_extra_args_support(options.pop("inner"))
  cfg = _config(options)
  _stage_machine.warn_unreachable(cfg)
  # A layer chosen once stays chosen when a reconfiguration narrows it (see ChosenLayers).
  memory = ChosenLayers()
  warned = []  # the layer-choice notes are said once per transform, not at every init

  def init_fn(params):
    first = not warned
    if first:
      warned.append(True)
      _warn_layer_choice(cfg, params)
    plan = make_plan(cfg, params, memory)
    check_not_empty(plan, params)
    check_filter_groups(plan, params)
    inner_state = inner.init(params)
    if first and _passes_updates_through(inner, inner_state, params):
      _warn_pass_through_inner()
    leaves = jax.tree.leaves(params)
    start = POOL if (cfg.mode == "paper" and cfg.schedule.pool_start_epoch == 0) else WARMUP
    return ClickTrainState(
      count=jnp.zeros([], jnp.int32),
      stage=jnp.asarray(start, jnp.int32),
      stage_start_epoch=jnp.zeros([], jnp.int32),
      epoch_loss_sum=jnp.zeros([], jnp.float32),
      prev_epoch_loss=jnp.full([], jnp.nan, jnp.float32),
      last_loss=jnp.full([], jnp.nan, jnp.float32),
      layers={
        n: init_layer(leaves[layer.index], layer, cfg.paper.pool_size, cfg.mode)
        for n, layer in plan.items()
      },
      inner_state=inner_state,
      epoch_length=epoch_length_state(cfg.schedule.steps_per_epoch),
      schedule=cfg.schedule,
    )

  def update_fn(updates, state, params=None, *, value=None, **extra_args):
    if params is None:
      raise ValueError("clicktrain needs params: update(grads, state, params, value=loss)")
    if value is None and cfg.mode == "paper":
      raise ValueError("clicktrain(mode='paper') needs the loss: update(..., value=loss)")
    plan = make_plan(cfg, params, memory)
    loss = jnp.asarray(0.0 if value is None else value, jnp.float32)
    w_leaves = jax.tree.leaves(params)
    check_layers(plan, state.layers, params)
    g_leaves, g_def = jax.tree.flatten(updates)
    clock = _stage_machine.step_clock(cfg, state, loss)
    if state.pruned_step is not None:
      # Specialised to the pruned stage (specialize_pruned): the same arithmetic as the general
      # step's PRUNED branches, with no stage switch, so the per-layer state (votes, scores,
      # masks) is neither copied nor selected: it passes through as it came in.
      return _pruned_update(
        plan, state, clock, w_leaves, g_leaves, g_def, params, value, extra_args
      )
    if cfg.mode == "paper":
      layers, moved = _stage_machine.paper_step(cfg, plan, state, clock, w_leaves, g_leaves)
      stage = state.stage
    else:
      layers, stage = _stage_machine.one_shot_step(cfg, plan, state, clock, w_leaves, g_leaves)
      moved = jnp.bool_(False)

    coefficient = cfg.group_lasso_coefficient * _stage_machine.penalty_ramp(cfg, state, clock)
    g_leaves = _stage_work.modify_grads(
      g_leaves, layers, plan, w_leaves, stage, coefficient, cfg.eps
    )
    grads = jax.tree.unflatten(g_def, g_leaves)
    new_updates, inner_state = inner.update(
      grads, state.inner_state, params, value=value, **extra_args
    )
    u_leaves, u_def = jax.tree.flatten(new_updates)
    new_state = _stage_machine.next_state(cfg, state, clock, stage, moved, layers, inner_state)
    # The soft prune's window: the dropped weights shrink to the share the schedule leaves.
    if cfg.schedule.prune_window_epochs:
      ratio = _stage_machine.window_ratio(cfg, state, clock)
      decaying = (stage == REGULARIZE) & (ratio < 1)
      u_leaves = _stage_work.decay_pruned(u_leaves, layers, plan, w_leaves, ratio, decaying)
    # The step that enters PRUNED already emits the hard mask: a state (and every read-out
    # of it) that says "pruned" always comes with weights that are zero where the masks prune.
    u_leaves = _stage_work.hard_mask(u_leaves, layers, plan, w_leaves, new_state.stage == PRUNED)
    return jax.tree.unflatten(u_def, u_leaves), new_state

  def _pruned_update(plan, state, clock, w_leaves, g_leaves, g_def, params, value, extra_args):
    """The update of a state marked :class:`~jaxprune.clicktrain.PrunedStep`: mask the
    gradient, run the inner optimizer, emit the hard mask (ClickTrain §4.4, after the prune)."""
    layers = state.layers
    g_leaves = _stage_work.modify_grads(g_leaves, layers, plan, w_leaves, PRUNED, 0.0, cfg.eps)
    new_updates, inner_state = inner.update(
      jax.tree.unflatten(g_def, g_leaves), state.inner_state, params, value=value, **extra_args
    )
    u_leaves, u_def = jax.tree.flatten(new_updates)
    new_state = _stage_machine.next_state(
      cfg, state, clock, state.stage, jnp.bool_(False), layers, inner_state
    )
    u_leaves = _stage_work.hard_mask(u_leaves, layers, plan, w_leaves, True)
    return jax.tree.unflatten(u_def, u_leaves), new_state

  # Jitted: called eagerly (nnx.Optimizer.update outside jit) the stage machine's lax.cond /
  # lax.switch would trace new branches with that step's arrays as constants at every step, and
  # JAX's eager dispatch would compile and cache one executable per branch (memory grew by about
  # 12 MB a step). Inside a jitted train step this inner jit is inlined.
  return optax.GradientTransformationExtraArgs(init_fn, jax.jit(update_fn))


def _config(options: dict[str, Any]) -> Config:
  """The :class:`Config` of ``clicktrain()``'s keywords (``options``, by name): the one given as
  ``config``, or one built from the others.

  Raises:
    ValueError: ``config`` and a keyword set away from its default (``schedule`` included);
      ``config`` not a :class:`Config`; a bad keyword (see :func:`_schedule`,
      :meth:`Config.from_keywords`).
  """
  given = options.pop("config")
  if given is None:
    return Config.from_keywords(_schedule(options), **options)
  defaults = {k: p.default for k, p in inspect.signature(clicktrain).parameters.items()}
  mixed = sorted(k for k, v in options.items() if _differs(v, defaults[k]))
  if mixed:
    raise ValueError(
      f"clicktrain: give the settings either as config= or as keywords, not both "
      f"(got config and {mixed})"
    )
  if not isinstance(given, Config):
    raise ValueError(f"config must be a clicktrain.Config, got {given!r}")
  return given


def _differs(value: Any, default: Any) -> bool:
  """``value`` is not the keyword's default (an array or other type always differs)."""
  if value is default:
    return False
  return type(value) is not type(default) or bool(value != default)


def _schedule(options: dict[str, Any]) -> Schedule:
  """The :class:`Schedule` of ``clicktrain()``'s keywords, popped from ``options``: the one
  given as ``schedule``, or one built from the epoch keywords that are not ``None``.

  Raises:
    ValueError: both, or neither ``schedule`` nor ``steps_per_epoch`` and
      ``hard_prune_epoch``.
  """
  given = options.pop("schedule")
  epoch_settings = {k: options.pop(k) for k in _SCHEDULE_KEYS}
  epoch_settings = {k: v for k, v in epoch_settings.items() if v is not None}
  if given is not None:
    if epoch_settings:
      raise ValueError(
        f"clicktrain: give the epoch settings either as schedule= or as keywords, not both "
        f"(got schedule and {sorted(epoch_settings)})"
      )
    return given
  missing = [k for k in ("steps_per_epoch", "hard_prune_epoch") if k not in epoch_settings]
  if missing:
    raise ValueError(f"clicktrain needs {' and '.join(missing)} (or schedule=)")
  return Schedule(**epoch_settings)
