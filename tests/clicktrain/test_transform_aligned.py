"""ClickTrain's aligned mode (``filter_groups``): each quantity lifted to (group, channel)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune.clicktrain import importance, patterns, readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain._groups import group_sum, lift
from jaxprune.clicktrain.execution.aligned_layout import build_aligned_layout

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


def _np_group_sum(x, groups, axis):
  """NumPy: sum over consecutive equal groups of the filter axis."""
  parts = np.split(np.asarray(x, np.float64), groups, axis=axis)
  return np.concatenate([p.sum(axis=axis, keepdims=True) for p in parts], axis=axis)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_lifted_importance_is_the_numpy_sum_over_the_group(groups):
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(3, 3, 5, 8)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(3, 3, 5, 8)), jnp.float32)
  pool = jnp.asarray(patterns.library_patterns())
  eq1 = np.asarray(importance.pattern_scores(w, g, pool))  # (Cin, Cout, P)
  eq2 = np.asarray(importance.kernel_scores(w, g))  # (Cin, Cout)
  np.testing.assert_allclose(
    group_sum(eq1, groups, axis=1), _np_group_sum(eq1, groups, 1), rtol=1e-6
  )
  np.testing.assert_allclose(group_sum(eq2, groups), _np_group_sum(eq2, groups, 1), rtol=1e-6)
  lifted = np.asarray(lift(eq2, groups))
  np.testing.assert_allclose(
    lifted, np.repeat(_np_group_sum(eq2, groups, 1), 8 // groups, 1), rtol=1e-6
  )
  np.testing.assert_array_equal(lift(eq2, 0), eq2)  # 0: the paper's per-kernel mode


def test_one_shot_aligned_matches_a_numpy_group_rule(kit):
  groups, ratio = 2, 0.35
  tx = kit.one_shot_tx(groups, kernel_prune_ratio=ratio)
  p = kit.params()
  st = tx.init(p)
  g = kit.fake_grads(p, 0)
  _, st = jax.jit(tx.update)(g, st, p)
  w1, g1 = np.asarray(p["block"]["conv1"]["kernel"]), np.asarray(g["block"]["conv1"]["kernel"])
  blocks, ids = patterns.one_shot_pool(4)
  t = (g1 * w1).astype(np.float64)  # (3, 3, 6, 8)
  cin, cout = t.shape[2:]
  size = cout // groups
  ls = st.layers[kit.CONV1]
  for k in range(groups):
    fs = slice(k * size, (k + 1) * size)
    scores = [
      ((t[:, :, :, fs] * np.asarray(b)[:, :, None, None]) ** 2).sum((0, 1, 3)) for b in blocks
    ]
    best = np.argmax(np.stack(scores, 1), axis=1)  # per channel; ties -> first
    ks = (t[:, :, :, fs] ** 2).sum((0, 1, 3))
    pruned = sorted(range(cin), key=lambda c: (ks[c], c))[: math.ceil(ratio * cin)]
    keep = np.ones(cin, bool)
    keep[pruned] = False
    np.testing.assert_array_equal(
      np.asarray(ls.pattern_id)[:, fs], ids[best][:, None].repeat(size, 1)
    )
    np.testing.assert_array_equal(np.asarray(ls.kernel_keep)[:, fs], keep[:, None].repeat(size, 1))
  mask = np.asarray(readouts.masks(st, p)["block"]["conv1"]["kernel"])
  layout = build_aligned_layout(mask, groups)  # shared within each group
  for group in layout.groups:
    assert len(group.channels) == cin - math.ceil(ratio * cin)
    assert all(len(taps) == 4 for taps, _ in group.blocks)


def test_filter_groups_equal_to_the_filters_is_the_balanced_paper_mode(kit):
  # One filter per group: every lifted quantity is the kernel's own, and each group pruning
  # ceil(ratio * Cin) channels is the per-filter load balance of balanced_kernels.
  _, aligned, u_aligned = kit.run(kit.paper_tx(filter_groups=8))
  _, balanced, u_balanced = kit.run(kit.paper_tx(balanced_kernels=True))
  aligned, balanced = aligned[-1], balanced[-1]
  assert int(aligned.stage) == ct_state.REGULARIZE
  for a, b in zip(jax.tree.leaves(aligned.layers), jax.tree.leaves(balanced.layers)):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(u_aligned), jax.tree.leaves(u_balanced)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_paper_mode_aligned_masks_and_lifted_group_lasso(kit):
  groups, lam, eps = 2, 0.01, 1e-8
  p, states, update = kit.run(kit.paper_tx(filter_groups=groups))
  st = states[-1]
  assert int(st.stage) == ct_state.REGULARIZE
  for name, ratio in ((kit.CONV1, 0.25), (kit.CONV2, 0.55)):
    ls = st.layers[name]
    cin = ls.kernel_keep.shape[0]
    mask = np.asarray(ls.pattern_mask * ls.kernel_keep)
    layout = build_aligned_layout(mask, groups)
    for group in layout.groups:
      assert len(group.channels) == cin - math.ceil(ratio * cin)
  # The emitted update (identity inner) is g + λ ∂(lifted group lasso): each norm is over a
  # (group, input channel) pair, all the group's filters together, weighted by sqrt(|g|).
  w = np.asarray(p["block"]["conv1"]["kernel"], np.float64)
  ls = st.layers[kit.CONV1]
  g = np.asarray(kit.fake_grads(p, 6)["block"]["conv1"]["kernel"], np.float64)
  want = g.copy()
  for m in (
    1 - np.asarray(ls.pattern_mask),
    (~np.asarray(ls.kernel_keep)).astype(float)[None, None],
  ):
    z = w * m
    norms = _np_group_sum((z * z).sum((0, 1), keepdims=True), groups, 3)
    size = w.shape[3] // groups
    want += lam * math.sqrt(size) * z / np.sqrt(np.repeat(norms, size, 3) + eps)
  np.testing.assert_allclose(update["block"]["conv1"]["kernel"], want, rtol=2e-5, atol=1e-7)
  # The read-out penalty is the lifted one: λ times its autodiff gradient is what was added.
  penalty_grad = jax.grad(lambda q: readouts.group_lasso_penalty(q, st, eps))(p)
  np.testing.assert_allclose(
    lam * np.asarray(penalty_grad["block"]["conv1"]["kernel"]), want - g, rtol=1e-4, atol=1e-7
  )


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_bad_filter_groups_raise_when_built(kit, bad):
  with pytest.raises(ValueError, match="filter_groups"):
    kit.one_shot_tx(bad)


def test_filter_groups_not_dividing_a_layer_raise_at_init(kit):
  with pytest.raises(ValueError, match="filter_groups \\(3\\) must divide the 8 filters.*conv1"):
    kit.one_shot_tx(3).init(kit.params())
