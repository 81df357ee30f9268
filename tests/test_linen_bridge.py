"""Linen modules through ``nnx.bridge.ToNNX``: what works, and what is refused up front by name."""

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge

from jaxprune import prunetrain, sdgp, train
from jaxprune.linen_bridge import bridged_modules


class _LinenCNN(nn.Module):
  batchnorm: bool = True

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    if self.batchnorm:
      x = nn.BatchNorm(use_running_average=not train)(x)
    x = nn.Conv(8, (3, 3))(nn.relu(x))
    return nn.Dense(4)(nn.relu(x).mean((1, 2)))


def _bridged(batchnorm=True):
  model = bridge.ToNNX(_LinenCNN(batchnorm=batchnorm), rngs=nnx.Rngs(0))
  bridge.lazy_init(model, jnp.zeros((1, 8, 8, 1)))
  return model


class _Outer(nnx.Module):
  def __init__(self):
    self.backbone = _bridged()
    self.head = nnx.Linear(4, 2, rngs=nnx.Rngs(0))

  def __call__(self, x):
    return self.head(self.backbone(x))


def test_bridges_are_found_with_their_state():
  assert bridged_modules(_bridged()) == {"(the model)": ("BatchStat",)}
  assert bridged_modules(_bridged(batchnorm=False)) == {"(the model)": ()}
  assert bridged_modules(_Outer()) == {"backbone": ("BatchStat",)}


def test_trainer_refuses_a_bridged_batchnorm_before_any_step():
  # Before: Flax stopped the first step with "collection batch_stats is immutable".
  with pytest.raises(ValueError, match=r"nnx.bridge.ToNNX at backbone \(keeps BatchStat\)"):
    train.Trainer(_Outer(), train.sgd(0.1), progress=False)


def test_trainer_trains_a_bridged_model_of_parameters_and_its_group_lasso(digits_loader):
  model = _bridged(batchnorm=False)
  params = nnx.state(model, nnx.Param)
  # Linen's names: Conv_0 is the stem (input channels not penalised), Dense_0 the classifier.
  w = {k: np.asarray(params[k]["kernel"], np.float64) for k in ("Conv_0", "Conv_1", "Dense_0")}
  norms = lambda a, axis: np.sqrt(  # noqa: E731
    np.sum(a**2, axis=tuple(i for i in range(a.ndim) if i != axis)) + prunetrain.EPSILON
  )
  expected = (
    norms(w["Conv_0"], 3).sum()
    + norms(w["Conv_1"], 3).sum()
    + norms(w["Conv_1"], 2).sum()
    + norms(w["Dense_0"], 0).sum()
  )
  np.testing.assert_allclose(float(prunetrain.penalty(params)), expected, rtol=1e-6)
  trainer = train.Trainer(model, prunetrain.with_group_lasso(train.sgd(0.05)), progress=False)
  history = trainer.fit(digits_loader(n=32, batch_size=16), None, epochs=1)
  assert np.isfinite(history[-1]["train_loss"])


def test_prunetrain_reconfiguration_refuses_the_bridge_by_name(digits_loader):
  # Before: "'dict' object has no attribute 'BatchNorm_0'", or a width error, after an epoch.
  with pytest.raises(ValueError, match=r"ToNNX .* reconfiguration rebuilds NNX layers"):
    prunetrain.reconfigure(_bridged(batchnorm=False), input_shape=(1, 8, 8, 1))
  callback = prunetrain.PruneTrainCallback(every_epochs=1, image_shape=(8, 8, 1))
  trainer = train.Trainer(
    _bridged(batchnorm=False),
    prunetrain.with_group_lasso(train.sgd(0.05)),
    callbacks=[callback],
    progress=False,
  )
  with pytest.raises(ValueError, match="with_group_lasso without PruneTrainCallback"):
    trainer.fit(digits_loader(n=32, batch_size=16), None, epochs=1)
  assert trainer.step == 0  # refused before the first step


def test_sdgp_refuses_the_bridge_and_names_sdgp_conv():
  # Before: "a model without convolutions", about a model of Linen convs.
  with pytest.raises(ValueError, match=r"ToNNX .*jaxprune\.sdgp\.sdgp_conv"):
    sdgp.convert_model(_bridged(batchnorm=False), n=2, m=4, method="magnitude")
