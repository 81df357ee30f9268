"""ClickTrain's schedule as one frozen value: built by the presets, held in the state, read by
the hooks, and stepped by the learning rate's step increment (the trainer's epochs)."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain as ct
from jaxprune import data, methods, train


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.conv = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv(nnx.relu(self.stem(x)))).mean((1, 2)))


def _params():
  return nnx.as_pure(nnx.state(_Net(nnx.Rngs(0)), nnx.Param))


def _loader(n=32, batch=8):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
  labels = rng.integers(0, 4, n).astype(np.int32)
  dataset = data.Dataset.from_arrays(images, labels, num_classes=4)
  return data.Loader(dataset, batch, shuffle=True, seed=0, drop_last=True)


def test_schedule_is_frozen_checked_and_static():
  schedule = ct.Schedule(steps_per_epoch=4, hard_prune_epoch=3, mode="one_shot", one_shot_epoch=1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    schedule.hard_prune_epoch = 5
  with pytest.raises(ValueError, match="hard_prune_epoch"):
    ct.Schedule(steps_per_epoch=4, hard_prune_epoch=1, mode="one_shot", one_shot_epoch=1)
  # A static pytree node: no leaves, equal values hash alike.
  assert jax.tree.leaves({"s": schedule}) == []
  assert hash(schedule) == hash(dataclasses.replace(schedule))


def test_the_state_holds_the_schedule_the_preset_built():
  run = methods.Run(steps_per_epoch=2, epochs=10)
  tx = methods.get("clicktrain", mode="one_shot").make_tx(optax.sgd(0.1), run)
  held = ct.find_state(tx.init(_params())).schedule
  assert held == ct.Schedule.for_run(2, 10, mode="one_shot")
  assert (held.hard_prune_epoch, held.one_shot_epoch, held.total_epochs) == (5, 3, 10)


def test_keywords_or_schedule_not_both():
  schedule = ct.Schedule(steps_per_epoch=4, hard_prune_epoch=3)
  ct.clicktrain(optax.sgd(0.1), schedule=schedule)
  with pytest.raises(ValueError, match="not both"):
    ct.clicktrain(optax.sgd(0.1), schedule=schedule, hard_prune_epoch=3)
  with pytest.raises(ValueError, match="steps_per_epoch"):
    ct.clicktrain(optax.sgd(0.1), hard_prune_epoch=3)


def test_stage_ends_follow_the_step_increment_of_the_learning_rate():
  """After the batch doubles (step increment 2), an epoch of 2 steps ends an epoch of the
  schedule, as it advances the learning rate's schedule by an epoch."""
  tx = ct.clicktrain(
    train.sgd(0.1),
    steps_per_epoch=4,
    hard_prune_epoch=3,
    mode="one_shot",
    one_shot_epoch=1,
    kernel_prune_ratio=0.5,
  )
  params = _params()
  grads = jax.tree.map(lambda x: 0.01 * np.ones_like(x), params)
  state, stages = tx.init(params), []
  for step in range(8):
    if step == 4:  # epoch 1 done at batch B; then batches of 2B
      state = train.set_step_increment(state, 2.0)
    _, state = tx.update(grads, state, params)
    stages.append(ct.stage_name(state))
  # Epoch 2 = steps 5-6 (the pick at its first step), epoch 3 = steps 7-8 ends with the prune.
  assert stages[:4] == ["warmup"] * 4
  assert stages[4:] == ["regularize"] * 3 + ["pruned"]
  clock = ct.find_state(state).epoch_length
  assert float(clock.step) == 12.0 == float(train.optim.find_lr_states(state)[0].step)


def test_trainer_that_grows_the_batch_prunes_at_its_epoch(tmp_path):
  """The trainer's dynamic mini-batch: the batch doubles after epoch 1, and the hard prune
  still ends the trainer's epoch ``hard_prune_epoch`` (the hook reads it from the state)."""

  class Grow(train.Callback):
    def on_epoch_end(self, trainer, epoch):
      if epoch == 1:
        trainer.set_batch_size(16)

  loader = _loader()
  tx = methods.get("clicktrain", mode="one_shot", hard_prune_epoch=3, one_shot_epoch=1).make_tx(
    train.sgd(0.05, momentum=0.9), methods.Run.from_loader(loader, epochs=4)
  )
  readout = ct.HardPruneReadout(_loader(16, 8))
  trainer = train.Trainer(_Net(nnx.Rngs(1)), tx, progress=False, callbacks=[Grow(), readout])
  trainer.fit(loader, epochs=4)
  assert [r["steps"] for r in trainer.history] == [4, 2, 2, 2]
  assert readout.hard_prune_epoch == 3 and readout.fired_at == 2
  assert ct.stage_name(trainer.opt_state) == "pruned"


@pytest.mark.parametrize("images, grown", [(40, 16), (56, 16)])
def test_stages_keep_to_the_trainers_epochs_when_the_grown_batch_does_not_divide(images, grown):
  """A grown batch whose steps per epoch are not the reference's / (new / old batch): 40
  images in batches of 8 are 5 steps, in batches of 16 (drop_last) 2 steps, which the batch
  ratio would count as 4 reference steps (the stages fell an epoch behind per grown epoch);
  56 images: 7 steps, then 3, an increment of 7/3 that float32 rounds. Each epoch of the
  trainer is one epoch of the schedule: the position is exactly ``epochs * 5`` (``* 7``) at
  every epoch end, and the stages change at the epochs set."""

  class Grow(train.Callback):
    def on_epoch_end(self, trainer, epoch):
      if epoch == 1:
        trainer.set_batch_size(grown)

  loader = _loader(images, 8)
  reference = len(loader)
  tx = methods.get(
    "clicktrain", mode="one_shot", hard_prune_epoch=4, one_shot_epoch=2, kernel_prune_ratio=0.5
  ).make_tx(train.sgd(0.05, momentum=0.9), methods.Run.from_loader(loader, epochs=5))
  positions, stages = [], []

  class Record(train.Callback):
    def on_epoch_end(self, trainer, epoch):
      positions.append(float(ct.find_state(trainer.opt_state).epoch_length.step))
      stages.append(ct.stage_name(trainer.opt_state))

  trainer = train.Trainer(_Net(nnx.Rngs(1)), tx, progress=False, callbacks=[Grow(), Record()])
  trainer.fit(loader, epochs=5)
  assert [r["steps"] for r in trainer.history] == [reference] + [images // grown] * 4
  np.testing.assert_allclose(positions, [reference * e for e in range(1, 6)], rtol=0, atol=1e-5)
  assert stages == ["warmup", "warmup", "regularize", "pruned", "pruned"]
  # The learning rate's schedule is at the same position.
  assert float(train.optim.find_lr_states(trainer.opt_state)[0].step) == pytest.approx(positions[-1])
