"""Tests for jaxprune.data's Loader: every example once, order from (seed, epoch), exact resume,
batch-size changes, multi-process batches."""

from __future__ import annotations

import numpy as np
import pytest

from jaxprune import data
from jaxprune.data import augment


# ---------------------------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def small_ds():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (103, 6, 6, 3), dtype=np.uint8)
  # Each image carries its own index in pixel (0, 0, 0) so batches can be traced back.
  images[:, 0, 0, 0] = np.arange(103)
  return data.Dataset.from_arrays(images, rng.integers(0, 4, 103), num_classes=4)


def _ids(loader_batches, ds):
  """Example indices of each batch, recovered from pixel (0, 0, 0) (no augmentation)."""
  scale = 1 / (255 * ds.std[0])
  return [
    np.rint((x[:, 0, 0, 0] + ds.mean[0] / ds.std[0]) / scale).astype(int) for x, _ in loader_batches
  ]


def test_loader_visits_every_example_once(small_ds):
  loader = data.Loader(small_ds, 10, drop_last=False, seed=3)
  batches = list(loader)
  assert len(loader) == 11 and len(batches) == 11 and len(batches[-1][0]) == 3
  ids = np.concatenate(_ids(batches, small_ds))
  np.testing.assert_array_equal(np.sort(ids), np.arange(103))
  labels = np.concatenate([y for _, y in batches])
  np.testing.assert_array_equal(labels, small_ds.labels[ids])
  assert loader.epoch == 1 and loader.step == 0
  x, y = batches[0]
  assert x.dtype == np.float32 and y.dtype == np.int32 and x.shape == (10, 6, 6, 3)
  expected = (small_ds.images[ids[:10]] / 255.0 - np.array(small_ds.mean)) / np.array(small_ds.std)
  np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-5)

  dropping = data.Loader(small_ds, 10, seed=3)
  assert len(dropping) == 10
  ids = np.concatenate(_ids(list(dropping), small_ds))
  assert len(ids) == 100 and len(set(ids.tolist())) == 100


def test_loader_order_depends_on_seed_and_epoch(small_ds):
  def epoch_ids(seed, epoch):
    loader = data.Loader(small_ds, 10, seed=seed)
    loader.set_epoch(epoch)
    return np.concatenate(_ids(list(loader), small_ds))

  np.testing.assert_array_equal(epoch_ids(0, 0), epoch_ids(0, 0))
  assert not np.array_equal(epoch_ids(0, 0), epoch_ids(0, 1))
  assert not np.array_equal(epoch_ids(0, 0), epoch_ids(1, 0))
  unshuffled = data.Loader(small_ds, 10, shuffle=False)
  np.testing.assert_array_equal(np.concatenate(_ids(list(unshuffled), small_ds)), np.arange(100))
  # Consecutive iterations advance the epoch by themselves.
  loader = data.Loader(small_ds, 10, seed=0)
  first, second = (
    np.concatenate(_ids(list(loader), small_ds)),
    np.concatenate(_ids(list(loader), small_ds)),
  )
  np.testing.assert_array_equal(first, epoch_ids(0, 0))
  np.testing.assert_array_equal(second, epoch_ids(0, 1))


def _assert_same_batches(a, b):
  assert len(a) == len(b)
  for (xa, ya), (xb, yb) in zip(a, b):
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)


@pytest.mark.parametrize("preset", ["prunetrain", "sdgp", "clicktrain-mixup"])
def test_loader_resume_mid_epoch(small_ds, preset):
  kwargs = dict(seed=5, augment=preset, prefetch=3, num_threads=2)
  reference = data.Loader(small_ds, 8, **kwargs)
  reference.set_epoch(2)
  full = list(reference)

  interrupted = data.Loader(small_ds, 8, **kwargs)
  interrupted.set_epoch(2)
  seen = []
  for batch in interrupted:
    seen.append(batch)
    if len(seen) == 5:
      break
  state = interrupted.state()
  assert state["epoch"] == 2 and state["step"] == 5

  resumed = data.Loader(small_ds, 8, **{**kwargs, "prefetch": 0})
  resumed.restore(state)
  rest = list(resumed)
  _assert_same_batches(seen + rest, full)
  _assert_same_batches(list(reference.iter_epoch(2, start_step=5)), full[5:])
  # Breaking out keeps the position: iterating again finishes the same epoch.
  _assert_same_batches(list(interrupted), full[5:])
  assert interrupted.epoch == 3


def test_loader_mixup_soft_labels(small_ds):
  x, y = next(iter(data.Loader(small_ds, 16, augment="clicktrain-mixup")))
  assert x.dtype == np.float32 and y.shape == (16, 4) and y.dtype == np.float32
  np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-6)


def test_loader_batch_size_changes_between_epochs(small_ds):
  loader = data.Loader(small_ds, 10, seed=0)
  list(loader)
  loader.batch_size = 32
  assert len(loader) == 3
  batches = list(loader)
  assert [len(x) for x, _ in batches] == [32, 32, 32]
  iterator = iter(loader)
  next(iterator)
  with pytest.raises(ValueError, match="between epochs"):
    loader.batch_size = 16
  with pytest.raises(ValueError, match="exceeds the data set size"):
    data.Loader(small_ds, 104)


def test_loader_bad_arguments(small_ds):
  with pytest.raises(ValueError, match="batch_size"):
    data.Loader(small_ds, 0)
  with pytest.raises(ValueError, match="seed"):
    data.Loader(small_ds, 4, seed=-1)
  with pytest.raises(ValueError, match="Normalize"):
    data.Loader(small_ds, 4, augment=[augment.Normalize(small_ds.mean, small_ds.std)])
  with pytest.raises(ValueError, match="dataset"):
    data.Loader(small_ds.images, 4)  # type: ignore[arg-type]
  loader = data.Loader(small_ds, 10)
  with pytest.raises(ValueError, match="start_step"):
    loader.iter_epoch(0, start_step=11)
  with pytest.raises(ValueError, match="state was taken on 50 examples"):
    loader.restore({**loader.state(), "num_examples": 50})
  with pytest.raises(ValueError, match="state must be"):
    loader.restore({"epoch": 1})


def test_loader_processes_share_each_global_batch_disjointly(small_ds):
  def ids(loader):
    return _ids(list(loader), small_ds)

  single = ids(data.Loader(small_ds, 12, seed=4))
  for count in (2, 4):
    shards = [
      ids(data.Loader(small_ds, 12, seed=4, process_index=i, process_count=count))
      for i in range(count)
    ]
    for step, global_ids in enumerate(single):
      # Process i holds the i-th slice: together they are the single-process global batch.
      assert all(len(shard[step]) == 12 // count for shard in shards)
      np.testing.assert_array_equal(np.concatenate([s[step] for s in shards]), global_ids)
    seen = np.concatenate([np.concatenate(s) for s in shards])
    assert len(seen) == len(set(seen.tolist())) == 96  # 8 full batches, each example once

  # drop_last=False: the final partial batch is split too, so every example is seen once.
  even = data.Dataset.from_arrays(small_ds.images[:102], small_ds.labels[:102], num_classes=4)
  shards = [
    np.concatenate(
      _ids(list(data.Loader(even, 10, drop_last=False, process_index=i, process_count=2)), even)
    )
    for i in range(2)
  ]
  np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(102))


def test_loader_multi_process_resume_is_exact_from_any_process_state(small_ds):
  kwargs = dict(seed=1, augment="prunetrain", prefetch=2, num_threads=2, process_count=2)
  full = list(data.Loader(small_ds, 8, process_index=1, **kwargs))
  interrupted = data.Loader(small_ds, 8, process_index=0, **kwargs)
  for _, _ in zip(range(4), interrupted):
    pass
  resumed = data.Loader(small_ds, 8, process_index=1, **kwargs)
  resumed.restore(interrupted.state())  # process 0's snapshot restores process 1 too
  _assert_same_batches(list(resumed), full[4:])
  # The position counts global batches: a single-process snapshot lands on the same examples.
  single = data.Loader(small_ds, 8, seed=1)
  for _, _ in zip(range(4), single):
    pass
  halves = data.Loader(small_ds, 8, seed=1, process_index=1, process_count=2)
  halves.restore(single.state())
  rest = data.Loader(small_ds, 8, seed=1).iter_epoch(0, start_step=4)
  for (x_half, _), global_ids in zip(halves, _ids(rest, small_ds)):
    np.testing.assert_array_equal(_ids([(x_half, None)], small_ds)[0], global_ids[4:])


def test_loader_multi_process_bad_arguments(small_ds):
  with pytest.raises(ValueError, match="batch_size 9 .*process_count 2"):
    data.Loader(small_ds, 9, process_index=0, process_count=2)
  with pytest.raises(ValueError, match="process_index 2 must be below process_count 2"):
    data.Loader(small_ds, 8, process_index=2, process_count=2)
  with pytest.raises(ValueError, match="process_count must be at least 1"):
    data.Loader(small_ds, 8, process_index=0, process_count=0)
  with pytest.raises(ValueError, match="final batch of 3 examples.*process_count 2"):
    data.Loader(small_ds, 10, drop_last=False, process_index=0, process_count=2)
  loader = data.Loader(small_ds, 8, process_index=0, process_count=2)
  with pytest.raises(ValueError, match="batch_size 7 .*process_count 2"):
    loader.batch_size = 7
  assert loader.local_batch_size == 4 and len(next(iter(loader))[0]) == 4


def test_loader_second_live_iterator_takes_over_the_position(small_ds):
  loader = data.Loader(small_ds, 10, seed=2)
  expected = _ids(list(loader.iter_epoch(0)), small_ds)
  first = iter(loader)
  np.testing.assert_array_equal(_ids([next(first)], small_ds)[0], expected[0])
  second = iter(loader)
  # The new iterator continues where the position is: no batch is handed out twice.
  np.testing.assert_array_equal(_ids([next(second)], small_ds)[0], expected[1])
  with pytest.raises(RuntimeError, match="superseded"):
    next(first)
  assert loader.state()["step"] == 2
  rest = _ids(list(second), small_ds)
  for got, want in zip(rest, expected[2:], strict=True):
    np.testing.assert_array_equal(got, want)
  assert (loader.epoch, loader.step) == (1, 0)


@pytest.mark.parametrize("move", ["set_epoch", "restore"])
def test_loader_set_epoch_or_restore_during_iteration_moves_the_position(small_ds, move):
  loader = data.Loader(small_ds, 10, seed=2, prefetch=2, num_threads=2)
  running = iter(loader)
  next(running)
  next(running)
  if move == "set_epoch":
    loader.set_epoch(3)
  else:
    loader.restore({**loader.state(), "epoch": 3, "step": 0})
  assert (loader.state()["epoch"], loader.state()["step"]) == (3, 0)
  with pytest.raises(RuntimeError, match="superseded"):
    next(running)
  # state() still describes exactly what the next iteration hands out.
  _assert_same_batches(list(loader), list(loader.iter_epoch(3)))
  assert (loader.epoch, loader.step) == (4, 0)
