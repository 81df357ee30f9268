"""``fit`` names a training loader whose batches per epoch are not the steps per epoch the
optimizer was built for (ClickTrain's ``steps_per_epoch``, or any transform that keeps an
``EpochLengthState``), and says nothing when they agree or the batch has grown since."""

from __future__ import annotations

import warnings

import optax
import pytest

from jaxprune import clicktrain, train


def _clicktrain(steps_per_epoch):
  return clicktrain.clicktrain(
    optax.sgd(0.05),
    steps_per_epoch=steps_per_epoch,
    hard_prune_epoch=3,
    mode="one_shot",
    one_shot_epoch=1,
  )


@pytest.mark.parametrize("told", [12, 5])  # twice the loader's steps; one fewer
def test_fit_names_a_clicktrain_built_for_another_epoch_length(tiny_cnn, digits_loader, told):
  loader = digits_loader()  # 96 images in batches of 16
  assert len(loader) == 6
  trainer = train.Trainer(tiny_cnn(), _clicktrain(told), progress=False)
  with pytest.warns(
    UserWarning,
    match=rf"train_loader has 6 batches per epoch but the optimizer was built for "
    rf"steps_per_epoch={told} \(e.g. clicktrain\(steps_per_epoch=...\)\)",
  ):
    trainer.fit(loader, epochs=1)


def test_fit_is_quiet_when_the_lengths_agree(tiny_cnn, digits_loader):
  trainer = train.Trainer(tiny_cnn(), _clicktrain(6), progress=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trainer.fit(digits_loader(), epochs=1)


class _Doubles(train.Callback):
  def on_epoch_end(self, trainer, epoch):
    if epoch == 1:
      trainer.set_batch_size(32)


def _told(steps_per_epoch):
  """A transform that was told its steps per epoch and does nothing else."""
  return optax.GradientTransformation(
    lambda params: train.epoch_length_state(steps_per_epoch), lambda u, s, p=None: (u, s)
  )


def test_any_transform_that_keeps_an_epoch_length_is_checked(tiny_cnn, digits_loader):
  tx = optax.chain(_told(7), optax.sgd(0.05))
  assert train.find_epoch_lengths(tx.init({})) == [7]
  trainer = train.Trainer(tiny_cnn(), tx, progress=False)
  with pytest.warns(UserWarning, match=r"6 batches per epoch .* steps_per_epoch=7 "):
    trainer.fit(digits_loader(), epochs=1)


def test_a_grown_batch_is_no_mismatch(tiny_cnn, digits_loader):
  # Built for the reference batch (6 steps of 16); the run doubles its batch after epoch 1,
  # so the loader has 3 batches per epoch from epoch 2 on, by design.
  loader = digits_loader()
  trainer = train.Trainer(
    tiny_cnn(), optax.chain(_told(6), train.sgd(0.05)), callbacks=[_Doubles()], progress=False
  )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    trainer.fit(loader, epochs=2)
    assert len(loader) == 3
    trainer.fit(loader, epochs=3)
