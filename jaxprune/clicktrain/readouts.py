"""Read-outs of a ClickTrain run: masks, stage, pattern usage, compression, FLOPs saved.

Compression is that of the weights as they are (:func:`compression`) or that the masks plan
(:func:`planned_compression`); :func:`removed_norm_fraction` is the share of the weight norm
the hard prune removes.

Every function takes the optimizer state as the training loop holds it and finds the one
:class:`~jaxprune.clicktrain.state.ClickTrainState` inside: the state itself, an
``optax.chain`` tuple, another wrapper's state (e.g. ``jaxprune.prunetrain.with_group_lasso``'s
``PruneTrainState.inner``), an ``nnx.Optimizer`` or its ``opt_state`` (NNX Variables). None or
two ClickTrain states is a ``ValueError``. All run on the host.

Example:
  >>> from jaxprune import clicktrain
  >>> weight_masks = clicktrain.masks(optimizer, params)  # doctest: +SKIP
  >>> clicktrain.stage_name(optimizer.opt_state)  # doctest: +SKIP
  'pruned'

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxprune import masking
from jaxprune._states import as_pure, find_states, named_leaves
from jaxprune.clicktrain.state import PRUNED, STAGE_NAMES, ClickTrainState, full_mask
from jaxprune.paths import path_string

__all__ = [
  "compression",
  "filter_partition",
  "find_state",
  "flops_saved",
  "group_lasso_penalty",
  "kernel_masks",
  "masks",
  "pattern_ids",
  "pattern_usage",
  "planned_compression",
  "removed_norm_fraction",
  "stage_name",
]

PyTree = Any


def find_state(opt_state: Any) -> ClickTrainState:
  """The one :class:`ClickTrainState` inside ``opt_state`` (see the module docstring).

  Raises:
    ValueError: ``opt_state`` holds no ClickTrain state, or more than one.
  """
  found = find_states(opt_state, ClickTrainState)
  if not found:
    raise ValueError(
      f"opt_state: no ClickTrainState found in {type(opt_state).__name__} "
      "(was the optimizer built with jaxprune.clicktrain.clicktrain?)"
    )
  if len(found) > 1:
    raise ValueError(
      f"opt_state: {len(found)} ClickTrainStates found; the read-outs need exactly one "
      "(pass the sub-state of the ClickTrain transform you mean)"
    )
  return found[0]


def stage_name(opt_state: Any) -> str:
  """Name of the current stage.

  One of ``"warmup"``, ``"pool"``, ``"finalize"``, ``"regularize"`` or ``"pruned"``.
  """
  return STAGE_NAMES[int(find_state(opt_state).stage)]


def pattern_ids(opt_state: Any) -> dict[str, np.ndarray]:
  """Per pattern layer: ``(Cin, Cout)`` ids into ``all_patterns(4, k)`` (-1 = not final)."""
  st = find_state(opt_state)
  return {
    n: np.asarray(ls.pattern_id)
    for n, ls in st.layers.items()
    if ls.pattern_id.size and ls.pattern_mask.shape[0] > 1
  }


def kernel_masks(opt_state: Any) -> dict[str, np.ndarray]:
  """Per pruned layer: bool ``(Cin, Cout)``, True = kernel kept."""
  st = find_state(opt_state)
  return {n: np.asarray(ls.kernel_keep) for n, ls in st.layers.items()}


def _state_masks(st: ClickTrainState, params: PyTree) -> PyTree:
  params = as_pure(params)
  leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  return jax.tree.unflatten(
    treedef,
    [
      full_mask(st.layers[name]) if (name := path_string(p)) in st.layers else None
      for p, _ in leaves_with_paths
    ],
  )


def masks(opt_state: Any, params: PyTree) -> PyTree:
  """A pytree like ``params``: the weight mask ``P ⊙ K`` for pruned layers, None elsewhere.

  Accepted by ``jaxprune.flops`` (``masks=``), ``compression_ratio`` and
  :func:`jaxprune.masking.mask`.
  """
  return _state_masks(find_state(opt_state), params)


def _pruned_masks(st: ClickTrainState, params: PyTree) -> PyTree | None:
  """The masks the weights obey: only once hard-pruned (before, pruned weights are live)."""
  return _state_masks(st, params) if int(st.stage) == PRUNED else None


masking.register_mask_source(ClickTrainState, _pruned_masks)


def filter_partition(opt_state: Any) -> dict[str, tuple[tuple[int, ...], ...]]:
  """Per pruned layer: its filters grouped as the state's ``filter_group`` ids say.

  In the aligned mode these are the groups whose filters share one pattern per input channel:
  consecutive runs, or (``filter_grouping="clustered"``) the partition chosen when the patterns
  were finalized; after a PruneTrain reconfiguration, the groups of the kept filters (maybe
  uneven). In the paper mode every filter is its own group. The form is the one
  :func:`~jaxprune.clicktrain.execution.aligned_layout.group_filters` accepts: pass the result to
  :func:`~jaxprune.clicktrain.to_sparse_layers` (``filter_groups=``) or use
  ``SparseExecution(filter_groups="from_state")``.

  Args:
    opt_state: the optimizer state holding one ClickTrain state (see the module docstring).

  Returns:
    ``{kernel path: groups}``, each group the increasing filter indices of one non-empty group,
    groups in order of their lowest filter.
  """
  st = find_state(opt_state)
  out = {}
  for name, ls in st.layers.items():
    ids = np.asarray(ls.filter_group)
    groups = [tuple(int(f) for f in np.flatnonzero(ids == k)) for k in np.unique(ids)]
    out[name] = tuple(sorted(groups))
  return out


def pattern_usage(opt_state: Any) -> dict[int, tuple[np.ndarray, np.ndarray]]:
  """Per kernel size: (pattern ids, number of kept kernels using each), most used first."""
  st = find_state(opt_state)
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
  """Conv compression ratio of the weights as they are: total / nonzero conv weights.

  Until the hard prune zeroes the pruned weights every weight is still there, so a run that
  has not pruned (or ends unpruned) reports about 1.0 whatever its masks plan; what the masks
  will leave is :func:`planned_compression`.

  Args:
    opt_state: the optimizer state holding one ClickTrain state (see the module docstring).
    params: the parameters (a pytree, an NNX ``State`` or a tree of Variables).

  Returns:
    ``total / nonzero`` over the conv kernels (:func:`jaxprune.flops.compression_ratio`).

  Raises:
    ValueError: no or several ClickTrain states.
  """
  from jaxprune import flops

  find_state(opt_state)  # a read-out of a ClickTrain run
  return flops.compression_ratio(as_pure(params))


def planned_compression(opt_state: Any, params: PyTree) -> float:
  """Conv compression ratio that the current masks plan: total / conv weights they keep.

  What the hard prune leaves (:func:`compression` once the run is pruned); before the masks
  are final they keep everything and this is 1.0.

  Args:
    opt_state: the optimizer state holding one ClickTrain state (see the module docstring).
    params: the parameters (a pytree, an NNX ``State`` or a tree of Variables).

  Returns:
    ``total / nonzero`` of ``params * masks`` over the conv kernels.

  Raises:
    ValueError: no or several ClickTrain states.
  """
  from jaxprune import flops

  params = as_pure(params)
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


def removed_norm_fraction(opt_state: Any, params: PyTree) -> tuple[float, dict[str, float]]:
  """The share of the pruned layers' squared weight norm that the current masks remove.

  Whether the modified group lasso (ClickTrain §4.4) did its job before the hard prune: it
  pushes the weights outside the chosen patterns and of the pruned kernels toward zero, so
  that zeroing them costs little. Computed in float64 on the host.

  Args:
    opt_state: the optimizer state holding one ClickTrain state (see the module docstring).
    params: the parameters (a pytree, an NNX ``State`` or a tree of Variables).

  Returns:
    ``(total, by_layer)``: ``Σ‖W⊙(1−M)‖² / Σ‖W‖²`` over every layer ClickTrain prunes, and the
    same ratio per layer, keyed by kernel path (``M = P ⊙ K``, :func:`masks`). 0 where the
    norm is 0, before the masks are final (all ones) and after the hard prune (the weights
    are zero there).

  Raises:
    ValueError: no or several ClickTrain states; ``params`` without a pruned layer.

  Example:
    >>> total, by_layer = clicktrain.removed_norm_fraction(trainer.opt_state, trainer.params)  # doctest: +SKIP
    >>> round(total, 3)  # doctest: +SKIP
    0.021
  """
  st = find_state(opt_state)
  named = named_leaves(params)
  missing = [n for n in st.layers if n not in named]
  if missing:
    raise ValueError(f"params: no {missing[0]!r}, a layer the ClickTrain state prunes")
  removed_sum = norm_sum = 0.0
  by_layer = {}
  for name, ls in st.layers.items():
    w = np.asarray(named[name]).astype(np.float64)
    sq = w * w
    removed = float(np.sum(np.where(np.asarray(full_mask(ls)) != 0, 0.0, sq)))
    norm = float(np.sum(sq))
    by_layer[name] = removed / norm if norm > 0 else 0.0
    removed_sum, norm_sum = removed_sum + removed, norm_sum + norm
  return (removed_sum / norm_sum if norm_sum > 0 else 0.0), by_layer


def group_lasso_penalty(params: PyTree, opt_state: Any, eps: float = 1e-8) -> jax.Array:
  """The modified group lasso term (without λ) for the current masks (ClickTrain §4.4).

  ``Σ_kernels [sqrt(‖W⊙¬P‖² + ε) + sqrt(‖W⊙¬K‖² + ε)]``. Differentiable in ``params``; its gradient
  times λ is what the transform adds while regularizing.

  In the aligned mode a "kernel" is a (filter group, input channel) pair of the state's
  partition: ``Σ_{g,c} sqrt(|g|) [sqrt(Σ_{f∈g} ‖W_f⊙¬P‖² + ε) + sqrt(Σ_{f∈g} ‖W_f⊙¬K‖² + ε)]``
  (the paper mode's partition is one filter per group, which gives the formula above).
  """
  st = find_state(opt_state)
  named = {path_string(p): w for p, w in jax.tree_util.tree_flatten_with_path(as_pure(params))[0]}
  total = jnp.float32(0)
  for name, ls in st.layers.items():
    w = named[name]
    z = w * (1 - ls.pattern_mask)
    u = w * (~ls.kernel_keep).astype(w.dtype)
    for v in (z, u):
      total += _grouped_norms(jnp.sum(v * v, axis=(0, 1)), ls.filter_group, eps)
  return total


def _grouped_norms(sq: jax.Array, ids: jax.Array, eps: float) -> jax.Array:
  """``Σ_{g,c} sqrt(|g|) sqrt(Σ_{f∈g} sq[c, f] + ε)`` over the non-empty groups of ``ids``
  (``sq``: ``(Cin, Cout)`` squared kernel norms; ``ids``: ``(Cout,)`` group of each filter)."""
  cout = sq.shape[-1]
  sums = jax.ops.segment_sum(sq.T, ids, num_segments=cout)  # (groups <= Cout, Cin)
  size = jax.ops.segment_sum(jnp.ones((cout,), sq.dtype), ids, num_segments=cout)
  terms = jnp.sqrt(size)[:, None] * jnp.sqrt(sums + eps)
  return jnp.sum(jnp.where(size[:, None] > 0, terms, 0.0))
