"""PruneTrain reconfiguration: the smaller model computes what the zeroed one did.

Channels are killed by hand here, from the model layout each family documents (which
layers write and read a channel); the library finds them by walking the module tree.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import models
from jaxprune import prunetrain as pt

RNG = np.random.default_rng(0)


def _spec(family):
  if family == "prunetrain-resnet":  # He et al. basic blocks; stage 0 shares the stem tensor
    return models.ResNet, models.prunetrain_resnet_spec(20).scaled(0.25), 8
  if family == "bottleneck":  # PruneTrain's ResNet-50 layout, 2 blocks per stage
    return (
      models.ResNet,
      models.ResNetSpec.uniform(
        "bottleneck",
        stem_width=4,
        stage_widths=(8, 16),
        num_blocks=(2, 2),
        strides=(1, 2),
        inner_widths=((4, 4), (4, 4)),
      ),
      8,
    )
  if family == "clicktrain-resnet":  # 4 stages; first stage without projection
    return models.ResNet, models.clicktrain_resnet_spec(18).scaled(1 / 16), 8
  if family == "prunetrain-vgg":
    return models.VGG, models.prunetrain_vgg_spec(11).scaled(1 / 16), 32
  if family == "clicktrain-vgg":  # hidden Linear layers in the classifier
    return models.VGG, models.clicktrain_vgg_spec(11).scaled(1 / 32), 16
  raise AssertionError(family)


FAMILIES = [
  "prunetrain-resnet",
  "bottleneck",
  "clicktrain-resnet",
  "prunetrain-vgg",
  "clicktrain-vgg",
]
_BUILT = {}


def _model(family):
  """A fresh copy of a family's model with random BatchNorm statistics (eval mode)."""
  if family not in _BUILT:
    cls, spec, size = _spec(family)
    model = cls(spec, num_classes=10, rngs=nnx.Rngs(0))
    for _, node in nnx.iter_graph(model):
      if isinstance(node, nnx.BatchNorm):
        n = node.num_features
        node.scale[...] = RNG.uniform(0.5, 1.5, n).astype(np.float32)
        node.bias[...] = RNG.normal(size=n).astype(np.float32)
        node.mean[...] = RNG.normal(size=n).astype(np.float32)
        node.var[...] = RNG.uniform(0.5, 2.0, n).astype(np.float32)
    model.eval()
    _BUILT[family] = (model, size)
  model, size = _BUILT[family]
  return nnx.clone(model), size


@nnx.jit
def _forward(model, x):
  return model(x)


def _images(size):
  return jnp.asarray(RNG.normal(size=(2, size, size, 3)).astype(np.float32))


def _set(param, index, value=0.0):
  array = np.array(param[...])
  array[index] = value
  param[...] = array


def _branch(block):
  return [getattr(block, n) for n in ("conv1", "conv2", "conv3") if getattr(block, n, None)]


def _kill_channel(model, family, value=0.0):
  """Sets every group of one channel to ``value`` (writers' outputs, readers' inputs).

  Returns the kills as ``{layer: [(axis, channel)]}`` over kernels and the expected spec.
  """
  kills = []  # (param, index)
  spec = model.spec
  if family in ("prunetrain-resnet", "bottleneck"):
    # Last stage's stream, channel c: projection + every last branch conv write it;
    # later blocks' first convs and the head read it.
    c = 1
    stage = model.stages[-1]
    kills.append((stage[0].shortcut.conv.kernel, (..., c)))
    for block in stage:
      kills.append((_branch(block)[-1].conv.kernel, (..., c)))
    for block in stage[1:]:
      kills.append((_branch(block)[0].conv.kernel, (slice(None), slice(None), c)))
    kills.append((model.head.kernel, (c,)))
    stages = list(spec.stages)
    stages[-1] = dataclasses.replace(stages[-1], width=stages[-1].width - 1)
    expected = dataclasses.replace(spec, stages=tuple(stages))
  elif family == "clicktrain-resnet":
    # The stem tensor is also stage 0's stream (no projection): stem, stage 0's branches,
    # stage 1's first block (projection and conv1).
    c = 2
    kills.append((model.stem.conv.kernel, (..., c)))
    for block in model.stages[0]:
      kills.append((block.conv2.conv.kernel, (..., c)))
      kills.append((block.conv1.conv.kernel, (slice(None), slice(None), c)))
    first = model.stages[1][0]
    kills.append((first.shortcut.conv.kernel, (slice(None), slice(None), c)))
    kills.append((first.conv1.conv.kernel, (slice(None), slice(None), c)))
    stages = list(spec.stages)
    stages[0] = dataclasses.replace(stages[0], width=stages[0].width - 1)
    expected = dataclasses.replace(spec, stem_width=spec.stem_width - 1, stages=tuple(stages))
  else:
    # A middle conv's channel, the last conv's channel (read by the classifier) and, with
    # hidden layers, a hidden unit.
    c = 0
    kills.append((model.features[2].conv.kernel, (..., c)))
    kills.append((model.features[3].conv.kernel, (slice(None), slice(None), c)))
    kills.append((model.features[-1].conv.kernel, (..., c)))
    kills.append((model.classifier[0].kernel, (c,)))
    widths = list(spec.widths)
    widths[2] -= 1
    widths[-1] -= 1
    hidden = list(spec.hidden)
    if hidden:
      kills.append((model.classifier[0].kernel, (slice(None), c + 1)))
      kills.append((model.classifier[1].kernel, (c + 1,)))
      hidden[0] -= 1
    expected = dataclasses.replace(spec, widths=tuple(widths), hidden=tuple(hidden))
  for param, index in kills:
    _set(param, index, value)
  return kills, expected


def _params(model):
  return nnx.as_pure(nnx.state(model, nnx.Param))


def _random_opt_state(tx, model):
  state = tx.init(_params(model))
  return jax.tree.map(
    lambda x: (
      jnp.asarray(RNG.normal(size=np.shape(x)).astype(np.float32))
      if jnp.issubdtype(x.dtype, jnp.floating)
      else x
    ),
    state,
  )


@pytest.mark.parametrize("family", FAMILIES)
def test_reconfigured_model_equals_zeroed_model(family):
  model, size = _model(family)
  _, expected_spec = _kill_channel(model, family)
  x = _images(size)
  tx = pt.with_group_lasso(optax.adam(1e-3))
  opt_state = _random_opt_state(tx, model)
  new_model, new_state, report = pt.reconfigure(model, opt_state, count_flops=False)
  assert new_model.spec == expected_spec
  np.testing.assert_allclose(_forward(new_model, x), _forward(model, x), rtol=1e-5, atol=1e-5)
  assert report.params_after < report.params_before
  assert sum(report.channels_removed.values()) > 0
  # Every parameter-shaped optimizer leaf has the new parameter's shape; λ is kept.
  new_shapes = jax.tree.map(np.shape, _params(new_model))
  assert jax.tree.map(np.shape, new_state.inner[0].mu) == new_shapes
  assert jax.tree.map(np.shape, new_state.inner[0].nu) == new_shapes
  assert new_state.group_lasso == opt_state.group_lasso
  assert int(new_state.inner[0].count) == int(opt_state.inner[0].count)


@pytest.mark.parametrize("family", ["prunetrain-resnet", "clicktrain-vgg"])
def test_optimizer_state_is_the_slice_of_the_old_state(family):
  model, _ = _model(family)
  _kill_channel(model, family)
  tx = optax.sgd(0.1, momentum=0.9)
  opt_state = _random_opt_state(tx, model)
  _, new_state, _ = pt.reconfigure(model, opt_state, count_flops=False)
  old, new = opt_state[0].trace, new_state[0].trace
  if family == "prunetrain-resnet":
    # The killed stream channel 1 leaves the head's input rows, the projection's outputs
    # and its BatchNorm; the stem is untouched.
    np.testing.assert_array_equal(new["head"]["kernel"], np.delete(old["head"]["kernel"], 1, 0))
    proj = lambda t: t["stages"][2][0]["shortcut"]
    np.testing.assert_array_equal(
      proj(new)["conv"]["kernel"], np.delete(proj(old)["conv"]["kernel"], 1, 3)
    )
    np.testing.assert_array_equal(proj(new)["bn"]["scale"], np.delete(proj(old)["bn"]["scale"], 1))
    np.testing.assert_array_equal(new["stem"]["conv"]["kernel"], old["stem"]["conv"]["kernel"])
  else:
    conv = lambda t, i: t["features"][i]["conv"]["kernel"]
    np.testing.assert_array_equal(conv(new, 2), np.delete(conv(old, 2), 0, 3))
    np.testing.assert_array_equal(conv(new, 3), np.delete(conv(old, 3), 0, 2))
    np.testing.assert_array_equal(
      new["features"][2]["bn"]["bias"], np.delete(old["features"][2]["bn"]["bias"], 0)
    )
    dense = lambda t, i: t["classifier"][i]
    np.testing.assert_array_equal(
      dense(new, 0)["kernel"], np.delete(np.delete(dense(old, 0)["kernel"], 0, 0), 1, 1)
    )
    np.testing.assert_array_equal(dense(new, 0)["bias"], np.delete(dense(old, 0)["bias"], 1))
    np.testing.assert_array_equal(dense(new, 1)["kernel"], np.delete(dense(old, 1)["kernel"], 1, 0))
    np.testing.assert_array_equal(dense(new, 2)["kernel"], dense(old, 2)["kernel"])


def test_reconfiguring_again_changes_nothing():
  model, size = _model("bottleneck")
  _kill_channel(model, "bottleneck")
  tx = optax.sgd(0.1, momentum=0.9)
  once, state, _ = pt.reconfigure(model, _random_opt_state(tx, model), count_flops=False)
  twice, state2, report = pt.reconfigure(once, state, count_flops=False)
  assert not report.changed and not report.removed_layers
  assert twice.spec == once.spec
  jax.tree.map(
    np.testing.assert_array_equal, nnx.as_pure(nnx.state(twice)), nnx.as_pure(nnx.state(once))
  )
  jax.tree.map(np.testing.assert_array_equal, state2, state)


def test_union_keeps_a_channel_with_one_live_reader():
  model, _ = _model("prunetrain-resnet")
  kills, _ = _kill_channel(model, "prunetrain-resnet")
  # Revive the head's input row: the stream channel is still read, so it stays.
  _set(model.head.kernel, (1,), 0.5)
  new_model, _, report = pt.reconfigure(model, None, count_flops=False)
  assert new_model.spec == model.spec and not report.changed


def test_threshold_is_absolute_max_magnitude():
  model, size = _model("clicktrain-vgg")
  reference = nnx.clone(model)
  _kill_channel(model, "clicktrain-vgg", value=5e-5)  # below the paper's 1e-4
  _, expected_spec = _kill_channel(reference, "clicktrain-vgg", value=0.0)
  kept, _, kept_report = pt.reconfigure(model, None, threshold=1e-5, count_flops=False)
  assert kept.spec == model.spec and not kept_report.changed
  new_model, _, _ = pt.reconfigure(model, None, count_flops=False)
  assert new_model.spec == expected_spec
  x = _images(16)
  np.testing.assert_allclose(_forward(new_model, x), _forward(reference, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "family, where", [("prunetrain-resnet", (1, 1)), ("bottleneck", (1, 0)), ("bottleneck", (0, 1))]
)
def test_dead_branch_is_removed(family, where):
  model, size = _model(family)
  s, b = where
  block = model.stages[s][b]
  layers = _branch(block)
  if family == "bottleneck" and where == (0, 1):
    # Only the 3x3 conv and its successor die: conv1 keeps live weights but its output
    # feeds nothing any more.
    layers = layers[1:]
  for layer in layers:
    _set(layer.conv.kernel, ..., 0.0)
  # A dead branch adds BN(0) = β − γμ/σ; with β = μ = 0 that is exactly zero.
  _set(layers[-1].bn.bias, ..., 0.0)
  _set(layers[-1].bn.mean, ..., 0.0)
  x = _images(size)
  before = _forward(model, x)
  new_model, _, report = pt.reconfigure(model, None, count_flops=False)
  assert report.removed_branches == [f"stages/{s}/{b}"]
  n = len(_branch(block))
  assert report.removed_layers == sorted(f"stages/{s}/{b}/conv{i + 1}" for i in range(n))
  assert new_model.spec.stages[s].blocks[b].widths is None
  assert not new_model.stages[s][b].has_branch
  assert report.removed_branch_offset == 0.0
  np.testing.assert_allclose(_forward(new_model, x), before, rtol=1e-5, atol=1e-5)


def test_removed_branch_offset_is_reported():
  model, _ = _model("prunetrain-resnet")
  block = model.stages[0][1]
  for layer in _branch(block):
    _set(layer.conv.kernel, ..., 0.0)
  _, _, report = pt.reconfigure(model, None, count_flops=False)
  bn = block.conv2.bn
  offset = np.asarray(bn.bias[...]) - np.asarray(bn.scale[...]) * np.asarray(bn.mean[...]) / (
    np.sqrt(np.asarray(bn.var[...]) + bn.epsilon)
  )
  assert report.removed_branch_offset == pytest.approx(np.abs(offset).max(), rel=1e-5)


def test_nnx_optimizer_and_flops_report():
  model, _ = _model("prunetrain-vgg")
  model.train()
  _kill_channel(model, "prunetrain-vgg")
  optimizer = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
  new_model, new_optimizer, report = pt.reconfigure(model, optimizer)
  assert isinstance(new_optimizer, nnx.Optimizer)
  trace = nnx.as_pure(new_optimizer.opt_state[0].trace)
  assert jax.tree.map(np.shape, trace) == jax.tree.map(np.shape, _params(new_model))
  # Train mode is kept.
  assert not new_model.features[0].bn.use_running_average
  # Forward FLOPs of the two changed convs (32x32 image, widths w2 and w3 at 8x8 after
  # two pools): one output channel of conv 2 and one input channel of conv 3.
  spec = model.spec
  saved = 2 * 8 * 8 * 9 * (spec.widths[1] + spec.widths[3])
  saved += 2 * 2 * 2 * 9 * spec.widths[-2] + 2 * 10  # last conv (2x2 map) and the classifier
  assert report.flops_before - report.flops_after == saved
  assert report.flops_ratio < 1.0 and report.train_flops_after < report.train_flops_before
  assert "channels" in report.summary()


@pytest.mark.parametrize("family", ["prunetrain-resnet", "clicktrain-vgg"])
def test_channel_multiple_rounds_widths_up_and_keeps_the_function(family):
  model, size = _model(family)
  _kill_channel(model, family)  # dead channels are exactly zero: reviving them is exact
  x = _images(size)
  plain, _, _ = pt.reconfigure(model, None, count_flops=False)
  aligned, _, _ = pt.reconfigure(model, None, count_flops=False, channel_multiple=8)
  before = [g.width for g in pt.channel_graph(model).prunable]
  after = [g.width for g in pt.channel_graph(aligned).prunable]
  shrunk = [g.width for g in pt.channel_graph(plain).prunable]
  assert len(before) == len(after) == len(shrunk)
  for b, a, p in zip(before, after, shrunk):
    assert p <= a <= b and (a % 8 == 0 or a == b) and a - p < 8
  assert after != shrunk  # some width was rounded up
  np.testing.assert_allclose(_forward(aligned, x), _forward(model, x), rtol=1e-5, atol=1e-5)
  # rounded_width states the same rule for one width
  assert [pt.rounded_width(p, 8, b) for b, p in zip(before, shrunk)] == after


def test_bad_input():
  model, _ = _model("prunetrain-resnet")
  for multiple in (0, 2.0, True):
    with pytest.raises(ValueError, match="channel_multiple"):
      pt.reconfigure(model, None, channel_multiple=multiple)
  for threshold in (-1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="threshold"):
      pt.reconfigure(model, None, threshold=threshold)
  # A model without a width spec needs the shape of its input to be traced.
  with pytest.raises(ValueError, match="input_shape: Linear has no width spec"):
    pt.reconfigure(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("family", ["prunetrain-resnet", "clicktrain-vgg"])
def test_non_finite_weights_raise_naming_the_layer(family, bad):
  # NaN fails every max|w| >= threshold test: a diverged model must not pass as "dead".
  model, _ = _model(family)
  kernels = [
    path[:-1] for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)) if path[-1] == "kernel"
  ]
  path = kernels[len(kernels) // 2]  # a kernel in the middle of the model
  layer = model
  for key in path:
    layer = layer[key] if isinstance(key, int) else getattr(layer, key)
  _set(layer.kernel, (0,) * layer.kernel[...].ndim, bad)
  name = "/".join(map(str, path + ("kernel",)))
  with pytest.raises(ValueError, match=f"non-finite weights in {name} \\(1 of "):
    pt.reconfigure(model, None)


@pytest.mark.parametrize("source", ["other-model", "nnx-state"])
def test_mismatched_optimizer_state_raises_instead_of_passing_unsliced(source):
  model, _ = _model("prunetrain-resnet")
  _kill_channel(model, "prunetrain-resnet")
  tx = optax.sgd(0.1, momentum=0.9)
  if source == "other-model":
    other, _ = _model("prunetrain-vgg")
    opt_state = tx.init(_params(other))
  else:
    opt_state = tx.init(nnx.state(model, nnx.Param))
  with pytest.raises(ValueError, match="opt_state"):
    pt.reconfigure(model, opt_state, count_flops=False)
