"""jaxprune.train's losses, LR schedules and SGD against NumPy and PyTorch-style loops."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxprune.train as jt


# ----------------------------------------------------------------------------- loss


def _np_smoothed_ce(logits, targets, eps):
  logits = np.asarray(logits, np.float64)
  c = logits.shape[-1]
  t = targets * (1 - eps) + eps / c
  z = logits - logits.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -(t * logp).sum(-1)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_cross_entropy_int_labels_matches_numpy(eps):
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(7, 5)).astype(np.float32) * 3
  labels = rng.integers(0, 5, 7)
  want = _np_smoothed_ce(logits, np.eye(5)[labels], eps)
  got = jt.cross_entropy_per_example(jnp.asarray(logits), jnp.asarray(labels), eps)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(jt.cross_entropy(logits, labels, eps), want.mean(), rtol=1e-5)


def test_cross_entropy_soft_labels_matches_numpy():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(6, 4)).astype(np.float32)
  soft = rng.dirichlet(np.ones(4), size=6).astype(np.float32)  # mixup-like targets
  want = _np_smoothed_ce(logits, soft, 0.1)
  got = jt.cross_entropy_per_example(jnp.asarray(logits), jnp.asarray(soft), 0.1)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # accuracy on soft labels compares with the argmax class
  acc = jt.accuracy(jnp.asarray(logits), jnp.asarray(soft))
  assert float(acc) == pytest.approx(np.mean(logits.argmax(-1) == soft.argmax(-1)))


def test_cross_entropy_bad_inputs():
  with pytest.raises(ValueError, match="label_smoothing"):
    jt.cross_entropy(jnp.zeros((2, 3)), jnp.zeros(2, jnp.int32), 1.0)
  with pytest.raises(ValueError, match="labels"):
    jt.cross_entropy(jnp.zeros((2, 3)), jnp.zeros((2, 4)))
  with pytest.raises(ValueError, match="logits"):
    jt.cross_entropy(jnp.zeros((2, 3, 1)), jnp.zeros(2, jnp.int32))


# ----------------------------------------------------------------------------- schedules


def test_step_schedule_hand_computed():
  sched = jt.step_schedule(0.1, steps_per_epoch=5, milestones=[2, 4], factor=0.1)
  got = [float(sched(s)) for s in (0, 9, 10, 19, 20, 100)]
  np.testing.assert_allclose(got, [0.1, 0.1, 0.01, 0.01, 0.001, 0.001], rtol=1e-6)
  # float steps (dynamic batch) still cross the milestone at the same epoch boundary
  assert float(sched(9.5)) == pytest.approx(0.1)
  assert float(sched(10.0)) == pytest.approx(0.01)


def test_triangular_schedule_hand_computed():
  sched = jt.triangular_schedule(0.5, steps_per_epoch=4, peak_epoch=2, total_epochs=6)
  # up: 0 -> 0.5 over 8 steps; down: 0.5 -> 0 over 16 steps
  steps = [0, 2, 8, 12, 24, 30]
  want = [0.0, 0.125, 0.5, 0.375, 0.0, 0.0]
  np.testing.assert_allclose([float(sched(s)) for s in steps], want, atol=1e-7)
  # identical to the ffcv formula np.interp(step, [0, peak, total], [0, 1, 0]) * lr
  for s in range(0, 26):
    assert float(sched(s)) == pytest.approx(0.5 * np.interp(s, [0, 8, 24], [0, 1, 0]), abs=1e-7)


def test_warmup_hand_computed():
  base = jt.step_schedule(1.0, steps_per_epoch=10, milestones=[1])
  sched = jt.with_warmup(base, warmup_steps=4, start_factor=0.2)
  want = [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.1]
  got = [float(sched(s)) for s in (0, 1, 2, 3, 4, 9, 10)]
  np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
  "call, arg",
  [
    (lambda: jt.step_schedule(0.1, 0, [1]), "steps_per_epoch"),
    (lambda: jt.step_schedule(0.1, 10, [5, 3]), "milestones"),
    (lambda: jt.step_schedule(0.1, 10, [-1]), "milestones"),
    (lambda: jt.step_schedule(0.1, 10, [1], factor=0.0), "factor"),
    (lambda: jt.triangular_schedule(0.1, 10, peak_epoch=5, total_epochs=3), "peak_epoch"),
    (lambda: jt.triangular_schedule(0.1, 10, peak_epoch=0, total_epochs=0), "total_epochs"),
    (lambda: jt.with_warmup(0.1, -1), "warmup_steps"),
    (lambda: jt.with_warmup(0.1, 3, start_factor=2.0), "start_factor"),
    (lambda: jt.sgd(0.1, momentum=1.0), "momentum"),
    (lambda: jt.sgd(0.1, weight_decay=-1.0), "weight_decay"),
    (lambda: jt.sgd(0.1, momentum=0.0, nesterov=True), "nesterov"),
  ],
)
def test_bad_schedule_and_optimizer_args(call, arg):
  with pytest.raises(ValueError, match=arg):
    call()


# ----------------------------------------------------------------------------- optimizer


def _torch_sgd_reference(params, grads_seq, lr, momentum, wd, nesterov, decay):
  """torch.optim.SGD (dampening 0) written as a plain loop over numpy arrays."""
  params = {k: np.array(v, np.float64) for k, v in params.items()}
  buf = {k: None for k in params}
  for grads in grads_seq:
    for k in params:
      d = np.asarray(grads[k], np.float64) + (wd * params[k] if decay[k] else 0.0)
      buf[k] = d.copy() if buf[k] is None else momentum * buf[k] + d
      step = d + momentum * buf[k] if nesterov else buf[k]
      params[k] = params[k] - lr * step
  return params


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("only_kernels", [False, True])
def test_sgd_weight_decay_matches_torch_loop(nesterov, only_kernels):
  rng = np.random.default_rng(3)
  params = {
    "kernel": rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
    "bias": rng.normal(size=(4,)).astype(np.float32),
  }
  grads_seq = [
    {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(4)
  ]
  tx = jt.sgd(
    0.05,
    0.9,
    nesterov=nesterov,
    weight_decay=0.01,
    decay_mask=jt.kernels_only if only_kernels else None,
  )
  p = jax.tree.map(jnp.asarray, params)
  state = tx.init(p)
  for g in grads_seq:
    updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, p)
    p = optax.apply_updates(p, updates)
  decay = {"kernel": True, "bias": not only_kernels}
  want = _torch_sgd_reference(params, grads_seq, 0.05, 0.9, 0.01, nesterov, decay)
  for k in params:
    np.testing.assert_allclose(p[k], want[k], rtol=1e-5, atol=1e-6)


class _Wrapped(NamedTuple):
  inner: Any


def _hard_mask_wrapper(inner, mask_value=0.0):
  """A ClickTrain-like wrapper that controls the final update: p <- mask * (p + u)."""

  def init(params):
    return _Wrapped(inner.init(params))

  def update(updates, state, params=None, **extra):
    u, inner_state = inner.update(updates, state.inner, params, **extra)
    out = jax.tree.map(lambda p, d: mask_value * 0 + (p + d) * (p != 0) - p, params, u)
    return out, _Wrapped(inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


def test_lr_scale_reaches_inner_optimizer_inside_wrapper():
  params = {"w": jnp.array([1.0, 0.0, 2.0])}
  grads = {"w": jnp.array([1.0, 1.0, 1.0])}
  tx = _hard_mask_wrapper(jt.sgd(0.1, momentum=0.0))
  state = jt.set_lr_scale(tx.init(params), 3.0)
  updates, state = tx.update(grads, state, params)
  new = optax.apply_updates(params, updates)
  # scaled inner update (-0.3) on kept weights; the pruned weight stays exactly 0
  np.testing.assert_allclose(new["w"], [0.7, 0.0, 1.7], rtol=1e-6)
  assert jt.get_lr_scale(state) == pytest.approx(3.0)
  assert jt.get_lr(state) == pytest.approx(0.3)


def test_set_lr_scale_without_scale_by_lr_is_an_error():
  state = optax.sgd(0.1).init({"w": jnp.zeros(2)})
  with pytest.raises(ValueError, match="scale_by_lr"):
    jt.set_lr_scale(state, 2.0)
  with pytest.raises(ValueError, match="lr_scale"):
    jt.set_lr_scale(jt.sgd(0.1).init({"w": jnp.zeros(2)}), 0.0)
