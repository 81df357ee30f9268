"""jaxprune.train's jitted train / eval step: the loss as Optax extra args, NNX optimizer parity,
flip TTA and padding, step memory."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt


# ----------------------------------------------------------------------------- train step


class _RecordState(NamedTuple):
  value: jax.Array
  calls: jax.Array


def _record_value():
  """GradientTransformationExtraArgs that stores the `value` it receives."""

  def init(params):
    del params
    return _RecordState(jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, value=None, **extra):
    del params, extra
    return updates, _RecordState(jnp.asarray(value, jnp.float32), state.calls + 1)

  return optax.GradientTransformationExtraArgs(init, update)


def test_train_step_passes_loss_as_value_to_extra_args_transform(kit):
  images, labels = kit.data(8)
  model = kit.model(dropout=0.0)
  reference = nnx.clone(model)
  reference.train()
  want = jt.cross_entropy(reference(jnp.asarray(images)), jnp.asarray(labels), 0.1)
  trainer = jt.Trainer(model, optax.chain(_record_value(), optax.sgd(0.1)), label_smoothing=0.1)
  state = jt.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)
  _, _, opt_state, m = trainer.steps.train(state, images, labels)
  recorded = opt_state[0]
  assert int(recorded.calls) == 1
  np.testing.assert_allclose(float(recorded.value), float(want), rtol=1e-5)
  np.testing.assert_allclose(m.summary()["loss"], float(want), rtol=1e-5)


def test_step_settings_value_is_the_compile_cache_key(kit):
  """One hashable settings value picks the compiled steps: equal settings share them, any
  changed field (another ``tx`` object, ``donate``) builds new ones."""
  model, tx = kit.model(dropout=0.0), optax.sgd(0.1)
  settings = jt.step_settings(model, tx)
  assert settings == jt.step_settings(model, tx)
  assert hash(settings) == hash(jt.step_settings(model, tx))
  steps = jt.step_functions(settings)
  assert jt.step_functions(jt.step_settings(model, tx)) is steps
  assert steps.settings is settings and steps.axis_name is None
  assert jt.step_functions(jt.step_settings(model, tx, donate=False)) is not steps
  assert jt.step_functions(jt.step_settings(model, optax.sgd(0.1))) is not steps


def test_train_step_is_one_function_of_settings_state_and_batch(kit):
  """``train_step(settings, state, images, labels)`` (``axis_name=None``: one device) is what
  the jitted step runs."""
  images, labels = kit.data(8)
  model, tx = kit.model(dropout=0.0), optax.sgd(0.1, momentum=0.9)
  settings = jt.step_settings(model, tx, donate=False)
  _, _, params, rest = jt.split_model(model)
  state = jt.TrainState.start(params, rest, tx.init(params))
  want = jt.step_functions(settings).train(state, images, labels)
  got = jax.jit(jt.train_step, static_argnums=0)(settings, state, images, labels)
  assert isinstance(got, jt.TrainState)
  same = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)
  jax.tree.map(
    same, (got.params, got.opt_state, got.metrics), (want.params, want.opt_state, want.metrics)
  )


def test_nonfinite_bookkeeping_is_its_own_state(kit):
  """A NaN batch: nothing added to the sums, params kept, and the step counted in the
  metrics' ``nonfinite_state`` (a :class:`NonFiniteState`, as optax's apply_if_finite)."""
  images, labels = kit.data(8)
  images[2] = np.nan
  model, tx = kit.model(dropout=0.0), optax.sgd(0.1)
  steps = jt.step_functions(jt.step_settings(model, tx, donate=False))
  _, _, params, rest = jt.split_model(model)
  state = steps.train(jt.TrainState.start(params, rest, tx.init(params)), images, labels)
  guard = state.metrics.nonfinite_state
  assert isinstance(guard, jt.NonFiniteState)
  assert [int(guard.nonfinite), int(guard.steps), int(guard.nonfinite_run)] == [1, 1, 1]
  assert [int(guard.nonfinite_inputs), int(guard.first_nonfinite_input)] == [1, 1]
  assert float(state.metrics.count) == 0.0
  jax.tree.map(np.testing.assert_array_equal, state.params, params)
  summary = state.metrics.summary()
  assert summary["nonfinite"] == 1 and summary["count"] == 0


def test_train_step_matches_nnx_optimizer(kit):
  """One step of the split/merge jitted step == nnx.Optimizer.update (the reference API)."""
  images, labels = kit.data(8)
  model_a, model_b = kit.model(dropout=0.0), kit.model(dropout=0.0)
  tx = jt.sgd(0.1, 0.9, weight_decay=1e-3)
  trainer = jt.Trainer(model_a, tx)
  opt = nnx.Optimizer(model_b, tx, wrt=nnx.Param)

  @nnx.jit
  def reference_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jt.cross_entropy(m(x), y))(model)
    opt.update(model, grads, value=loss)

  model_b.train()
  state = jt.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)
  for _ in range(2):
    reference_step(model_b, opt, jnp.asarray(images), jnp.asarray(labels))
    state = trainer.steps.train(state, images, labels)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    state.params,
    nnx.as_pure(nnx.state(model_b, nnx.Param)),
  )
  # batch statistics were updated the same way
  nnx.update(model_a, state.params, state.rest)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
    nnx.as_pure(nnx.state(model_a, nnx.BatchStat)),
    nnx.as_pure(nnx.state(model_b, nnx.BatchStat)),
  )


def test_eval_flip_tta_and_padding_match_eager_model(kit):
  images, labels = kit.data(10)
  model = kit.model()
  trainer = kit.trainer(model, flip_tta=True)
  loader = kit.ArrayLoader(images, labels, 4, shuffle=False, drop_last=False)  # 4 + 4 + 2
  got = trainer.evaluate(loader)
  ref = nnx.clone(model)
  ref.eval()
  x = jnp.asarray(images)
  logits = 0.5 * (ref(x) + ref(x[:, :, ::-1, :]))
  want_loss = float(jt.cross_entropy(logits, jnp.asarray(labels), kit.SMOOTHING))
  want_acc = float(jt.accuracy(logits, jnp.asarray(labels)))
  assert got["test_loss"] == pytest.approx(want_loss, rel=1e-5)
  assert got["test_acc"] == pytest.approx(want_acc)
  # flip TTA changes the logits of this (not flip-invariant) model
  plain = float(jt.cross_entropy(ref(x), jnp.asarray(labels), kit.SMOOTHING))
  assert abs(plain - want_loss) > 1e-6


def test_step_memory_grows_with_batch(kit):
  trainer = kit.trainer()
  small = trainer.step_memory(8, (6, 6, 1))
  large = trainer.step_memory(32, (6, 6, 1))
  assert large["argument"] > small["argument"]
  assert large["total"] > small["total"] > 0
  with pytest.raises(ValueError, match="batch_size"):
    trainer.step_memory(0, (6, 6, 1))
  assert trainer.step_memory(32, (6, 6, 1))["total"] > trainer.step_memory(24, (6, 6, 1))["total"]
