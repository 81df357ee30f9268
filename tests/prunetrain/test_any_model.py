"""PruneTrain on models the library did not build: the traced channel graph, reconfiguration of
hand-written NNX models, the whole loop, and resume after a reconfiguration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.common import masks
from experiments.prunetrain.architectures import (
  ARCHITECTURES,
  INPUTS,
  FlattenCNN,
  ProjectionResNet,
  example_input,
  input_spec,
)
from jaxprune import data, methods, models, train
from jaxprune import prunetrain as pt

_SHAPE = (1, 32, 32, 3)


def _outputs(model, x):
  """Eval- and train-mode outputs, on clones (train mode updates the running statistics)."""
  out = {}
  for mode in ("eval", "train"):
    clone = nnx.clone(model)
    getattr(clone, mode)()
    out[mode] = np.asarray(clone(x))
  return out


# The language model's surgery (a dead kv head and units, traced from token ids) is checked
# exactly in test_transformers.py; here it is slow.
@pytest.mark.parametrize(
  "name",
  [pytest.param(n, marks=pytest.mark.slow) if n in INPUTS else n for n in ARCHITECTURES],
)
def test_reconfigured_model_computes_the_zeroed_model(name):
  """Every prunable group loses half its channels (kernels zeroed wherever the group runs);
  the smaller model gives the zeroed model's outputs in eval and train mode."""
  model = ARCHITECTURES[name](nnx.Rngs(0))
  shape, dtype, _ = input_spec(name)
  masks.kill_channels(model, 0.5, input_shape=shape, input_dtype=dtype)
  x, _ = example_input(name, jax.random.key(1), 4)
  want = _outputs(model, x)
  new, _, report = pt.reconfigure(
    model, None, input_shape=shape, input_dtype=dtype, count_flops=False
  )
  assert report.params_after < report.params_before
  got = _outputs(new, x)
  for mode in want:
    np.testing.assert_allclose(got[mode], want[mode], rtol=1e-5, atol=1e-5)
  # A clone: the given model keeps its widths.
  assert pt.channel_graph(model, shape, input_dtype=dtype).prunable[0].width > 0
  assert (
    sum(np.size(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))) == report.params_before
  )


def test_graph_follows_residual_add_concat_depthwise_and_flatten():
  """Groups counted by hand for three of the hand-written models."""
  graph = pt.channel_graph(
    ARCHITECTURES["hand-written ResNet (projection shortcuts)"](nnx.Rngs(0)), _SHAPE
  )
  # The stem's output (read by block 0's first conv and projection), block 0's inner tensor,
  # block 0's sum (its last conv and projection write it), block 1's inner tensor, block 1's
  # sum (read by the fc): 5 groups.
  widths = sorted(g.width for g in graph.prunable)
  assert widths == [16, 16, 16, 32, 32]
  stream = next(
    g
    for g in graph.prunable
    if any(u.name == "blocks/1/proj/kernel" and u.axis == 3 for u in g.uses)
  )
  names = {(u.name, u.axis) for u in stream.uses}
  assert {("blocks/1/b/kernel", 3), ("fc/kernel", 0), ("blocks/1/b_bn/mean", 0)} <= names
  # Depthwise: the expansion's channels pass through the depthwise conv (one group).
  graph = pt.channel_graph(
    ARCHITECTURES["MobileNetV2 inverted residual (depthwise)"](nnx.Rngs(0)), _SHAPE
  )
  hidden = next(g for g in graph.prunable if g.width == 64)
  assert {(u.name, u.axis) for u in hidden.kernels} == {
    ("expand/kernel", 3),
    ("depthwise/kernel", 3),
    ("project/kernel", 2),
  }
  # Concatenation: layer 2 reads the stem's 8 channels at offset 0 and layer 0's 8 at 8.
  graph = pt.channel_graph(ARCHITECTURES["DenseNet-style concatenation"](nnx.Rngs(0)), _SHAPE)
  layer0 = next(
    g for g in graph.prunable if ("layers/0/kernel", 3) in {(u.name, u.axis) for u in g.uses}
  )
  use = next(u for u in layer0.uses if u.name == "layers/2/kernel" and u.axis == 2)
  np.testing.assert_array_equal(use.coords, [-1] * 8 + list(range(8)) + [-1] * 8)
  # Flatten into a Linear: channel c is every width-th row of the hidden Linear.
  graph = pt.channel_graph(FlattenCNN(nnx.Rngs(0)), _SHAPE)
  conv = next(g for g in graph.prunable if g.width == 8)
  use = next(u for u in conv.uses if u.name == "hidden/kernel")
  np.testing.assert_array_equal(use.coords, np.tile(np.arange(8), 64))


def test_layernorm_and_unfollowed_operations_block_their_groups_by_name():
  graph = pt.channel_graph(
    ARCHITECTURES["ConvNeXt block (7x7 depthwise, LayerNorm, MLP)"](nnx.Rngs(0)), _SHAPE
  )
  assert [g.width for g in graph.prunable] == [64]  # the MLP's hidden units
  stream = next(g for g in graph.blocked if g.width == 16)
  assert any(r.startswith("normalized: reduce_sum over the channels") for r in stream.blocked)
  graph = pt.channel_graph(
    ARCHITECTURES["ShuffleNet unit (grouped 1x1, channel shuffle)"](nnx.Rngs(0)), _SHAPE
  )
  assert any("channel shuffle" in r for g in graph.blocked for r in g.blocked)
  assert graph.unfollowed()


class _GroupNormNet(nnx.Module):
  def __init__(self, rngs, groups):
    self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.gn = nnx.GroupNorm(8, num_groups=groups, rngs=rngs)
    self.c2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
    self.fc = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.fc(nnx.relu(self.c2(nnx.relu(self.gn(self.c1(x))))).mean((1, 2)))


@pytest.mark.parametrize(
  ("groups", "dead", "width", "num_groups"),
  [
    (2, [0, 1, 2, 3], 4, 1),  # a whole GroupNorm group dead: it goes, with one group fewer
    (2, [0], 8, 2),  # one channel of a group: its statistics need it, so it stays
    (8, [2], 7, 7),  # one channel per group (instance norm): a channel is a group
  ],
)
def test_groupnorm_loses_whole_groups_only(groups, dead, width, num_groups):
  """GroupNorm's statistics are taken over each group's channels: the graph splits its
  channels into (group, channel in group) and only whole groups are prunable; the cut model
  computes the zeroed one with ``num_groups`` reduced."""
  model = _GroupNormNet(nnx.Rngs(0), groups)
  for var, index in [
    (model.c1.kernel, (..., dead)),
    (model.c1.bias, (dead,)),
    (model.gn.scale, (dead,)),
    (model.gn.bias, (dead,)),
    (model.c2.kernel, (slice(None), slice(None), dead)),
  ]:
    var[...] = var[...].at[index].set(0.0)
  shape = (1, 8, 8, 3)
  blocked = [g.blocked for g in pt.channel_graph(model, shape).groups if g.width == 8 // groups]
  if groups == 2:  # the channels within a group are a statistic's: named as such
    assert any("normalized" in reason for reasons in blocked for reason in reasons)
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  want = _outputs(model, x)
  new, _, _ = pt.reconfigure(model, None, input_shape=shape, count_flops=False)
  assert (new.c1.kernel.shape[-1], new.gn.num_features, new.gn.num_groups) == (
    width,
    width,
    num_groups,
  )
  got = _outputs(new, x)
  for mode in want:
    np.testing.assert_allclose(got[mode], want[mode], rtol=1e-5, atol=1e-5)


class _StridedChannels(nnx.Module):
  """A conv whose channels are read every ``stride``-th from ``start`` by the next conv."""

  def __init__(self, rngs, start, stride, width=12):
    self.start, self.stride = start, stride
    self.c1 = nnx.Conv(3, width, (3, 3), rngs=rngs)
    self.c2 = nnx.Conv(len(range(start, width, stride)), 4, (3, 3), rngs=rngs)

  def __call__(self, x):
    return self.c2(nnx.relu(self.c1(x))[..., self.start :: self.stride]).mean((1, 2))


@pytest.mark.parametrize(("start", "stride"), [(0, 2), (1, 2), (2, 3), (3, 2), (2, 4)])
def test_a_strided_channel_slice_is_followed_in_blocks_of_its_stride(start, stride):
  """``x[..., start::stride]``: output channel j is input channel ``start + j * stride``; the
  group is c2's inputs, and it owns c1's channels in blocks of ``stride`` that hold them (the
  other channels of a block are read by nobody; channels outside the blocks belong to no group
  of c2's). Killing the group's blocks removes them whole, and the cut model computes the
  zeroed one."""
  model = _StridedChannels(nnx.Rngs(0), start, stride)
  shape = (1, 8, 8, 3)
  graph = pt.channel_graph(model, shape)
  assert not graph.unfollowed()
  width = len(range(start, 12, stride))
  group = next(g for g in graph.prunable if g.width == width)
  use = next(u for u in group.uses if u.name == "c1/kernel")
  block = np.repeat(np.arange(width), stride)
  begin = min(start, 12 - block.size)  # the first blocks that fit
  np.testing.assert_array_equal(use.coords[begin : begin + block.size], block)
  assert (np.delete(use.coords, np.arange(begin, begin + block.size)) == -1).all()
  assert (use.coords[start::stride] == np.arange(width)).all()
  dead = [0, width - 2]
  c1 = np.array(model.c1.kernel[...])
  c1[..., np.isin(use.coords, dead)] = 0.0
  model.c1.kernel[...] = c1
  model.c1.bias[...] = jnp.where(np.isin(use.coords, dead), 0.0, model.c1.bias[...])
  c2 = np.array(model.c2.kernel[...])
  c2[:, :, dead] = 0.0
  model.c2.kernel[...] = c2
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 3))
  want = _outputs(model, x)
  new, _, _ = pt.reconfigure(model, None, input_shape=shape, count_flops=False)
  assert new.c1.kernel.shape[-1] <= 12 - len(dead) * stride
  assert new.c2.kernel.shape[2] == width - len(dead)
  got = _outputs(new, x)
  for mode in want:
    np.testing.assert_allclose(got[mode], want[mode], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("start", "stop", "stride"), [(0, 12, 5), (1, 12, 7), (0, 12, 8)])
def test_a_strided_slice_whose_last_block_runs_past_the_axis_blocks_its_group_by_name(
  start, stop, stride
):
  """The slice's blocks of ``stride`` channels do not fit in the axis: not followed, and c1's
  channels are blocked and named."""

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.c1 = nnx.Conv(3, 12, (3, 3), rngs=rngs)
      self.c2 = nnx.Conv(len(range(start, stop, stride)), 4, (3, 3), rngs=rngs)

    def __call__(self, x):
      return self.c2(nnx.relu(self.c1(x))[..., start:stop:stride]).mean((1, 2))

  graph = pt.channel_graph(Net(nnx.Rngs(0)), (1, 8, 8, 3))
  assert "unfollowed: a strided slice of the axis" in graph.unfollowed()
  assert not any(u.name == "c1/kernel" for g in graph.prunable for u in g.uses)


# The full-width ResNet-50 and ClickTrain's VGG-11 take most of the time; the same surgery and
# rebuild run on a residual network (ResNet-20), a VGG and an SDGP ResNet-9 by default, and
# bottleneck blocks are sliced exactly in test_reconfigure.py.
_SLOW_ZOO = ("prunetrain-resnet50", "clicktrain-vgg11")


@pytest.mark.parametrize(
  "name",
  [
    "prunetrain-resnet20",
    "prunetrain-vgg11",
    "sdgp-resnet9",
    *(pytest.param(n, marks=pytest.mark.slow) for n in _SLOW_ZOO),
  ],
)
def test_zoo_models_give_the_same_model_by_slicing_and_by_rebuilding_from_the_spec(name):
  """The traced surgery slices the zoo's models in place; rebuilding from the smaller width
  spec and copying the values gives the same structure and arrays."""
  model = models.create(name, num_classes=10, rngs=nnx.Rngs(0))
  masks.kill_channels(model, 0.5)
  sliced, _, _ = pt.reconfigure(model, None, count_flops=False)
  rebuilt = nnx.eval_shape(lambda: models.rebuild(model, sliced.spec))
  nnx.update(rebuilt, nnx.state(sliced))
  a, b = nnx.state(sliced), nnx.state(rebuilt)
  assert jax.tree.structure(a) == jax.tree.structure(b), name
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape
  assert sliced.spec != model.spec


def _loader(seed=0, n=64):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, size=n).astype(np.int32)
  return data.Loader(
    data.Dataset.from_arrays(images, labels, num_classes=10),
    16,
    shuffle=True,
    seed=0,
    drop_last=True,
  )


def _prunetrain_trainer(model, directory=None):
  method = methods.get("prunetrain", every_epochs=1, dynamic_batch=False)
  loader = _loader()
  run = methods.Run.from_loader(loader, epochs=3)
  tx = method.make_tx(train.sgd(0.05, momentum=0.9), run)
  return train.Trainer(
    model, tx, callbacks=method.callbacks(run), progress=False, checkpoint_dir=directory
  ), loader


def _user_model():
  model = ProjectionResNet(nnx.Rngs(0), width=8)
  masks.kill_channels(model, 0.5, input_shape=_SHAPE)  # what group lasso would reach, at once
  return model


def test_prunetrain_loop_on_a_hand_written_model_ends_smaller_and_resumes_bit_exact(tmp_path):
  trainer, loader = _prunetrain_trainer(_user_model())
  history = trainer.fit(loader, None, epochs=3)
  assert history[0]["pt_reconfigured"] and history[0]["pt_channels_removed"] > 0
  start = sum(np.size(v) for v in jax.tree.leaves(nnx.state(_user_model(), nnx.Param)))
  assert history[0]["pt_params"] == start and history[-1]["pt_params"] < start
  whole = nnx.state(trainer.model, nnx.Param)
  # The same run stopped after epoch 1 (after its reconfiguration), resumed by a new trainer
  # on a new full-size model: the checkpoint's plans cut it before the weights are read.
  first, loader = _prunetrain_trainer(_user_model(), tmp_path)
  first.fit(loader, None, epochs=1)
  first.close()
  second, loader = _prunetrain_trainer(_user_model(), tmp_path)
  second.fit(loader, None, epochs=3)
  assert len(pt.applied_plans(second.model)) >= 1
  resumed = nnx.state(second.model, nnx.Param)
  assert jax.tree.structure(resumed) == jax.tree.structure(whole)
  for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(whole)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_reconfigure_bad_input_is_named():
  model = ProjectionResNet(nnx.Rngs(0), width=8)
  with pytest.raises(ValueError, match="input_shape: ProjectionResNet has no width spec"):
    pt.reconfigure(model, None)
  with pytest.raises(ValueError, match="input_shape .* does not fit the model"):
    pt.reconfigure(model, None, input_shape=(1, 32, 32, 5))
  model.blocks[0].a.kernel[...] = model.blocks[0].a.kernel[...].at[0, 0, 0, 0].set(jnp.nan)
  with pytest.raises(ValueError, match="non-finite weights in blocks/0/a/kernel"):
    pt.reconfigure(model, None, input_shape=_SHAPE)
  model = ProjectionResNet(nnx.Rngs(0), width=8)
  masks.kill_channels(model, 0.5, input_shape=_SHAPE)
  wrong = {
    "mu": jax.tree.map(jnp.zeros_like, nnx.as_pure(nnx.state(FlattenCNN(nnx.Rngs(0)), nnx.Param)))
  }
  with pytest.raises(ValueError, match="opt_state: leaf"):
    pt.reconfigure(model, wrong, input_shape=_SHAPE)


def test_a_layer_that_keeps_its_own_width_is_refused_by_name():
  class Stubborn(nnx.Module):
    def __init__(self, rngs):
      self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
      self.head = nnx.Linear(8, 10, rngs=rngs)
      self.width = 8

    def __call__(self, x):
      y = nnx.relu(self.conv(x)).reshape(x.shape[0], -1, self.width)
      return self.head(y.mean(1))

  model = Stubborn(nnx.Rngs(0))
  masks.kill_channels(model, 0.5, input_shape=_SHAPE)
  with pytest.raises(ValueError, match="does not compute with its new widths"):
    pt.reconfigure(model, None, input_shape=_SHAPE)


def test_inplace_reconfiguration_cuts_the_model_itself_and_still_checks_its_output():
  model = ProjectionResNet(nnx.Rngs(0), width=8)
  masks.kill_channels(model, 0.5, input_shape=_SHAPE)
  x = jax.random.normal(jax.random.key(2), (2, 32, 32, 3))
  want = _outputs(model, x)
  new, _, report = pt.reconfigure(model, None, input_shape=_SHAPE, inplace=True)
  assert new is model and report.params_after < report.params_before
  assert (
    sum(np.size(v) for v in jax.tree.leaves(nnx.state(model, nnx.Param))) == report.params_after
  )
  got = _outputs(model, x)
  for mode in want:
    np.testing.assert_allclose(got[mode], want[mode], rtol=1e-5, atol=1e-5)


def test_the_coverage_row_counts_what_no_reconfiguration_can_remove():
  """The MLP's only variable with no prunable axis is the output layer's bias: 10 of
  3072·32 + 32 + 32·32 + 32 + 32·10 + 10 = 99,722 parameters, counted by hand."""
  from experiments.prunetrain import any_model

  model = ARCHITECTURES["MLP"](nnx.Rngs(0))
  graph = pt.channel_graph(model, _SHAPE)
  assert any_model._unremovable_share(model, graph) == pytest.approx(10 / 99_722)
