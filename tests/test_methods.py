"""jaxprune.methods: every registered method trains a tiny model; the registry's errors."""

from __future__ import annotations

import math

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, methods, sdgp, train
from jaxprune.clicktrain import preset

EPOCHS = {"dense": 2, "sdgp": 2, "prunetrain": 2, "clicktrain": 5, "clicktrain-one-shot": 3}

# A tiny config for every registered method: ClickTrain's stages one epoch each (pool at 1,
# finalize at 2, regularize at 3, hard prune from 4), the one-shot masks at epoch 1 and the
# hard prune at 2; PruneTrain's reconfiguration check at the end of the run.
_CLICKTRAIN = {
  "pool_start_epoch": 1,
  "pool_epochs": 1,
  "finalize_epochs": 1,
  "hard_prune_epoch": 4,
  "kernel_prune_ratio": 0.5,
  "pool_size": 4,
}
_PRUNETRAIN = {"every_epochs": 2, "dynamic_batch": False}
_SDGP = {"n": 2, "m": 4, "method": "mvue"}
TINY = {
  "dense": {},
  "clicktrain": _CLICKTRAIN,
  "clicktrain-one-shot": {"one_shot_epoch": 1, "hard_prune_epoch": 2, "kernel_prune_ratio": 0.5},
  "prunetrain": _PRUNETRAIN,
  "sdgp": _SDGP,
  "prunetrain+sdgp": {**_PRUNETRAIN, **_SDGP, "method": "rescaled_magnitude"},
  "clicktrain+sdgp": {**_CLICKTRAIN, **_SDGP},
}


def _parts(name):
  return name.split("+")


def _sdgp_convs(model):
  return sum(isinstance(m, sdgp.SDGPConv) for _, m in nnx.iter_modules(model))


def test_every_registered_method_has_a_tiny_config():
  assert set(TINY) == set(methods.available())


@pytest.mark.parametrize("name", sorted(TINY))
def test_method_trains_a_tiny_model(name, tiny_cnn, tiny_resnet, digits_loader):
  method = methods.get(name, **TINY[name])
  assert method.name == name
  parts = _parts(name)
  epochs = max(EPOCHS[p] for p in parts)
  # PruneTrain rebuilds the model from its spec: a jaxprune.models ResNet.
  model = tiny_resnet() if "prunetrain" in parts else tiny_cnn()
  loader = digits_loader()
  run = methods.Run.from_loader(loader, epochs=epochs)
  assert run == methods.Run(steps_per_epoch=6, epochs=epochs, image_shape=(8, 8, 1))

  model = method.convert(model)
  # SDGP converts every conv but the 1-channel stem (the resnet: 2 convs x 3 blocks + 2
  # projections; the CNN: conv1, conv2); the other methods convert nothing.
  expected_convs = (8 if "prunetrain" in parts else 2) if "sdgp" in parts else 0
  assert _sdgp_convs(model) == expected_convs

  trainer = train.Trainer(
    model,
    method.make_tx(train.sgd(0.05, momentum=0.9), run),
    callbacks=method.callbacks(run),
    progress=False,
  )
  history = trainer.fit(loader, epochs=epochs)

  # Training metrics (train-mode BatchNorm): a few steps leave the running statistics of
  # evaluation far from the batch statistics.
  losses = [r["train_loss"] for r in history]
  assert all(math.isfinite(v) for v in losses)
  assert losses[-1] < losses[0]
  assert history[-1]["train_acc"] > 0.5  # 4 classes: chance is 0.25
  assert _sdgp_convs(trainer.model) == expected_convs
  if "prunetrain" in parts:
    # The callback accounted every epoch's costs and checked for dead channels at the end.
    assert all(r["pt_train_flops"] > 0 for r in history)
    assert "pt_reconfigured" in history[-1]
  if any(p.startswith("clicktrain") for p in parts):
    assert clicktrain.stage_name(trainer.opt_state) == "pruned"
    params = trainer.params
    pruned = 0
    for w, m in zip(
      _leaves(params), _leaves(clicktrain.masks(trainer.opt_state, params)), strict=True
    ):
      if m is not None:
        w, m = np.asarray(w), np.asarray(m)
        assert np.all(w[m == 0] == 0)
        pruned += int((m == 0).sum())
    assert pruned > 0


def _leaves(tree):
  return jax.tree.leaves(tree, is_leaf=lambda v: v is None)


# ----------------------------------------------------------------------------- the API


def test_presets_are_the_registered_methods():
  assert clicktrain.method(kernel_prune_ratio=0.3).config == {"kernel_prune_ratio": 0.3}
  assert methods.get("clicktrain-one-shot").config == {"mode": "one_shot"}
  assert methods.get("sdgp", method="magnitude").config["method"] == "magnitude"
  composite = methods.get("prunetrain+sdgp", n=1, penalty_ratio=0.5)
  assert composite.config == {
    "prunetrain": {"penalty_ratio": 0.5},
    "sdgp": methods.get("sdgp", n=1).config,
  }


def test_clicktrain_preset_places_its_schedule_in_the_run():
  run = methods.Run(steps_per_epoch=3, epochs=190)
  # The paper's hard prune at half the run, the released code's masks 30 epochs before it.
  assert preset._schedule({}, run) == {"hard_prune_epoch": 95}
  assert preset._schedule({"mode": "one_shot"}, run) == {
    "mode": "one_shot",
    "hard_prune_epoch": 95,
    "one_shot_epoch": 65,
  }
  assert preset._schedule({"hard_prune_epoch": 7}, run) == {"hard_prune_epoch": 7}


def _recording(name, log):
  def make_tx(inner, run):
    log.append(name)
    return optax.chain(optax.scale(2.0), inner)

  return methods.Method(
    name,
    make_tx=make_tx,
    convert=lambda model: log.append(f"convert {name}") or model,
    callbacks=lambda run: [name],
  )


def test_compose_nests_outermost_first():
  log = []
  both = methods.compose(_recording("a", log), _recording("b", log))
  assert both.name == "a+b"
  run = methods.Run(steps_per_epoch=1, epochs=1)
  tx = both.make_tx(optax.scale(3.0), run)
  assert log == ["b", "a"]  # b wraps the inner optimizer, a wraps b
  updates, _ = tx.update({"w": np.ones(2)}, tx.init({"w": np.ones(2)}))
  np.testing.assert_allclose(updates["w"], 12.0)  # 2 * 2 * 3
  assert both.convert("model") == "model" and log[2:] == ["convert b", "convert a"]
  assert both.callbacks(run) == ["a", "b"]
  with pytest.raises(ValueError, match="parts"):
    methods.compose(_recording("a", log))


def test_dense_method_is_the_inner_optimizer():
  inner = optax.sgd(0.1)
  dense = methods.get("dense")
  assert dense.make_tx(inner, methods.Run(steps_per_epoch=1, epochs=1)) is inner
  assert dense.convert("model") == "model"
  assert dense.callbacks(methods.Run(steps_per_epoch=1, epochs=1)) == []


def test_run_validation():
  for bad in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="steps_per_epoch"):
      methods.Run(steps_per_epoch=bad, epochs=1)
    with pytest.raises(ValueError, match="epochs"):
      methods.Run(steps_per_epoch=1, epochs=bad)
  with pytest.raises(ValueError, match="image_shape"):
    methods.Run(steps_per_epoch=1, epochs=1, image_shape=(8, 8))
  assert methods.Run(1, 1, image_shape=[8, 8, 1]).image_shape == (8, 8, 1)
  with pytest.raises(ValueError, match="image_shape"):
    methods.get("prunetrain").callbacks(methods.Run(steps_per_epoch=1, epochs=1))


def test_registry_errors(monkeypatch):
  monkeypatch.setattr(methods, "_REGISTRY", dict(methods._REGISTRY))
  with pytest.raises(ValueError, match=r"unknown method 'nope'; available: clicktrain, "):
    methods.get("nope")
  with pytest.raises(ValueError, match=r"already registered; registered: .*sdgp"):
    methods.register("sdgp", lambda: methods.Method("x"))
  for bad_name in ("", None):
    with pytest.raises(ValueError, match="name"):
      methods.register(bad_name, lambda: methods.Method("x"))
  with pytest.raises(ValueError, match="factory"):
    methods.register("mine", "not callable")
  for name, key in [
    ("sdgp", "penalty_ratio"),
    ("dense", "n"),
    ("prunetrain", "n"),
    ("clicktrain", "steps_per_epoch"),
    ("clicktrain+sdgp", "every_epochs"),
  ]:
    with pytest.raises(ValueError, match=rf"unknown config key\(s\) \['{key}'\] for method"):
      methods.get(name, **{key: 1})
  with pytest.raises(ValueError, match="mode"):
    methods.get("clicktrain-one-shot", mode="paper")
  with pytest.raises(ValueError, match="method must be one of"):
    methods.get("sdgp", method="bogus")

  methods.register("half-lr", lambda *, factor=0.5: methods.Method("h", config={"f": factor}))
  assert "half-lr" in methods.available()
  assert methods.get("half-lr", factor=0.25) == methods.Method("half-lr", config={"f": 0.25})
  with pytest.raises(ValueError, match=r"\['factr'\] for method 'half-lr'; accepted: factor"):
    methods.get("half-lr", factr=0.25)


class _MLP(nnx.Module):
  """A model without convolutions: what none of the pruning methods can prune."""

  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, 16, rngs=rngs)
    self.bn = nnx.BatchNorm(16, rngs=rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.bn(self.hidden(x.reshape(x.shape[0], -1)))))


@pytest.mark.parametrize(
  ("name", "config", "says"),
  [
    ("clicktrain", {}, r"clicktrain prunes conv kernels .* no 4-D kernel among its 6 param"),
    ("sdgp", {}, r"SDGP prunes .* nnx\.Conv with >= min_in_channels=4 .* no nnx\.Conv in _MLP"),
    ("prunetrain", {"every_epochs": 1}, r"PruneTrainCallback .* no width spec .* no nnx\.Conv"),
  ],
)
def test_methods_refuse_a_model_without_convs_before_training(name, config, says, digits_loader):
  # Before: ClickTrain trained on dense until a read-out found no conv kernels, SDGP returned
  # the model unchanged (a dense run under SDGP's name), PruneTrain failed epochs later.
  method, loader = methods.get(name, **config), digits_loader()
  run = methods.Run.from_loader(loader, epochs=2)
  trainer = None
  with pytest.raises(ValueError, match=says):
    model = method.convert(_MLP(nnx.Rngs(0)))
    trainer = train.Trainer(
      model, method.make_tx(optax.sgd(0.1), run), callbacks=method.callbacks(run), progress=False
    )
    trainer.fit(loader, epochs=2)
  assert trainer is None or trainer.step == 0  # refused at set-up: not one step trained
