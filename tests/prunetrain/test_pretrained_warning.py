"""PruneTrain's λ from the penalty ratio on a model that already fits (fine-tuning): said before
the first step (PruneTrain Eq. 3 sets λ from CE₀, which a pretrained model makes small)."""

import warnings

import optax
from flax import nnx

from jaxprune import methods, prunetrain, train


def _notes(model, loader, tx=None):
  """The 'pretrained' warnings of one epoch of PruneTrain on ``model`` (λ from the ratio, or
  the ``tx`` given)."""
  method = methods.get("prunetrain", every_epochs=4, dynamic_batch=False)
  run = methods.Run.from_loader(loader, epochs=1)
  if tx is None:
    tx, callbacks = method.make_tx(train.sgd(0.0), run), method.callbacks(run)
  else:
    callbacks = [
      prunetrain.PruneTrainCallback(every_epochs=4, image_shape=(8, 8, 1), dynamic_batch=False)
    ]
  trainer = train.Trainer(model, tx, callbacks=callbacks, progress=False)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.fit(loader, None, epochs=1)
  return [str(w.message) for w in caught if "pretrained" in str(w.message)]


def test_a_model_that_already_fits_is_named_before_its_weak_lambda(tiny_resnet, digits_loader):
  loader = digits_loader(n=64, batch_size=16)
  pretrain = train.Trainer(tiny_resnet(), train.sgd(0.1, momentum=0.9), progress=False)
  pretrain.fit(loader, None, epochs=5)
  assert pretrain.evaluate(loader)["test_loss"] < 0.5 * 1.386  # it fits: under half of ln(4)
  fitted = nnx.state(pretrain.model)
  notes = _notes(pretrain.model, loader)
  assert len(notes) == 1 and "ln(4) = 1.386" in notes[0] and "add_group_lasso" in notes[0]
  # λ set by hand: nothing to say
  model = tiny_resnet()
  nnx.update(model, fitted)
  assert _notes(model, loader, optax.chain(prunetrain.add_group_lasso(1e-3), train.sgd(0.0))) == []


def test_a_fresh_model_gets_no_word(tiny_resnet, digits_loader):
  assert _notes(tiny_resnet(), digits_loader(n=64, batch_size=16)) == []
