"""DeviceLoader: the host Loader's order and position, batches made on the device, and the
trainer's fused steps over it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxprune import data, train
from jaxprune.data import augment, device_augment


def _dataset(n=96, seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8)
  labels = (np.arange(n) % 4).astype(np.int32)
  return data.Dataset.from_arrays(images, labels, num_classes=4)


def test_order_position_and_resume_are_the_host_loaders():
  ds = _dataset()
  host = data.Loader(ds, 16, seed=3, augment="none")
  dev = data.DeviceLoader(ds, 16, seed=3, augment="none", steps_per_dispatch=2)
  for epoch in range(2):
    np.testing.assert_array_equal(host.order(epoch), dev.order(epoch))
  seen = [d.indices for d in dev.dispatches()]
  assert [len(i) for i in seen] == [2, 2, 2]
  np.testing.assert_array_equal(np.concatenate(seen).ravel(), host.order(0)[:96])
  assert dev.state() == {**host.state(), "epoch": 1}
  # A restored position continues mid-epoch, re-aligned to whole dispatches.
  dev.restore({"epoch": 4, "step": 1, "batch_size": 16, "seed": 3, "num_examples": 96})
  steps = [d.steps.tolist() for d in dev.dispatches()]
  assert steps == [[1], [2, 3], [4, 5]] and dev.epoch == 5


def test_plain_iteration_gives_device_batches_of_the_fused_function():
  ds = _dataset()
  dev = data.DeviceLoader(ds, 16, seed=1, augment="prunetrain")
  batches = list(dev)
  assert len(batches) == 6 and isinstance(batches[0][0], jax.Array)
  images, labels = dev.device_arrays
  order = dev.order(0).astype(np.int32)
  # Jitted, as the trainer's step runs it (XLA may fuse the normalisation's multiply-add).
  x, y = jax.jit(dev.make_batch)(images, labels, order[16:32], 1, 0, 1)
  np.testing.assert_array_equal(np.asarray(batches[1][0]), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(batches[1][1]), np.asarray(y))
  np.testing.assert_array_equal(np.asarray(y), ds.labels[order[16:32]])


def test_dispatch_size_is_the_closest_divisor_and_the_tail_is_its_own():
  ds = _dataset(100)
  dev = data.DeviceLoader(ds, 10, augment="none", steps_per_dispatch=4, drop_last=False)
  assert dev.dispatch_steps() == 5  # divisors of 10: 5 is closest to 4 on a log scale
  ds97 = _dataset(97 * 4)
  assert data.DeviceLoader(ds97, 4, augment="none", steps_per_dispatch=50).dispatch_steps() == 97
  tail = data.DeviceLoader(ds, 12, augment="none", steps_per_dispatch=8, drop_last=False)
  shapes = [d.indices.shape for d in tail.dispatches()]
  assert shapes == [(8, 12), (1, 4)]


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"steps_per_dispatch": 0}, "steps_per_dispatch"),
    ({"steps_per_dispatch": 1.5}, "steps_per_dispatch"),
    ({"augment": [augment.Normalize((0.5,), (0.2,))]}, "Normalize"),
  ],
)
def test_bad_arguments_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.DeviceLoader(_dataset(), 16, **kwargs)


@pytest.fixture
def make_trainer(tiny_cnn):
  """``make_trainer(**kwargs)``: a Trainer of the shared tiny CNN (seed 0), SGD with momentum."""

  def make(**kwargs):
    return train.Trainer(tiny_cnn(), train.sgd(0.05, 0.9), progress=False, **kwargs)

  return make


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _fit_device(make_trainer, ds, k, epochs=2):
  loader = data.DeviceLoader(ds, 16, seed=2, augment="prunetrain", steps_per_dispatch=k)
  trainer = make_trainer()
  history = trainer.fit(loader, epochs=epochs)
  return trainer, history


def test_steps_grouped_into_other_dispatches_compute_the_same_bit_for_bit(make_trainer):
  """Six steps an epoch as 3 calls of 2 fused steps or 2 calls of 3: the same bits."""
  ds = _dataset()
  (a, ha), (b, hb) = _fit_device(make_trainer, ds, 2), _fit_device(make_trainer, ds, 3)
  assert a.step == b.step == 12
  for x, y in zip(
    _leaves((a.params, a.rest, a.opt_state)), _leaves((b.params, b.rest, b.opt_state))
  ):
    np.testing.assert_array_equal(x, y)
  assert [h["train_loss"] for h in ha] == [h["train_loss"] for h in hb]


def test_one_step_per_call_matches_fused_steps_to_rounding(make_trainer):
  """One step per call runs the step without a loop (XLA:CPU ran the loop 7x slower), which
  XLA may fuse otherwise: the same computation, equal to float32 rounding."""
  ds = _dataset()
  (a, _), (b, _) = _fit_device(make_trainer, ds, 1), _fit_device(make_trainer, ds, 3)
  for x, y in zip(_leaves(a.params), _leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


class _Replay(augment.Augmentation):
  """Hands the NumPy pipeline the draws the device made, in order (a loader without
  prefetch builds its batches in order)."""

  def __init__(self, inner, queue):
    self.inner, self.queue = inner, queue

  def sample(self, rng, batch_shape):
    return self.queue.pop(0)

  def apply(self, images, labels, params):
    return self.inner.apply(images, labels, params)


def test_device_and_host_loaders_reach_the_same_parameters_on_the_same_draws(make_trainer):
  ds = _dataset()
  dev = data.DeviceLoader(ds, 16, seed=4, augment="prunetrain", steps_per_dispatch=2)
  pipeline = augment.preset("prunetrain").bind(ds)
  queues = [[] for _ in pipeline]
  for epoch in range(2):
    for step in range(len(dev)):
      key = jax.random.key(4)
      for value in (1, epoch, step):  # the DeviceLoader's key of (seed, epoch, step)
        key = jax.random.fold_in(key, value)
      for queue, params in zip(queues, device_augment.draws(pipeline, key, (16, 8, 8, 1))):
        queue.append(params)
  replay = [_Replay(aug, q) for aug, q in zip(pipeline, queues)]
  host = data.Loader(ds, 16, seed=4, augment=replay, prefetch=0)
  a, b = make_trainer(), make_trainer()
  a.fit(dev, epochs=2)
  b.fit(host, epochs=2)
  for x, y in zip(_leaves(a.params), _leaves(b.params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_evaluation_on_a_device_loader_pads_the_short_batch(make_trainer):
  ds = _dataset(40)
  trainer = make_trainer()
  on_host = trainer.evaluate(data.Loader(ds, 16, shuffle=False, drop_last=False))
  on_device = trainer.evaluate(data.DeviceLoader(ds, 16, shuffle=False, drop_last=False))
  assert on_device["test_acc"] == pytest.approx(on_host["test_acc"])
  assert on_device["test_loss"] == pytest.approx(on_host["test_loss"], rel=1e-5)
