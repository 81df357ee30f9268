"""The ClickTrain transform's modified group lasso (§4.4) and gradient masking once pruned."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune.clicktrain import readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct
from jaxprune.clicktrain._stage_work import group_lasso_grad

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


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


def test_group_lasso_penalty_and_gradient_match_a_plain_loop(kit):
  # The penalty and the gradient the transform adds while regularizing, against the NumPy
  # loop (not against autodiff of the same formula); the hand-derived gradient is itself
  # checked by central differences of the loop's value.
  update, p, states = kit.paper_run()
  st = states[-1]
  assert int(st.stage) == ct_state.REGULARIZE
  eps = 1e-8
  named = {kit.CONV1: p["block"]["conv1"]["kernel"], kit.CONV2: p["block"]["conv2"]["kernel"]}
  total, grads = 0.0, {}
  for name, w in named.items():
    ls = st.layers[name]
    assert (~np.asarray(ls.kernel_keep)).any()  # both terms are live
    value, grads[name] = _np_group_lasso(w, ls.pattern_mask, ls.kernel_keep, eps)
    total += value
  np.testing.assert_allclose(float(readouts.group_lasso_penalty(p, st, eps)), total, rtol=1e-5)
  # Central differences on a few entries of conv1: pruned-kernel, off-pattern and kept.
  w = np.asarray(named[kit.CONV1], np.float64)
  ls = st.layers[kit.CONV1]
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
    np.testing.assert_allclose(grads[kit.CONV1][idx], fd, rtol=1e-6, atol=1e-8)
  assert grads[kit.CONV1][on + kept_kernel] == 0.0  # a kept weight of a kept kernel: no pull
  # The transform adds λ × the loop's gradient (identity inner optimizer), and the private
  # helper computes it.
  g = kit.fake_grads(p, 99)
  u, _ = update(g, st, p, value=jnp.float32(0.9))
  for name, path in ((kit.CONV1, ("block", "conv1")), (kit.CONV2, ("block", "conv2"))):
    added = np.asarray(u[path[0]][path[1]]["kernel"]) - np.asarray(g[path[0]][path[1]]["kernel"])
    np.testing.assert_allclose(added, kit.LAMBDA * grads[name], rtol=1e-4, atol=1e-7)
    direct = group_lasso_grad(named[name], st.layers[name], eps)
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
