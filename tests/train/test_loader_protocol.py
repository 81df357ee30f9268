"""The training loader protocols (``HostLoader``, ``FusedLoader``) and ``LoaderView``: every
kind of loader trains as the plain list of its batches does, a loader's own
``set_batch_size`` is what the trainer resizes it with, and a loader that is not one is
named."""

from __future__ import annotations

import inspect

import jax
import numpy as np
import pytest

import jaxprune.train as jt
from jaxprune import data

N, BATCH = 48, 8  # 6 steps per epoch: the shared optimizer's epoch length


def _dataset():
  rng = np.random.default_rng(3)
  images = rng.integers(0, 256, (N, 6, 6, 1), dtype=np.uint8)
  labels = (np.arange(N) % 3).astype(np.int32)
  images[:, :2, :2, 0] = labels[:, None, None] * 100  # learnable signal
  return data.Dataset.from_arrays(images, labels, num_classes=3)


def _host_loader():
  return data.Loader(_dataset(), BATCH, shuffle=False, augment="none", prefetch=0)


def _device_loader():
  return data.DeviceLoader(_dataset(), BATCH, shuffle=False, augment="none", steps_per_dispatch=3)


class _OnlyIterable:
  """The protocol's required part alone: iteration over ``(images, labels)``."""

  def __init__(self, batches):
    self._batches = batches

  def __iter__(self):
    return iter(self._batches)


def _fit(kit, loader, epochs=2, callbacks=()):
  trainer = kit.trainer(progress=False, callbacks=callbacks)
  history = trainer.fit(loader, epochs=epochs)
  return trainer, history


def _arrays(tree):
  keys = lambda x: (
    jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
  )  # noqa: E731
  return [np.asarray(keys(x)) for x in jax.tree.leaves(tree)]


def _params(trainer):
  """The trained arrays: params, BatchNorm statistics, the dropout stream's key."""
  return _arrays((trainer.params, trainer.rest))


def _reference(kit, batches):
  """The same batches as a plain list (host NumPy arrays): the road every loader must match."""
  batches = [(np.asarray(x), np.asarray(y)) for x, y in batches]
  return _params(_fit(kit, batches)[0])


def test_a_host_loader_trains_as_the_list_of_its_batches(kit):
  loader = _host_loader()
  want = _reference(kit, list(loader.iter_epoch(0)))
  trainer, history = _fit(kit, loader)
  for got, expected in zip(_params(trainer), want, strict=True):
    np.testing.assert_array_equal(got, expected)
  untrained = _arrays(jt.split_model(kit.model())[2])  # training moved the params
  assert not all(np.array_equal(a, b) for a, b in zip(_arrays(trainer.params), untrained))
  assert [r["batch_size"] for r in history] == [BATCH, BATCH]
  assert loader.epoch == 2  # set_epoch before each epoch, the epoch's end moved it on


def test_a_fused_device_loader_trains_as_the_list_of_its_batches(kit):
  loader = _device_loader()
  assert jt.LoaderView(loader).fused is loader
  want = _reference(kit, list(loader.iter_epoch(0)))  # the batches it makes, copied to the host
  trainer, history = _fit(kit, loader)
  # Made inside the fused step rather than by their own jit: equal up to float rounding.
  for got, expected in zip(_params(trainer), want, strict=True):
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert [r["steps"] for r in history] == [N // BATCH] * 2


def test_an_iterable_with_only_the_required_part_trains_as_the_list(kit):
  batches = list(_host_loader().iter_epoch(0))
  want = _reference(kit, batches)
  trainer, history = _fit(kit, _OnlyIterable(batches))
  for got, expected in zip(_params(trainer), want, strict=True):
    np.testing.assert_array_equal(got, expected)
  view = jt.LoaderView(_OnlyIterable(batches))
  assert (view.fused, view.batch_size, view.position(), view.image_shape) == (None,) * 4
  assert [r["batch_size"] for r in history] == [None, None]


class _Resizable:
  """A loader whose batch size is read-only: the trainer must call its ``set_batch_size``."""

  def __init__(self, images, labels):
    self._images, self._labels, self._size = images, labels, BATCH
    self.calls = []

  @property
  def batch_size(self):
    return self._size

  def set_batch_size(self, batch_size):
    self.calls.append(batch_size)
    self._size = batch_size

  def __len__(self):
    return len(self._images) // self._size

  def __iter__(self):
    for i in range(len(self)):
      part = slice(i * self._size, (i + 1) * self._size)
      yield self._images[part], self._labels[part]


class _GrowAfterFirst(jt.Callback):
  def on_epoch_end(self, trainer, epoch):
    if epoch == 1:
      trainer.set_batch_size(2 * BATCH)


def test_a_loaders_own_set_batch_size_is_what_resizes_it(kit):
  images, labels = kit.data(N)
  loader = _Resizable(images, labels)
  _, history = _fit(kit, loader, epochs=3, callbacks=[_GrowAfterFirst()])
  assert loader.calls == [2 * BATCH]
  assert [r["batch_size"] for r in history] == [BATCH, 2 * BATCH, 2 * BATCH]
  assert [r["steps"] for r in history] == [N // BATCH, N // (2 * BATCH), N // (2 * BATCH)]


@pytest.mark.parametrize("bad", [42, None, "batches.npz", object()])
def test_a_train_loader_that_is_not_iterable_is_named(kit, bad):
  trainer = kit.trainer(progress=False)
  with pytest.raises(ValueError, match=r"train_loader must be an iterable of \(images, labels\)"):
    trainer.fit(bad, epochs=1)
  assert trainer.epoch == 0 and trainer.history == []


def test_a_state_dict_loader_keeps_its_position_through_the_view():
  class TorchStyle:
    def __init__(self):
      self.where = {"step": 0}

    def __iter__(self):
      return iter(())

    def state_dict(self):
      return dict(self.where)

    def load_state_dict(self, state):
      self.where = dict(state)

  loader = TorchStyle()
  view = jt.LoaderView(loader)
  view.restore({"step": 5})
  assert loader.where == {"step": 5} and view.position() == {"step": 5}


def _members(protocol):
  own = {n for n in vars(protocol) if not n.startswith("_") or n in ("__iter__", "__len__")}
  own |= set(vars(protocol).get("__annotations__", {}))
  return own - {"__annotations__", "__dict__", "__weakref__"}


def test_the_data_packages_loaders_have_what_the_protocols_name():
  host = _members(jt.HostLoader)
  fused = _members(jt.FusedLoader)
  assert {"__iter__", "__len__", "batch_size", "set_epoch", "state", "restore"} <= host
  assert fused == {"make_batch", "device_arrays", "dispatches", "place"}
  # The batch size of data.Loader is a settable attribute: the other way to resize.
  for member in host - {"set_batch_size"}:
    assert hasattr(data.Loader, member), member
  for member in fused - {"make_batch"}:  # an attribute each instance builds
    assert hasattr(data.DeviceLoader, member), member
  assert callable(_device_loader().make_batch)
  assert jt.LoaderView(_host_loader()).fused is None
  assert jt.LoaderView(_host_loader()).image_shape == (6, 6, 1)
  assert list(inspect.signature(data.DeviceLoader.place).parameters) == ["self", "where"]
