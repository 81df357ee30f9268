"""``train.skip_nonfinite`` in a hand-written jitted NNX loop: a NaN batch changes nothing, the
parameters and the state of the library's transforms (ClickTrain's, PruneTrain's) included, and
training goes on after it as if the batch had never come."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import prunetrain, train


def _transforms(one_shot_clicktrain):
  return {
    "clicktrain": one_shot_clicktrain,
    "prunetrain": lambda: prunetrain.with_group_lasso(optax.adamw(1e-2), penalty_ratio=0.2),
  }


def _batches(n):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 4, 8, 8, 1)).astype(np.float32)
  y = rng.integers(0, 4, size=(n, 4)).astype(np.int32)
  return x, y


def _loop(model, tx, batches):
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return train.cross_entropy(model(x), y)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, value=loss)
    return loss

  states = []
  for x, y in zip(*batches):
    step(model, optimizer, jnp.asarray(x), jnp.asarray(y))
    states.append(jax.tree.map(np.asarray, (nnx.state(model, nnx.Param), optimizer.opt_state)))
  return states


@pytest.mark.parametrize("name", ["clicktrain", "prunetrain"])
def test_a_nan_batch_changes_nothing_and_training_goes_on(tiny_cnn, one_shot_clicktrain, name):
  make = _transforms(one_shot_clicktrain)[name]
  x, y = _batches(4)
  bad = x.copy()
  bad[1, 0, 0, 0, 0] = np.nan  # the second batch holds one NaN pixel
  guarded = _loop(tiny_cnn(), train.skip_nonfinite(make()), ([x[0], bad[1], x[2], x[3]], y))
  # the NaN step: parameters and every state leaf as after the first step, bit for bit
  params_after, state_after = guarded[1]
  params_before, state_before = guarded[0]
  jax.tree.map(np.testing.assert_array_equal, params_after, params_before)
  jax.tree.map(np.testing.assert_array_equal, state_after.inner_state, state_before.inner_state)
  assert (int(state_after.skipped), int(state_after.skipped_in_a_row)) == (1, 1)
  # the rest equals a run that never saw the NaN batch (x[0], x[2], x[3])
  clean = _loop(tiny_cnn(), train.skip_nonfinite(make()), ([x[0], x[2], x[3]], [y[0], y[2], y[3]]))
  for got, want in zip(guarded[2:], clean[1:]):
    jax.tree.map(np.testing.assert_array_equal, got[0], want[0])
  assert int(guarded[-1][1].skipped) == 1 and int(guarded[-1][1].skipped_in_a_row) == 0
  assert all(np.isfinite(p).all() for p in jax.tree.leaves(guarded[-1][0]))


def test_without_the_guard_one_nan_batch_poisons_the_parameters(tiny_cnn):
  x, y = _batches(3)
  x[1, 0, 0, 0, 0] = np.nan
  states = _loop(tiny_cnn(), optax.sgd(0.05, momentum=0.9), (x, y))
  assert not all(np.isfinite(p).all() for p in jax.tree.leaves(states[-1][0]))


def test_a_nan_loss_with_finite_gradients_is_skipped_too():
  tx = train.skip_nonfinite(optax.sgd(0.1))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.ones(3)}, state, params, value=jnp.float32(jnp.nan))
  np.testing.assert_array_equal(updates["w"], 0.0)
  assert int(state.skipped) == 1
  updates, state = tx.update({"w": jnp.ones(3)}, state, params, value=jnp.float32(1.0))
  np.testing.assert_allclose(updates["w"], -0.1)
  assert int(state.skipped_in_a_row) == 0
