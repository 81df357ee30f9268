"""PruneTrain composed with the other methods: reconfiguration keeps SDGP's conversion and
slices ClickTrain's state; models rebuild themselves from a spec."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import clicktrain as ct
from jaxprune import data, models, sdgp, train
from jaxprune import prunetrain as pt
from jaxprune._states import find_states
from jaxprune.paths import path_string


def _loader(seed=0):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(32, 8, 8, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, size=32).astype(np.int32)
  dataset = data.Dataset.from_arrays(images, labels, num_classes=10)
  return data.Loader(dataset, 16, shuffle=True, seed=0, drop_last=True, prefetch=0)


def _small_resnet():
  """He et al. basic blocks, one per stage, widths 8/16/32 (multiples of SDGP's m = 4)."""
  return models.ResNet(
    models.prunetrain_resnet_spec(8).scaled(0.5), num_classes=10, rngs=nnx.Rngs(0)
  )


def _sdgp_convs(model):
  return {
    "/".join(map(str, path)): module
    for path, module in nnx.iter_modules(model)
    if isinstance(module, sdgp.SDGPConv)
  }


def _kill_inner_channels(model, stage, channels):
  """Zero ``channels`` of the block's inner tensor where written (conv1) and read (conv2)."""
  block = model.stages[stage][0]
  for kernel, axis in ((block.conv1.conv.kernel, 3), (block.conv2.conv.kernel, 2)):
    array = np.array(kernel[...])
    np.moveaxis(array, axis, 0)[list(channels)] = 0.0
    kernel[...] = array


def _kill_branch(model, stage):
  block = model.stages[stage][0]
  for conv in (block.conv1, block.conv2):
    conv.conv.kernel[...] = jnp.zeros_like(conv.conv.kernel[...])


class _Kill(train.Callback):
  """Before PruneTrain's hook runs, zero some groups at given epoch ends (what group lasso
  would do over many epochs)."""

  def __init__(self, plan):
    self.plan = plan

  def on_epoch_end(self, trainer, epoch):
    if epoch in self.plan:
      model = trainer.model
      self.plan[epoch](model)
      trainer.replace(model, trainer.opt_state)


def _sdgp_trainer(checkpoint_dir=None):
  model = sdgp.convert_model(_small_resnet(), n=2, m=4, method="mvue", seed=3)
  kill = _Kill(
    {
      1: lambda m: _kill_branch(m, 2),
      2: lambda m: _kill_inner_channels(m, 0, range(4)),
    }
  )
  callback = pt.PruneTrainCallback(every_epochs=1, image_shape=(8, 8, 3), dynamic_batch=False)
  tx = pt.with_group_lasso(train.sgd(0.02, momentum=0.9))
  return train.Trainer(
    model, tx, callbacks=[kill, callback], checkpoint_dir=checkpoint_dir, progress=False
  )


def _keys(model):
  return {
    path: np.asarray(jax.random.key_data(conv.sdgp_key[...]))
    for path, conv in _sdgp_convs(model).items()
  }


def _input_grad(model, x):
  """d sum(model(x)^2) / dx (nnx.grad: the SDGP keys advance under the trace)."""
  model = nnx.clone(model)  # the same keys for every call
  return nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=1)(model, x)


def test_sdgp_conversion_survives_two_reconfigurations():
  trainer = _sdgp_trainer()
  dense = trainer.model
  # 3 stages x (conv1, conv2) + 2 projections; the stem reads 3 channels and stays plain.
  assert len(_sdgp_convs(dense)) == 8
  fresh_keys = _keys(dense)
  history = trainer.fit(_loader(), None, epochs=3)
  assert [r.get("pt_reconfigured") for r in history] == [True, True, False]
  model = trainer.model
  # Epoch 1 removed stage 2's branch (2 convs), epoch 2 four channels of stage 0's inner
  # tensor; every remaining conv is still an SDGP conv with the same settings.
  convs = _sdgp_convs(model)
  assert sorted(convs) == sorted(
    p for p in _sdgp_convs(dense) if not p.startswith("stages/2/0/conv")
  )
  assert model.spec.stages[2].blocks[0].widths is None
  assert model.stages[0][0].conv1.conv.out_features == 4
  for conv in convs.values():
    assert (conv.n, conv.m, conv.method) == (2, 4, "mvue")
  assert models.applied_conversions(model) == models.applied_conversions(dense)
  # The keys came over from the trained model (they advance every step), not re-seeded.
  keys = _keys(model)
  assert all(not np.array_equal(keys[p], fresh_keys[p]) for p in keys)
  assert all(np.isfinite(r["train_loss"]) for r in history)
  assert history[2]["steps"] == 2


def test_resume_of_a_reconfigured_sdgp_model_rebuilds_its_sdgp_convs(tmp_path):
  trainer = _sdgp_trainer(tmp_path / "ckpt")
  trainer.fit(_loader(), None, epochs=1)  # reconfigured at the end of epoch 1, then saved
  model = trainer.model
  assert model.spec.stages[2].blocks[0].widths is None
  trainer.close()  # its folder goes to the next run, as at the end of its process
  # A fresh run (dense, converted) resuming from the checkpoint rebuilds the smaller model
  # converted, with the saved keys.
  resumed = _sdgp_trainer(tmp_path / "ckpt")
  assert resumed.restore_checkpoint()
  assert resumed.model.spec == model.spec
  assert sorted(_sdgp_convs(resumed.model)) == sorted(_sdgp_convs(model))
  assert len(_sdgp_convs(resumed.model)) == 6
  assert models.applied_conversions(resumed.model) == models.applied_conversions(model)
  keys, resumed_keys = _keys(model), _keys(resumed.model)
  assert all(np.array_equal(resumed_keys[p], keys[p]) for p in keys)


def test_reconfigure_carries_sdgp_keys_and_gradients():
  model = sdgp.convert_model(_small_resnet(), n=2, m=4, method="mvue", seed=3)
  _kill_inner_channels(model, 1, range(4, 12))
  new_model, _, report = pt.reconfigure(model, None, count_flops=False)
  assert report.channels_after["stages/1/0/conv1"] == 8
  old_keys, new_keys = _keys(model), _keys(new_model)
  assert sorted(old_keys) == sorted(new_keys)
  for path in old_keys:
    np.testing.assert_array_equal(new_keys[path], old_keys[path])

  # With a deterministic method and whole N:M groups removed (channels 4-11, m = 4), the
  # smaller model has the same function and the same SDGP input gradient.
  model = sdgp.convert_model(_small_resnet(), n=2, m=4, method="magnitude")
  _kill_inner_channels(model, 1, range(4, 12))
  new_model, _, _ = pt.reconfigure(model, None, count_flops=False)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 3)), jnp.float32)
  model.eval()
  new_model.eval()
  np.testing.assert_allclose(new_model(x), model(x), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(_input_grad(new_model, x), _input_grad(model, x), rtol=1e-4, atol=1e-5)


def test_sdgp_widths_stay_multiples_of_m():
  """One dead channel out of 8 is not removed: 7 is no multiple of m = 4."""
  model = sdgp.convert_model(_small_resnet(), n=2, m=4, method="magnitude")
  assert models.channel_multiple(model) == 4
  _kill_inner_channels(model, 0, [5])
  _, _, report = pt.reconfigure(model, None, count_flops=False)
  assert not report.changed
  _kill_inner_channels(model, 0, [1, 2, 6])
  new_model, _, report = pt.reconfigure(model, None, count_flops=False)
  assert report.channels_after["stages/0/0/conv1"] == 4
  assert len(_sdgp_convs(new_model)) == 8


# ----------------------------------------------------------------------------- ClickTrain


def _find(state, state_type):
  (found,) = find_states(state, state_type)
  return found


def _per_layer_ratios(model):
  """One ratio per pruned layer, in flatten order (alternately 0.4 and 0.5)."""
  flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(model, nnx.Param)))[0]
  chosen = [p for p, w in flat if ct.default_layer_filter(path_string(p), w.shape)]
  return [0.4 + 0.1 * (i % 2) for i in range(len(chosen))]


def _one_shot_clicktrain(ratio):
  return pt.with_group_lasso(
    ct.clicktrain(
      train.sgd(0.05, momentum=0.9),
      steps_per_epoch=len(_loader()),  # 2
      mode="one_shot",
      one_shot_epoch=0,
      hard_prune_epoch=1,
      kernel_prune_ratio=ratio,
    )
  )


@pytest.mark.parametrize("ratios", ["float", "by_name"])
def test_clicktrain_state_is_sliced_and_trains_on(ratios):
  model = _small_resnet()
  ratio = 0.5
  if ratios == "by_name":  # per layer, keyed by path, so it outlives the removed branch
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    ratio = ct.ratios_by_name(params, _per_layer_ratios(model))
  trainer = train.Trainer(model, _one_shot_clicktrain(ratio), progress=False)
  trainer.fit(_loader(), None, epochs=2)
  old_state = _find(trainer.opt_state, ct.ClickTrainState)
  assert ct.stage_name(old_state) == "pruned"  # masks final and applied

  model = trainer.model
  _kill_inner_channels(model, 0, [1, 5])
  _kill_branch(model, 2)
  new_model, new_opt_state, report = pt.reconfigure(model, trainer.opt_state, count_flops=False)
  assert report.removed_branches == ["stages/2/0"]
  assert report.channels_after["stages/0/0/conv1"] == 6

  # Kept channels by hand: stage 0's inner tensor loses 1 and 5; nothing else changes.
  kept = np.array([0, 2, 3, 4, 6, 7])
  expected_index = {
    "stages/0/0/conv1/conv/kernel": (None, kept),
    "stages/0/0/conv2/conv/kernel": (kept, None),
  }
  new_state = _find(new_opt_state, ct.ClickTrainState)
  removed = {"stages/2/0/conv1/conv/kernel", "stages/2/0/conv2/conv/kernel"}
  assert set(new_state.layers) == set(old_state.layers) - removed
  for path, new_layer in new_state.layers.items():
    in_index, out_index = expected_index.get(path, (None, None))

    def by_hand(array, in_axis, out_axis):
      array = np.asarray(array)
      if in_index is not None:
        array = array.take(in_index, axis=in_axis)
      if out_index is not None:
        array = array.take(out_index, axis=out_axis)
      return array

    old_layer = old_state.layers[path]
    for field in ("kernel_score_sum", "pattern_id", "kernel_keep"):
      np.testing.assert_array_equal(
        getattr(new_layer, field), by_hand(getattr(old_layer, field), 0, 1)
      )
    np.testing.assert_array_equal(new_layer.pattern_mask, by_hand(old_layer.pattern_mask, 2, 3))
  assert int(new_state.stage) == int(old_state.stage)

  # The sliced state fits the smaller model and trains on, pruned weights staying zero.
  sliced_masks = {path: np.asarray(layer.pattern_mask) for path, layer in new_state.layers.items()}
  trainer.replace(new_model, new_opt_state)  # (the train step donates the state's buffers)
  history = trainer.fit(_loader(), None, epochs=3)
  assert np.isfinite(history[-1]["train_loss"])
  params = nnx.as_pure(nnx.state(trainer.model, nnx.Param))
  weight_masks = ct.masks(trainer.opt_state, params)
  checked = 0
  for weight, mask in zip(
    jax.tree.leaves(params), jax.tree.leaves(weight_masks, is_leaf=lambda x: x is None)
  ):
    if mask is not None:
      assert np.all(np.asarray(weight)[np.asarray(mask) == 0] == 0)
      checked += 1
  assert checked == len(sliced_masks) == 4
  final = _find(trainer.opt_state, ct.ClickTrainState)
  for path, layer in final.layers.items():
    np.testing.assert_array_equal(layer.pattern_mask, sliced_masks[path])


def test_a_ratio_sequence_is_refused_once_a_reconfiguration_removes_a_pruned_layer():
  # A sequence is matched by position, so after the branch removal it no longer says which
  # ratio each remaining layer had: the new model is refused when it is installed, naming the
  # fix (before, the first init remembered the sequence by name in a closure).
  model = _small_resnet()
  trainer = train.Trainer(model, _one_shot_clicktrain(_per_layer_ratios(model)), progress=False)
  trainer.fit(_loader(), None, epochs=1)
  _kill_branch(trainer.model, 2)
  new_model, new_opt_state, report = pt.reconfigure(
    trainer.model, trainer.opt_state, count_flops=False
  )
  assert report.removed_branches == ["stages/2/0"]
  with pytest.raises(ValueError, match=r"kernel_prune_ratio=clicktrain\.ratios_by_name"):
    trainer.replace(new_model, new_opt_state)


# ----------------------------------------------------------------------------- rebuild


@pytest.mark.parametrize("name", ["prunetrain-vgg11", "sdgp-resnet9"])
def test_rebuild_with_the_same_spec_computes_the_same_function(name):
  model = models.create(name, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.125)
  if name == "sdgp-resnet9":
    model = sdgp.convert_model(model, n=1, m=2, method="magnitude")
  rebuilt = models.rebuild(model)
  assert rebuilt is not model and type(rebuilt) is type(model)
  assert rebuilt.spec == model.spec and rebuilt.num_classes == model.num_classes
  assert models.applied_conversions(rebuilt) == models.applied_conversions(model)
  assert sorted(_sdgp_convs(rebuilt)) == sorted(_sdgp_convs(model))
  nnx.update(rebuilt, nnx.state(model))
  model.eval()
  rebuilt.eval()
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 32, 32, 3)), jnp.float32)
  np.testing.assert_array_equal(rebuilt(x), model(x))
  if name == "sdgp-resnet9":  # the backward pass differs from a plain model's: compare it too
    np.testing.assert_array_equal(_input_grad(rebuilt, x), _input_grad(model, x))


@pytest.mark.parametrize("name", ["clicktrain-resnet18", "clicktrain-vgg11", "sdgp-resnet9"])
def test_with_widths_inverts_layer_widths_and_builds_those_widths(name):
  spec = models.default_spec(name).scaled(0.125)
  assert spec.with_widths(spec.layer_widths()) == spec
  # a layer whose width can change alone (an inner conv)
  path = {"clicktrain-vgg11": "features/0", "sdgp-resnet9": "res1/0"}.get(name, "stages/0/0/conv1")
  new = spec.with_widths({path: 3})
  assert new.layer_widths() == {**spec.layer_widths(), path: 3}
  model = nnx.eval_shape(
    lambda: models.rebuild(models.create(name, num_classes=10, rngs=nnx.Rngs(0), spec=spec), new)
  )
  module = model
  for part in path.split("/"):
    module = module[int(part)] if part.isdigit() else getattr(module, part)
  kernel = module.conv.kernel if hasattr(module, "conv") else module.kernel
  assert kernel.shape[-1] == 3


def test_with_widths_bad_input():
  for name in ("prunetrain-resnet50", "imagenet-resnet50", "prunetrain-vgg13"):
    spec = models.default_spec(name)
    assert spec.with_widths(spec.layer_widths()) == spec
  spec = models.prunetrain_resnet_spec(20)
  with pytest.raises(ValueError, match="widths: unknown layer paths"):
    spec.with_widths({"stages/0/0/conv9": 3})
  with pytest.raises(ValueError, match="same residual stream"):
    spec.with_widths({"stages/1/0/shortcut": 24, "stages/1/1/conv2": 20})
  # one writer named: the stream's other writers follow it
  assert spec.with_widths({"stages/1/0/shortcut": 24}).stages[1].width == 24
  with pytest.raises(ValueError, match="removed_blocks"):
    spec.with_widths({}, removed_blocks=["stages/5/0"])
  removed = spec.with_widths({}, removed_blocks=["stages/1/1"])
  assert removed.stages[1].blocks[1].widths is None
  assert "stages/1/1/conv1" not in removed.layer_widths()
  with pytest.raises(ValueError, match="removed_blocks"):
    models.prunetrain_vgg_spec(11).with_widths({}, removed_blocks=["features/0"])
  with pytest.raises(ValueError, match="model"):
    models.rebuild(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_record_conversion_needs_a_hashable_callable():
  @dataclasses.dataclass(frozen=True)
  class Tag:
    def __call__(self, model):
      return models.record_conversion(model, self)

  model = Tag()(_small_resnet())
  assert models.applied_conversions(models.rebuild(model)) == (Tag(),)

  @dataclasses.dataclass  # not frozen: unhashable, so it cannot sit in the graph definition
  class Mutable:
    def __call__(self, model):
      return model

  with pytest.raises(ValueError, match="hashable"):
    models.record_conversion(model, Mutable())
  with pytest.raises(ValueError, match="callable"):
    models.record_conversion(model, 3)
