"""``fit(max_seconds=...)``: a run that stops for its time box saves, says so and resumes
exactly; ``eval_every`` and ``checkpoint_every=0``."""

from __future__ import annotations

import json
import warnings

import jax
import numpy as np
import pytest

from jaxprune import data, train
from jaxprune.train._time_box import TimeBox


def _data(n=64):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (n, 8, 8, 1), dtype=np.uint8)
  return data.Dataset.from_arrays(images, (np.arange(n) % 4).astype(np.int32), num_classes=4)


def _loaders(device):
  ds = _data()
  make = data.DeviceLoader if device else data.Loader
  extra = {"steps_per_dispatch": 2} if device else {"prefetch": 0}
  return (
    make(ds, 16, seed=1, augment="prunetrain", **extra),
    make(ds, 32, shuffle=False, drop_last=False, **({} if device else {"prefetch": 0})),
  )


@pytest.fixture
def make_trainer(tiny_cnn):
  """``make_trainer(folder, **kwargs)``: a Trainer of the shared tiny CNN (seed 0) that
  checkpoints and logs under ``folder``."""

  def make(folder, **kwargs):
    return train.Trainer(
      tiny_cnn(),
      train.sgd(0.05, 0.9),
      progress=False,
      checkpoint_dir=folder / "ckpt",
      log_path=folder / "log.jsonl",
      **kwargs,
    )

  return make


def _leaves(t):
  return [np.asarray(x) for x in jax.tree.leaves((t.params, t.rest, t.opt_state))]


@pytest.mark.parametrize("device", [False, True])
def test_stopped_run_saves_warns_and_resumes_exactly(tmp_path, device, make_trainer):
  whole = make_trainer(tmp_path / "whole")
  whole.fit(*_loaders(device), epochs=3)

  first = make_trainer(tmp_path / "cut", checkpoint_every=0, eval_every=2)
  with pytest.warns(RuntimeWarning, match=r"fit stopped after epoch 1 of 3: max_seconds=1e-06"):
    history = first.fit(*_loaders(device), epochs=3, max_seconds=1e-6)
  # The first epoch has no estimate yet, so it runs; the second would not fit.
  assert first.epoch == 1 and first.stopped_early.startswith("max_seconds")
  assert "test_acc" in history[-1]  # the last trained epoch is always evaluated
  assert [s.name for s in (tmp_path / "cut" / "ckpt").iterdir() if s.name.isdigit()] == ["1"]
  lines = (tmp_path / "cut" / "log.jsonl").read_text().splitlines()
  assert len(lines) == 1 and "test_acc" in json.loads(lines[0])
  first.close()  # its folder goes to the next trainer, as at the end of its process

  second = make_trainer(tmp_path / "cut", checkpoint_every=0, eval_every=2)
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    second.fit(*_loaders(device), epochs=3)
  assert second.epoch == 3 and second.stopped_early is None
  for a, b in zip(_leaves(whole), _leaves(second)):
    np.testing.assert_array_equal(a, b)


def test_must_finish_stops_when_the_rest_cannot_fit(tmp_path, make_trainer):
  trainer = make_trainer(tmp_path)
  # After the first epoch only the next epoch is judged (the first one also compiled).
  with pytest.warns(RuntimeWarning, match="the next epoch would end"):
    trainer.fit(*_loaders(False), epochs=5, max_seconds=1e-6, must_finish=True)
  assert trainer.epoch == 1
  # A generous box changes nothing.
  trainer = make_trainer(tmp_path / "b")
  trainer.fit(*_loaders(False), epochs=2, max_seconds=1e6, must_finish=True)
  assert trainer.epoch == 2 and trainer.stopped_early is None


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


@pytest.mark.parametrize("must_finish", [False, True])
def test_time_box_decisions_on_a_planted_clock(must_finish):
  """A box of 130 s over 8 epochs evaluated every 2: the first epoch takes 30 s and the first
  evaluation 20 s (both compile), later epochs 10 s and evaluations 4 s."""
  clock = _Clock()
  box = TimeBox(130.0, must_finish, eval_every=2, epochs=8, clock=clock)
  assert box.stop_reason(0) is None  # nothing measured yet: the first epoch runs
  timeline = [(30, 0), (10, 20), (10, 0), (10, 4), (10, 0), (10, 4), (10, 0)]
  stops = {}
  for epoch, (train_s, eval_s) in enumerate(timeline, start=1):
    clock.now += train_s + eval_s
    box.epoch_done(train_s + eval_s, eval_s)
    stops[epoch] = box.stop_reason(epoch)
  if must_finish:
    # At epoch 2 the remaining 6 epochs cost 60 s and their evaluations nothing yet (the only
    # one measured compiled): 120 s fits. Charging 20 s an evaluation would have stopped here.
    assert stops[1] is None and stops[2] is None and stops[3] is None
    # At epoch 4: 4 epochs x 10 s + 2 evaluations x 4 s after 84 s: 132 s.
    assert stops[4] == (
      "max_seconds=130: the remaining 4 epochs would end about 132 s after fit began (84 s spent)"
    )
  else:
    # Only the next epoch is judged: epoch 8 (10 s + a 4-s evaluation) would end at 132 s.
    assert [e for e, stop in stops.items() if stop] == [7]
    assert "the next epoch would end about 132 s" in stops[7]


def test_eval_every_and_checkpoint_every_zero(tmp_path, make_trainer):
  trainer = make_trainer(tmp_path, eval_every=2, checkpoint_every=0)
  history = trainer.fit(*_loaders(True), epochs=3)
  assert ["test_acc" in h for h in history] == [False, True, True]  # the last is always
  saved = sorted(s.name for s in (tmp_path / "ckpt").iterdir() if s.name.isdigit())
  assert saved == ["3"]


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"eval_every": 0}, "eval_every"),
    ({"checkpoint_every": -1}, "checkpoint_every"),
    ({"eval_every": True}, "eval_every"),
  ],
)
def test_bad_intervals_are_named(tmp_path, kwargs, match, make_trainer):
  with pytest.raises(ValueError, match=match):
    make_trainer(tmp_path, **kwargs)


@pytest.mark.parametrize(
  "kwargs, match",
  [({"max_seconds": 0}, "max_seconds"), ({"must_finish": True}, "must_finish")],
)
def test_bad_time_box_is_named(tmp_path, kwargs, match, make_trainer):
  with pytest.raises(ValueError, match=match):
    make_trainer(tmp_path).fit(*_loaders(False), epochs=1, **kwargs)
