"""Non-finite train steps: skipped by the trainer's step (params, optimizer state and BatchNorm
statistics unchanged) for any optimizer, on the host and the fused device path; a run of them
stops training with a NonFiniteError naming its first batch; ``skip_nonfinite=False`` applies
them as before."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt
from jaxprune import data

# One optimizer object for these tests, so they share the compiled steps.
_MOMENTUM = jt.sgd(0.1, momentum=0.9)


class _Batches:
  """Yields the given batches in order, every epoch."""

  def __init__(self, batches):
    self.batches = batches

  def __len__(self):
    return len(self.batches)

  def __iter__(self):
    return iter(self.batches)


def _batches(kit, bad=(), n=32, size=8):
  """``n / size`` batches of the trainer tests' data; those numbered in ``bad`` (1-based) get
  one NaN pixel."""
  images, labels = kit.data(n)
  out = [(images[i : i + size].copy(), labels[i : i + size]) for i in range(0, n, size)]
  for b in bad:
    out[b - 1][0][3, 2, 2, 0] = np.nan
  return out


def _fit(kit, batches, epochs=1, **kwargs):
  trainer = jt.Trainer(kit.model(dropout=0.0), _MOMENTUM, progress=False, **kwargs)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    history = trainer.fit(_Batches(batches), epochs=epochs)
  return trainer, history, [str(w.message) for w in caught if w.category is RuntimeWarning]


def _state(trainer, kind):
  return jax.tree.map(np.asarray, nnx.state(trainer.model, kind))


def test_a_nan_batch_is_skipped_as_if_it_were_not_there(kit):
  batches = _batches(kit, bad=[2])
  trainer, (record,), messages = _fit(kit, batches)
  assert record["nonfinite_steps"] == 1
  assert any(
    "1 of 4 train steps had a non-finite loss or gradient; their updates were skipped" in m
    for m in messages
  )
  # The same run without the bad batch: params, momentum, the optimizer's step count and
  # BatchNorm's running statistics are the same, bit for bit.
  reference, _, _ = _fit(kit, [batches[0], *batches[2:]])
  for kind in (nnx.Param, nnx.BatchStat):
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(_state(trainer, kind)))
    kit.assert_trees_equal(_state(trainer, kind), _state(reference, kind))
  kit.assert_trees_equal(trainer.opt_state, reference.opt_state)


def test_skip_nonfinite_false_applies_the_update_as_before(kit):
  trainer, (record,), messages = _fit(kit, _batches(kit, bad=[2]), skip_nonfinite=False)
  # The NaN reaches the params through the update, and every later step is NaN too.
  assert record["nonfinite_steps"] == 3
  params = _state(trainer, nnx.Param)
  assert np.all(np.isnan(params["c1"]["kernel"])) and np.all(np.isnan(params["head"]["kernel"]))
  assert any("their updates were applied (skip_nonfinite=False)" in m for m in messages)


def test_a_users_own_optax_chain_gets_the_same_skip(kit):
  tx = optax.chain(optax.add_decayed_weights(1e-3), optax.sgd(0.1, momentum=0.9))
  batches = _batches(kit, bad=[3])
  models = []
  for run in (batches, batches[:2] + batches[3:]):
    trainer = jt.Trainer(kit.model(dropout=0.0), tx, progress=False)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      trainer.fit(_Batches(run), epochs=1)
    models.append(trainer)
  kit.assert_trees_equal(_state(models[0], nnx.Param), _state(models[1], nnx.Param))
  kit.assert_trees_equal(models[0].opt_state, models[1].opt_state)


def test_consecutive_nonfinite_steps_stop_the_run_naming_the_first(kit):
  trainer = jt.Trainer(kit.model(dropout=0.0), _MOMENTUM, progress=False, max_nonfinite_steps=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    with pytest.raises(jt.NonFiniteError, match=r"the first of them was epoch 1, step 2 ") as e:
      trainer.fit(_Batches(_batches(kit, bad=[2, 3])), epochs=3)
  assert "2 consecutive train steps had a non-finite loss or gradient" in str(e.value)
  assert "(max_nonfinite_steps=2)" in str(e.value)
  assert (e.value.epoch, e.value.step, e.value.limit) == (1, 2, 2)
  assert isinstance(e.value, FloatingPointError)
  assert trainer.epoch == 0  # stopped at the end of the epoch that reached the limit


def test_a_run_of_nonfinite_steps_spans_epochs(kit):
  # The last batch of epoch 1 and the first of epoch 2: a run of two.
  batches = _batches(kit, bad=[1, 4])
  trainer = jt.Trainer(kit.model(dropout=0.0), _MOMENTUM, progress=False, max_nonfinite_steps=2)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    with pytest.raises(jt.NonFiniteError, match=r"end of epoch 2: .* was epoch 1, step 4 "):
      trainer.fit(_Batches(batches), epochs=3)
  assert trainer.epoch == 1
  # Scattered non-finite steps never stop a run; None never stops.
  for limit, bad in ((2, [2, 4]), (None, [1, 2, 3, 4])):
    _, history, _ = _fit(kit, _batches(kit, bad=bad), epochs=2, max_nonfinite_steps=limit)
    assert [r["nonfinite_steps"] for r in history] == [len(bad)] * 2


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_max_nonfinite_steps_is_checked(kit, value):
  with pytest.raises(ValueError, match="max_nonfinite_steps must be an int >= 1"):
    jt.Trainer(kit.model(), _MOMENTUM, max_nonfinite_steps=value)


def test_the_fused_device_path_skips_too(kit):
  # DeviceLoader images are uint8 (never NaN): a class id the 3-output model does not have
  # makes the loss of batch 2 NaN instead.
  images = np.random.default_rng(0).integers(0, 256, (32, 6, 6, 1), dtype=np.uint8)
  labels = np.arange(32) % 3
  labels[10] = 3

  def loader(keep):
    ds = data.Dataset.from_arrays(
      images[keep], labels[keep], num_classes=4, mean=(0.5,), std=(0.25,)
    )
    return data.DeviceLoader(ds, 8, shuffle=False, augment="none", steps_per_dispatch=2)

  trainers = []
  for keep in (np.arange(32), np.r_[0:8, 16:32]):
    trainer = jt.Trainer(kit.model(dropout=0.0), _MOMENTUM, progress=False)
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", RuntimeWarning)
      (record,) = trainer.fit(loader(keep), epochs=1)
    trainers.append((trainer, record))
  (fused, record), (reference, _) = trainers
  assert record["nonfinite_steps"] == 1
  for kind in (nnx.Param, nnx.BatchStat):
    got, want = _state(fused, kind), _state(reference, kind)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(got))
    # Two steps in one scan against single steps: the same up to rounding.
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6), got, want)
