"""The Trainer's settings after construction: a setting that is set takes effect (the next fit
trains as a trainer built with it would), one that could not take effect cannot be set; and
``evaluate(loader, params=..., rest=...)`` evaluates other arrays without touching the state."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune.train as jt


def _loaders(kit):
  images, labels = kit.data(48)
  return (
    kit.ArrayLoader(images, labels, 8, seed=3),
    kit.ArrayLoader(images[:16], labels[:16], 8, shuffle=False),
  )


def _half_loss(logits, labels):
  """Half the default loss: another gradient, so another trained model."""
  return 0.5 * optax.softmax_cross_entropy_with_integer_labels(logits, labels)


@pytest.mark.parametrize(
  ("name", "value"), [("loss_fn", _half_loss), ("flip_tta", True), ("skip_nonfinite", False)]
)
def test_a_setting_set_after_construction_takes_effect(kit, name, value):
  train, test = _loaders(kit)
  built_with = kit.trainer(**{name: value})
  set_later = kit.trainer()
  setattr(set_later, name, value)
  assert getattr(set_later, name) is value
  built_with.fit(train, test, epochs=1)
  set_later.fit(train, test, epochs=1)
  assert kit.strip_timing(set_later.history) == kit.strip_timing(built_with.history)
  kit.assert_trees_equal(set_later.params, built_with.params)


def test_a_changed_loss_trains_another_model(kit):
  # The check above is not vacuous: the default loss trains other params than _half_loss.
  train, _ = _loaders(kit)
  half, default = kit.trainer(loss_fn=_half_loss), kit.trainer()
  half.fit(train, epochs=1)
  default.fit(train, epochs=1)
  leaves = zip(jax.tree.leaves(half.params), jax.tree.leaves(default.params))
  assert any(not np.allclose(a, b) for a, b in leaves)


@pytest.mark.parametrize(
  ("name", "why"),
  [
    ("tx", "the optimizer state was made by it"),
    ("mesh", "the trained state is placed for it"),
    ("sync_batchnorm", "the trained state is placed for it"),
    ("batch_size", "Trainer.set_batch_size"),
    ("store", "build a new Trainer"),
    ("run_config", "build a new Trainer"),
    ("model", "Trainer.replace"),
    ("params", r"Trainer.evaluate\(loader, params=..., rest=...\)"),
    ("lr", "follows from the trainer's state"),
  ],
)
def test_a_setting_that_could_not_take_effect_cannot_be_set(kit, name, why):
  trainer = kit.trainer()
  before = getattr(trainer, name)
  with pytest.raises(AttributeError, match=rf"Trainer.{name} cannot be set: .*{why}"):
    setattr(trainer, name, optax.sgd(0.5) if name == "tx" else before)
  assert getattr(trainer, name) is before or getattr(trainer, name) == before


def test_evaluate_other_params_leaves_the_trainer_as_it_was(kit):
  train, test = _loaders(kit)
  trainer = kit.trainer()
  trainer.fit(train, epochs=1)
  masked = jax.tree.map(lambda p: p * (np.abs(p) > 0.1), trainer.params)
  own = trainer.evaluate(test)
  other = trainer.evaluate(test, params=masked)
  # Independent: a trainer built on a model that holds the masked params.
  model = nnx.clone(trainer.model)
  nnx.update(model, masked)
  assert other == kit.trainer(model).evaluate(test)
  assert other != own
  assert trainer.evaluate(test) == own  # the trained state is untouched
