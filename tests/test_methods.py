"""jaxprune.methods: every registered method trains a tiny model; the registry's errors."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, methods, sdgp, train
from jaxprune.clicktrain import preset
from jaxprune.clicktrain.execution import (
  AlignedConv,
  PatternConv,
  SparseExecution,
  pattern_convs,
)

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)

# A tiny config for every registered method, scheduled to reach its steady state within the
# run: ClickTrain's stages one epoch each (pool at 1, finalize at 2, regularize at 3, hard
# prune at the end of 4), the one-shot masks at epoch 1 and the hard prune at the end of 2;
# each ClickTrain run then switches the pruned convs to the sparse layers (the test attaches
# SparseExecution at threshold 0: every pruned conv converts, whatever the timings, so the
# preset's measuring one stays off) and trains two more epochs on them: clicktrain and
# clicktrain+sdgp on the fine-grained PatternConv, clicktrain-one-shot in the aligned mode
# (AlignedConv, 2 filter groups). PruneTrain's runs start with four dead stream channels (a
# whole group of SDGP's m = 4, which its reconfiguration keeps widths a multiple of); the group
# lasso in its proximal form keeps them at exactly zero, the first reconfiguration removes them
# and the rebuilt model trains on.
_CLICKTRAIN = {
  "pool_start_epoch": 1,
  "pool_epochs": 1,
  "finalize_epochs": 1,
  "hard_prune_epoch": 4,
  "kernel_prune_ratio": 0.5,
  "pool_size": 4,
}
_PRUNETRAIN = {
  "every_epochs": 1,
  "dynamic_batch": False,
  "proximal": True,
  "penalty_ratio": 0.99,
}
_SDGP = {"n": 2, "m": 4, "method": "mvue"}
TINY = {
  "dense": {},
  "clicktrain": _CLICKTRAIN,
  "clicktrain-one-shot": {
    "one_shot_epoch": 1,
    "hard_prune_epoch": 2,
    "kernel_prune_ratio": 0.5,
    "filter_groups": 2,
    "sparse_execution": False,
  },
  "prunetrain": _PRUNETRAIN,
  "sdgp": _SDGP,
  "prunetrain+sdgp": {**_PRUNETRAIN, **_SDGP, "method": "rescaled_magnitude"},
  "clicktrain+sdgp": {**_CLICKTRAIN, **_SDGP},
}
EPOCHS = {"dense": 2, "sdgp": 2, "prunetrain": 3, "clicktrain": 6, "clicktrain-one-shot": 4}
# Each method trains end to end once in the suite, in float32 or in bfloat16 (parameters,
# BatchNorm statistics and optimizer state float32 either way): every paper's methods run in
# both, so a dtype bug in a paper's code fails one of its rows.
DTYPE = {
  "dense": F32,
  "clicktrain": BF16,
  "clicktrain-one-shot": F32,
  "clicktrain+sdgp": F32,
  "prunetrain": F32,
  "prunetrain+sdgp": BF16,
  "sdgp": BF16,
}


def _assert_learned(history):
  """Finite losses that fell, and training accuracy above chance; returns the losses."""
  losses = [r["train_loss"] for r in history]
  assert all(math.isfinite(v) for v in losses)
  assert losses[-1] < losses[0]
  assert history[-1]["train_acc"] > 0.5  # 4 classes: chance is 0.25
  return losses


def _parts(name):
  return name.split("+")


def _sdgp_convs(model):
  return sum(isinstance(m, sdgp.SDGPConv) for _, m in nnx.iter_modules(model))


def _compute_dtype(module):
  """A module's compute dtype (``None``: the float32 of its inputs)."""
  return jnp.dtype(module.dtype or F32)


def _float_dtypes(tree):
  return {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)}


def _sdgp_layers(model):
  """Convs whose conv function is SDGP's (an SDGPConv, or a sparse layer that kept it)."""
  return sum(
    isinstance(getattr(m, "conv_general_dilated", None), sdgp.PrunedDataGradient)
    for _, m in nnx.iter_modules(model)
  )


def _conv_channels(model):
  return sum(m.kernel.shape[-1] for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Conv))


def test_every_registered_method_has_a_tiny_config_and_a_dtype():
  assert set(TINY) == set(DTYPE) == set(methods.available())


@pytest.mark.parametrize("name", sorted(TINY))
def test_method_trains_a_tiny_model(
  name, tiny_cnn, tiny_resnet, digits_loader, scale_stream_channel
):
  parts, config, dtype = _parts(name), TINY[name], DTYPE[name]
  method = methods.get(name, **config)
  assert method.name == name
  epochs = max(EPOCHS[p] for p in parts)
  # PruneTrain rebuilds the model from its spec: a jaxprune.models ResNet.
  build = tiny_resnet if "prunetrain" in parts else tiny_cnn
  loader = digits_loader()
  run = methods.Run.from_loader(loader, epochs=epochs)
  assert run == methods.Run(steps_per_epoch=6, epochs=epochs, image_shape=(8, 8, 1))

  model = method.convert(build(dtype=None if dtype == F32 else dtype))
  # SDGP converts every conv but the 1-channel stem (the resnet: 2 convs x 3 blocks + 2
  # projections; the CNN: conv1, conv2); the other methods convert nothing.
  expected_convs = (8 if "prunetrain" in parts else 2) if "sdgp" in parts else 0
  assert _sdgp_convs(model) == expected_convs
  if "prunetrain" in parts:
    scale_stream_channel(model, slice(4, 8), 0.0)
  channels, sdgp_layers = _conv_channels(model), _sdgp_layers(model)
  callbacks = method.callbacks(run)
  clicktrains = any(p.startswith("clicktrain") for p in parts)
  groups = config.get("filter_groups")
  if clicktrains:
    callbacks.append(SparseExecution(threshold=0.0, backend="reference", filter_groups=groups))
  trainer = train.Trainer(
    model,
    method.make_tx(train.sgd(0.05, momentum=0.9), run),
    callbacks=callbacks,
    progress=False,
  )
  history = trainer.fit(loader, epochs=epochs)

  # Training metrics (train-mode BatchNorm): a few steps leave the running statistics of
  # evaluation far from the batch statistics.
  losses = _assert_learned(history)
  # The compute dtype all along; float32 parameters, statistics and optimizer state.
  convs = [m for _, m in nnx.iter_modules(trainer.model) if isinstance(m, nnx.Conv)]
  assert convs and {_compute_dtype(m) for m in convs} == {dtype}
  assert _float_dtypes(nnx.state(trainer.model, nnx.Param)) == {F32}
  assert _float_dtypes(nnx.state(trainer.model, nnx.BatchStat)) == {F32}
  assert _float_dtypes(trainer.opt_state) == {F32}
  # SDGP's pruned data gradients stay (also under the sparse layers, which keep its wrapper).
  assert _sdgp_layers(trainer.model) == sdgp_layers and (sdgp_layers > 0) == ("sdgp" in parts)
  if clicktrains:
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
    # Converted once, at the epoch end where the stage became "pruned"; two epochs after it
    # trained the sparse layers without the loss rising.
    counts = [r["sparse_layers"] for r in history]
    switched = counts.index(2)  # conv1 and conv2, from then on
    assert counts == [0] * switched + [2] * (len(counts) - switched)
    assert switched <= len(history) - 3 and history[switched]["ct_hard_prune"]
    sparse = pattern_convs(trainer.model)
    assert len(sparse) == 2
    layer = PatternConv if groups is None else AlignedConv
    assert all(isinstance(m, layer) and _compute_dtype(m) == dtype for m in sparse.values())
    assert losses[-1] <= losses[switched + 1]
  if "prunetrain" in parts:
    # The callback accounted every epoch's costs; the first reconfiguration removed the dead
    # channels where written (stem, block conv2), and the smaller model trained on.
    assert all(r["pt_train_flops_total"] > 0 for r in history)
    assert history[0]["pt_reconfigured"] and history[0]["pt_channels_removed"] == 8
    assert _conv_channels(trainer.model) == channels - 8
    assert trainer.model.spec.stem_width == 4
    assert _compute_dtype(trainer.model) == dtype


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
  from jaxprune.clicktrain import Schedule

  # The paper's hard prune at half the run, the released code's masks 30 epochs before it.
  paper = Schedule.for_run(3, 190)
  assert (paper.steps_per_epoch, paper.hard_prune_epoch, paper.total_epochs) == (3, 95, 190)
  one_shot = Schedule.for_run(3, 190, mode="one_shot")
  assert (one_shot.hard_prune_epoch, one_shot.one_shot_epoch) == (95, 65)
  assert Schedule.for_run(3, 190, hard_prune_epoch=7).hard_prune_epoch == 7


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
  ],
)
def test_methods_refuse_a_model_without_convs_before_training(name, config, says, digits_loader):
  # Before: ClickTrain trained on dense until a read-out found no conv kernels, SDGP returned
  # the model unchanged (a dense run under SDGP's name), PruneTrain failed epochs later.
  method, loader = methods.get(name, **config), digits_loader()
  run = methods.Run.from_loader(loader, epochs=2)
  trainer = None
  # ClickTrain's preset also says, rightly, that 2 epochs end before its hard prune.
  expected = (
    pytest.warns(RuntimeWarning, match="ends before its hard prune")
    if name == "clicktrain"
    else contextlib.nullcontext()
  )
  with expected, pytest.raises(ValueError, match=says):
    model = method.convert(_MLP(nnx.Rngs(0)))
    trainer = train.Trainer(
      model, method.make_tx(optax.sgd(0.1), run), callbacks=method.callbacks(run), progress=False
    )
    trainer.fit(loader, epochs=2)
  assert trainer is None or trainer.step == 0  # refused at set-up: not one step trained


class _HandResNet(nnx.Module):
  """A user's small ResNet (nothing from jaxprune.models): stem, one residual block, head."""

  def __init__(self, rngs):
    self.stem = nnx.Conv(1, 8, (3, 3), use_bias=False, rngs=rngs)
    self.stem_bn = nnx.BatchNorm(8, rngs=rngs)
    self.a = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
    self.a_bn = nnx.BatchNorm(8, rngs=rngs)
    self.b = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
    self.b_bn = nnx.BatchNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem_bn(self.stem(x)))
    y = self.b_bn(self.b(nnx.relu(self.a_bn(self.a(x)))))
    return self.head(nnx.relu(x + y).mean((1, 2)))


def test_clicktrain_composed_with_prunetrain_trains_through_reconfigurations(digits_loader):
  """compose(ClickTrain in the aligned mode, PruneTrain with its dynamic mini-batch) on a
  hand-written model: PruneTrain removes the dead channels and grows the batch from 16 to 24
  (90 images: 5 steps, then 3, which the batch ratio 1.5 counts as 4.5 reference steps),
  ClickTrain's state is sliced with the channels and its stages still change at the
  trainer's epochs, the hard prune's masks hold (pruned weights exactly zero) through a later
  reconfiguration, and the layers run aligned after it.

  Before: the aligned layers failed to build on the groups the reconfiguration left uneven
  ("All input arrays must have the same shape"), and the stages fell an epoch behind."""
  from experiments.common import masks as kill

  loader = digits_loader(n=90)
  method = methods.compose(
    methods.get("clicktrain", **_CLICKTRAIN, filter_groups=2, sparse_execution=False),
    methods.get(
      "prunetrain", every_epochs=1, proximal=True, granularity=8, max_batch_size=24
    ),
  )
  run = methods.Run.from_loader(loader, epochs=6)
  model = _HandResNet(nnx.Rngs(0))
  kill.kill_channels(model, 0.5, input_shape=(1, 8, 8, 1))
  callbacks = [
    *method.callbacks(run),
    # The groups as ClickTrain's state holds them (what the preset attaches): the
    # reconfiguration leaves some groups with fewer filters than others.
    SparseExecution(threshold=0.0, backend="reference", filter_groups="from_state"),
  ]
  tx = method.make_tx(train.sgd(0.05, momentum=0.9), run)
  trainer = train.Trainer(method.convert(model), tx, callbacks=callbacks, progress=False)
  history = trainer.fit(loader, epochs=6)

  records = [(r["batch_size"], r["ct_stage"], bool(r["pt_reconfigured"])) for r in history]
  assert records[0] == (16, "pool", True)  # the dead channels go at the first epoch end
  assert [r[0] for r in records[1:]] == [24] * 5
  # The stages the schedule sets, at the trainer's epochs: pool 1, finalize 1, regularize
  # until the hard prune at the end of epoch 4.
  assert [r[1] for r in records] == ["pool", "finalize", "regularize", "pruned", "pruned", "pruned"]
  assert history[3]["ct_hard_prune"]
  _assert_learned(history)
  assert _conv_channels(trainer.model) < 24
  for w, m in zip(
    _leaves(trainer.params), _leaves(clicktrain.masks(trainer.opt_state, trainer.params)), strict=True
  ):
    if m is not None:
      assert np.all(np.asarray(w)[np.asarray(m) == 0] == 0)
  assert {type(m) for m in pattern_convs(trainer.model).values()} == {AlignedConv}
