"""Tests for jaxprune.models: parameter counts, shapes, modes, specs, layer removal."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import models
from jaxprune.models import (
  VGG,
  BasicBlock,
  BlockSpec,
  Bottleneck,
  ConvBN,
  ResNet,
  ResNet9,
  ResNet9Spec,
  ResNetSpec,
  StageSpec,
  VGGSpec,
)


@functools.lru_cache(maxsize=None)
def _abstract_cached(name: str, num_classes: int, kwargs: tuple) -> nnx.Module:
  return nnx.eval_shape(
    lambda: models.create(name, num_classes=num_classes, rngs=nnx.Rngs(0), **dict(kwargs))
  )


def _abstract(name: str, num_classes: int = 10, **kwargs) -> nnx.Module:
  """Abstract (shape-only) registered model; shared between tests, which only read it."""
  return _abstract_cached(name, num_classes, tuple(sorted(kwargs.items())))


# One compiled program per module structure instead of one per primitive and shape (eager).
_apply = nnx.jit(lambda module, x: module(x))


def _conv_bn(cin: int, cout: int, k: int) -> int:
  """Hand count: conv weights (no bias) + BN γ and β."""
  return cin * cout * k * k + 2 * cout


def _linear(cin: int, cout: int, bias: bool = True) -> int:
  return cin * cout + (cout if bias else 0)


# ---------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(
  "name, num_classes, expected, rel_tol",
  [
    # torchvision's published counts (exact).
    ("imagenet-resnet18", 1000, 11_689_512, 0.0),
    ("imagenet-resnet50", 1000, 25_557_032, 0.0),
    # kuangliu/pytorch-cifar ResNet-18 (the ClickTrain code base), exact.
    ("clicktrain-resnet18", 10, 11_173_962, 0.0),
    # The papers' published figures (given to 3 significant digits).
    ("prunetrain-resnet32", 10, 0.467e6, 1e-3),
    ("prunetrain-resnet50", 10, 0.777e6, 1e-3),
    ("clicktrain-resnet32", 10, 20.1e6, 5e-3),
    ("sdgp-resnet9", 10, 9.09e6, 1e-3),
  ],
)
def test_param_count_matches_published(name, num_classes, expected, rel_tol):
  count = models.param_count(_abstract(name, num_classes))
  assert count == pytest.approx(expected, rel=rel_tol, abs=0)


def test_param_count_prunetrain_resnet32_by_hand():
  # He et al. CIFAR ResNet-32: stem 3→16, 5 blocks per stage, 1x1 projections at 16→32, 32→64.
  expected = _conv_bn(3, 16, 3)
  in_width = 16
  for width in (16, 32, 64):
    for b in range(5):
      expected += _conv_bn(in_width, width, 3) + _conv_bn(width, width, 3)
      if in_width != width:
        expected += _conv_bn(in_width, width, 1)
      in_width = width
  expected += _linear(64, 10)
  assert models.param_count(_abstract("prunetrain-resnet32")) == expected


def test_param_count_sdgp_resnet9_by_hand():
  expected = (
    _conv_bn(3, 128, 3)
    + _conv_bn(128, 256, 5)
    + 2 * _conv_bn(256, 256, 3)
    + _conv_bn(256, 512, 3)
    + 2 * _conv_bn(512, 512, 3)
    + _conv_bn(512, 256, 3)
    + _linear(256, 10, bias=False)
  )
  assert models.param_count(_abstract("sdgp-resnet9")) == expected


def test_param_count_vgg_by_hand():
  widths = [64, 128, 256, 256, 512, 512, 512, 512]
  convs = sum(_conv_bn(a, b, 3) for a, b in zip([3] + widths[:-1], widths))
  prunetrain = convs + _linear(512, 10)
  clicktrain = convs + _linear(512, 512) + _linear(512, 512) + _linear(512, 10)
  assert models.param_count(_abstract("prunetrain-vgg11")) == prunetrain
  assert models.param_count(_abstract("clicktrain-vgg11")) == clicktrain


def test_param_count_small_spec_by_hand():
  spec = ResNetSpec.uniform(
    "basic", stem_width=4, stage_widths=(4, 8), num_blocks=(1, 1), strides=(1, 2)
  )
  model = nnx.eval_shape(lambda: ResNet(spec, num_classes=5, rngs=nnx.Rngs(0)))
  stem = 3 * 4 * 9 + 2 * 4
  stage0 = 2 * (4 * 4 * 9 + 2 * 4)
  stage1 = (4 * 8 * 9 + 2 * 8) + (8 * 8 * 9 + 2 * 8) + (4 * 8 + 2 * 8)
  head = 8 * 5 + 5
  assert models.param_count(model) == stem + stage0 + stage1 + head == 1409


def test_registry_names_and_unknown_name():
  names = models.available()
  for name in [
    "prunetrain-resnet20", "prunetrain-resnet32", "prunetrain-resnet56", "prunetrain-resnet50",
    "prunetrain-vgg11", "prunetrain-vgg13", "clicktrain-resnet18", "clicktrain-resnet32",
    "clicktrain-resnet34", "clicktrain-resnet50", "clicktrain-vgg11", "clicktrain-vgg13",
    "clicktrain-vgg16", "sdgp-resnet9", "imagenet-resnet18", "imagenet-resnet50",
  ]:  # fmt: skip
    assert name in names
  with pytest.raises(ValueError, match="prunetrain-resnet32"):
    models.create("resnet32", num_classes=10, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="nonexistent_field"):
    models.create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), nonexistent_field=3)


# ---------------------------------------------------------------- shapes and structure


@pytest.mark.parametrize(
  "name, size",
  [
    ("prunetrain-resnet20", 32),
    ("clicktrain-resnet18", 32),
    ("clicktrain-resnet50", 32),
    ("clicktrain-vgg11", 32),
    ("prunetrain-vgg13", 32),
    ("sdgp-resnet9", 32),
    ("imagenet-resnet18", 64),
  ],
)
def test_output_shape_abstract(name, size):
  model = _abstract(name, num_classes=7)
  out = nnx.eval_shape(lambda m: m(jnp.zeros((2, size, size, 3))), model)
  assert out.shape == (2, 7)


def test_width_multiplier_and_small_forward():
  model = _abstract("prunetrain-resnet20", num_classes=3, width_multiplier=0.25, in_channels=1)
  assert model.stem.conv.kernel.shape == (3, 3, 1, 4)
  assert [stage[0].conv2.conv.kernel.shape[-1] for stage in model.stages] == [4, 8, 16]
  assert nnx.eval_shape(lambda m: m(jnp.ones((2, 16, 16, 1))), model).shape == (2, 3)
  custom = _abstract("prunetrain-vgg11", spec=VGGSpec((8, 8), pool_after=(1,)))
  assert [layer.conv.kernel.shape[-1] for layer in custom.features] == [8, 8]


def test_architecture_attributes():
  model = _abstract("prunetrain-resnet32")
  assert isinstance(model.stem, ConvBN) and model.stem.relu
  assert [len(s) for s in model.stages] == [5, 5, 5]
  assert model.stages[0][0].shortcut is None
  assert isinstance(model.stages[1][0].shortcut, ConvBN)
  assert model.stages[1][0].shortcut.conv.kernel.shape == (1, 1, 16, 32)
  assert model.stages[1][0].conv1.conv.strides == (2, 2)
  assert model.head.kernel.shape == (64, 10)
  bottleneck = _abstract("clicktrain-resnet50", num_classes=7).stages[1][0]
  assert isinstance(bottleneck, Bottleneck)
  assert bottleneck.conv2.conv.strides == (2, 2)  # v1.5
  assert bottleneck.conv1.conv.strides == (1, 1)
  imagenet = _abstract("imagenet-resnet18", num_classes=7)
  features = nnx.eval_shape(lambda m: m.forward_features(jnp.zeros((1, 224, 224, 3))), imagenet)
  assert features.shape == (1, 7, 7, 512)  # 7x7/2 stem + 3x3/2 max pool, then /8
  assert imagenet.stem.conv.kernel.shape == (7, 7, 3, 64)
  vgg = _abstract("clicktrain-vgg16")
  assert len(vgg.features) == 13 and len(vgg.classifier) == 3


def test_clicktrain_vgg_bn_scale_init():
  spec = models.clicktrain_vgg_spec(11)
  assert spec.bn_scale_init == 0.5 and spec.linear_init_std == 0.01
  assert spec.pool_after == (0, 1, 3, 5)  # 4 pools, none after the last block
  assert models.prunetrain_vgg_spec(11).pool_after == (0, 1, 3, 5, 7)
  vgg = VGG(VGGSpec((4, 4), (0,), bn_scale_init=0.5), num_classes=2, rngs=nnx.Rngs(0))
  for layer in vgg.features:
    np.testing.assert_array_equal(layer.bn.scale[...], 0.5)


def test_rebuild_from_spec_has_identical_structure():
  for name in ("prunetrain-resnet20", "clicktrain-vgg11", "sdgp-resnet9"):
    model = _abstract(name, num_classes=4, width_multiplier=0.5)
    rebuilt = nnx.eval_shape(lambda m=model: type(m)(m.spec, num_classes=4, rngs=nnx.Rngs(1)))
    shapes = jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(model))
    rebuilt_shapes = jax.tree.map(lambda v: (v.shape, v.dtype), nnx.state(rebuilt))
    assert jax.tree.structure(shapes) == jax.tree.structure(rebuilt_shapes)
    assert jax.tree.leaves(shapes) == jax.tree.leaves(rebuilt_shapes)
    assert rebuilt.spec == model.spec


def test_irregular_pruned_spec_builds_those_widths():
  # A spec as reconfiguration produces it: odd widths, a projection between equal widths,
  # a removed branch.
  spec = ResNetSpec(
    "basic",
    stem_width=5,
    stages=(
      StageSpec(5, (BlockSpec((3,)), BlockSpec(None))),
      StageSpec(6, (BlockSpec((2,), projection=True), BlockSpec((4,))), stride=2),
      StageSpec(6, (BlockSpec((7,), projection=True),), stride=1),
    ),
  )
  model = nnx.eval_shape(lambda: ResNet(spec, num_classes=3, rngs=nnx.Rngs(0)))
  kernel = lambda layer: layer.conv.kernel.shape
  assert kernel(model.stem) == (3, 3, 3, 5)
  assert kernel(model.stages[0][0].conv1) == (3, 3, 5, 3)
  assert kernel(model.stages[0][0].conv2) == (3, 3, 3, 5)
  assert not model.stages[0][1].has_branch and model.stages[0][1].shortcut is None
  assert kernel(model.stages[1][0].shortcut) == (1, 1, 5, 6)
  assert kernel(model.stages[1][1].conv1) == (3, 3, 6, 4)
  assert kernel(model.stages[2][0].shortcut) == (1, 1, 6, 6)
  assert kernel(model.stages[2][0].conv1) == (3, 3, 6, 7)
  assert model.head.kernel.shape == (6, 3)
  out = nnx.eval_shape(lambda m: m(jnp.zeros((1, 8, 8, 3))), model)
  assert out.shape == (1, 3)


# ---------------------------------------------------------------- numerics


def _conv_reference(x, w, stride, pad):
  """Plain NumPy NHWC x HWIO cross-correlation with symmetric zero padding (PyTorch semantics)."""
  x = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
  k = w.shape[0]
  out_h = (x.shape[1] - k) // stride + 1
  out_w = (x.shape[2] - k) // stride + 1
  out = np.zeros((x.shape[0], out_h, out_w, w.shape[-1]), np.float64)
  for i in range(out_h):
    for j in range(out_w):
      patch = x[:, i * stride : i * stride + k, j * stride : j * stride + k, :]
      out[:, i, j] = np.einsum("nhwc,hwcf->nf", patch, w)
  return out


@pytest.mark.parametrize("k, stride", [(3, 2), (3, 1), (5, 2), (1, 2)])
def test_convbn_matches_pytorch_padding(k, stride):
  layer = ConvBN(3, 4, k, strides=stride, relu=False, rngs=nnx.Rngs(0))
  layer.eval()  # running stats are mean 0 / var 1 at init: BN is ≈ identity
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 6, 6, 3)))
  ref = _conv_reference(x, np.asarray(layer.conv.kernel[...]), stride, k // 2) / np.sqrt(1 + 1e-5)
  np.testing.assert_allclose(np.asarray(_apply(layer, jnp.asarray(x))), ref, rtol=1e-4, atol=1e-5)
  # Training mode: PyTorch BatchNorm2d(momentum=0.1) running statistics, batch-normalised output.
  layer.train()
  out = np.asarray(_apply(layer, jnp.asarray(x)))
  conv = _conv_reference(x, np.asarray(layer.conv.kernel[...]), stride, k // 2)
  np.testing.assert_allclose(
    layer.bn.mean[...], 0.1 * conv.mean(axis=(0, 1, 2)), rtol=1e-4, atol=1e-6
  )
  normalised = (conv - conv.mean(axis=(0, 1, 2))) / np.sqrt(conv.var(axis=(0, 1, 2)) + 1e-5)
  np.testing.assert_allclose(out, normalised, rtol=1e-3, atol=1e-4)


def test_train_eval_switches_batchnorm_and_dropout():
  spec = VGGSpec((4, 8), pool_after=(0, 1), hidden=(16,), dropout=0.5)
  model = VGG(spec, num_classes=5, rngs=nnx.Rngs(0))
  forward = _apply
  x = jax.random.normal(jax.random.key(0), (4, 8, 8, 3)) * 3.0 + 1.0
  bn = model.features[0].bn
  # Training mode: BN normalises with batch statistics and moves its running statistics;
  # dropout is active, so two calls differ.
  mean_before = np.asarray(bn.mean[...]).copy()
  first, second = np.asarray(forward(model, x)), np.asarray(forward(model, x))
  assert not np.allclose(np.asarray(bn.mean[...]), mean_before)
  assert not np.allclose(first, second, rtol=1e-3, atol=0)
  model.eval()
  assert bn.use_running_average and model.dropout.deterministic
  stats = np.asarray(bn.mean[...]).copy()
  a, b = np.asarray(forward(model, x)), np.asarray(forward(model, x))
  np.testing.assert_array_equal(a, b)  # no dropout
  # running statistics: a sample's output does not depend on the rest of the batch
  np.testing.assert_allclose(np.asarray(forward(model, x[:1])), a[:1], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(bn.mean[...]), stats)
  model.train()
  assert not bn.use_running_average and not model.dropout.deterministic
  model.dropout.deterministic = True
  # back to batch statistics: the sample is normalised by its own statistics, not the
  # running ones, so its output changes
  assert not np.allclose(np.asarray(forward(model, x[:1])), a[:1], rtol=1e-2, atol=0)


@pytest.mark.parametrize(
  "init, shape, std",
  [
    (models.layers.conv_kernel_init, (3, 3, 32, 64), np.sqrt(2 / (9 * 64))),
    (models.layers.torch_default_init, (400, 300), 1 / np.sqrt(3 * 400)),
    (models.layers.normal_init(0.01), (300, 500), 0.01),
  ],
)
def test_initializer_moments(init, shape, std):
  w = np.asarray(init(jax.random.key(3), shape), np.float64)
  assert w.shape == shape
  assert abs(w.mean()) < 5 * std / np.sqrt(w.size)
  assert w.std() == pytest.approx(std, rel=0.02)
  other = np.asarray(init(jax.random.key(4), shape))
  assert not np.allclose(w, other)


# ---------------------------------------------------------------- layer removal


@pytest.mark.parametrize("block_class, widths", [(BasicBlock, (6,)), (Bottleneck, (3, 5))])
@pytest.mark.parametrize("projection, strides", [(False, 1), (True, 2)])
def test_removed_branch_computes_only_shortcut(block_class, widths, projection, strides):
  in_width = 8 if not projection else 4
  full = block_class(8 if not projection else 4, 8, widths=widths, strides=strides,
             projection=projection, rngs=nnx.Rngs(0))  # fmt: skip
  removed = block_class(in_width, 8, widths=None, strides=strides, projection=projection,
              rngs=nnx.Rngs(0))  # fmt: skip
  assert not removed.has_branch and full.has_branch
  assert removed.conv1 is None and removed.conv2 is None
  # Independent check: a full block whose last BN outputs zero has a zero branch.
  last = full.conv2 if block_class is BasicBlock else full.conv3
  last.bn.scale[...] = jnp.zeros_like(last.bn.scale[...])
  if projection:
    nnx.update(removed.shortcut, nnx.state(full.shortcut))
  x = jax.nn.relu(jax.random.normal(jax.random.key(0), (2, 8, 8, in_width)))
  removed_out = np.asarray(_apply(removed, x))
  np.testing.assert_allclose(removed_out, np.asarray(_apply(full, x)), rtol=1e-6, atol=1e-6)
  if not projection:
    np.testing.assert_array_equal(removed_out, np.asarray(x))
  assert models.param_count(removed) == models.param_count(full) - sum(
    models.param_count(getattr(full, n)) for n in full.branch_names
  )


def test_model_with_removed_block_runs_and_rebuilds():
  spec = models.prunetrain_resnet_spec(20).scaled(0.25)
  stage = spec.stages[1]
  blocks = (stage.blocks[0], dataclasses.replace(stage.blocks[1], widths=None), stage.blocks[2])
  pruned = dataclasses.replace(
    spec, stages=(spec.stages[0], dataclasses.replace(stage, blocks=blocks), spec.stages[2])
  )
  model = ResNet(pruned, num_classes=10, rngs=nnx.Rngs(0))
  assert not model.stages[1][1].has_branch
  out = _apply(model, jnp.ones((1, 8, 8, 3)))
  assert out.shape == (1, 10) and bool(jnp.all(jnp.isfinite(out)))
  dense = nnx.eval_shape(lambda: ResNet(spec, num_classes=10, rngs=nnx.Rngs(0)))
  removed = stage.blocks[1].widths[0] * stage.width * 9 * 2 + 2 * (
    stage.blocks[1].widths[0] + stage.width
  )
  assert models.param_count(model) == models.param_count(dense) - removed


def test_map_widths_rounds_against_a_reference_spec():
  dense = models.prunetrain_resnet_spec(20)
  stage = dense.stages[1]
  pruned_stage = dataclasses.replace(
    stage,
    width=19,
    blocks=(
      dataclasses.replace(stage.blocks[0], widths=(3,)),
      dataclasses.replace(stage.blocks[1], widths=None),
      dataclasses.replace(stage.blocks[2], widths=(31,)),
    ),
  )
  stem_stage = dataclasses.replace(dense.stages[0], width=5)  # the stem's stream
  pruned = dataclasses.replace(
    dense, stem_width=5, stages=(stem_stage, pruned_stage, dense.stages[2])
  )
  up8 = pruned.map_widths(lambda w, cap: min(cap, -(-w // 8) * 8), dense)
  assert up8.stem_width == 8 and up8.stages[0].width == 8
  assert up8.stages[1].width == 24  # stage width 32: 19 → 24
  assert [b.widths for b in up8.stages[1].blocks] == [(8,), None, (32,)]  # 31 → 32, cap 32
  assert up8.stages[0].blocks == dense.stages[0].blocks and up8.stages[2] == dense.stages[2]
  # scaled is map_widths with a rounding rule
  assert dense.scaled(0.5) == dense.map_widths(lambda w, _: max(1, round(w * 0.5)))
  with pytest.raises(ValueError, match="like"):
    dense.map_widths(lambda w, _: w, models.prunetrain_resnet_spec(32))
  with pytest.raises(ValueError, match="like"):
    dense.map_widths(lambda w, _: w, pruned)  # a block removed in like, present here


def test_resnet9_layout_by_hand():
  spec = models.sdgp_resnet9_spec().scaled(1 / 32)
  model = ResNet9(spec, num_classes=3, rngs=nnx.Rngs(0))
  model.eval()
  x = jax.random.normal(jax.random.key(2), (2, 16, 16, 3))

  @nnx.jit
  def by_hand(model, x):
    # ffcv layout written out step by step: residual sums without ReLU, max pool after
    # layer2, unpadded layer3, global max pool, bias-free head, logits x 0.2.
    h = model.layer1(model.prep(x))
    assert h.shape == (2, 8, 8, spec.layer1)
    h = h + model.res1[1](model.res1[0](h))
    h = model.layer2(h).reshape(2, 4, 2, 4, 2, spec.layer2).max(axis=(2, 4))
    h = h + model.res2[1](model.res2[0](h))
    h = model.layer3(h)
    assert h.shape == (2, 2, 2, spec.layer3)
    return 0.2 * (h.max(axis=(1, 2)) @ model.head.kernel[...])

  expected = by_hand(model, x)
  np.testing.assert_allclose(
    np.asarray(_apply(model, x)), np.asarray(expected), rtol=1e-5, atol=1e-6
  )
  assert model.head.bias is None


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
  "make, field",
  [
    (lambda: ResNetSpec("basic", 0, ()), "stem_width"),
    (lambda: ResNetSpec("wide", 16, ()), "block"),
    (lambda: ResNetSpec("basic", 16, ()), "stages"),
    (lambda: ResNetSpec("basic", 16, (StageSpec(-1, (BlockSpec((4,)),)),)), r"stages\[0\].width"),
    (lambda: ResNetSpec("basic", 16, (StageSpec(16, (BlockSpec((4, 4)),)),)), r"stages\[0\].blocks\[0\].widths"),
    (lambda: ResNetSpec("basic", 16, (StageSpec(16, (BlockSpec((0,)),)),)), r"widths\[0\]"),
    (lambda: ResNetSpec("basic", 16, (StageSpec(32, (BlockSpec((32,)),)),)), r"stages\[0\].blocks\[0\].projection"),
    (lambda: ResNetSpec("basic", 16, (StageSpec(16, (BlockSpec((16,)),), stride=2),)), "projection"),
    (lambda: ResNetSpec("bottleneck", 16, (StageSpec(64, ()),)), r"stages\[0\].blocks"),
    (lambda: ResNetSpec.uniform("basic", stem_width=16, stage_widths=(16, 32), num_blocks=(1,), strides=(1, 2)), "num_blocks"),
    (lambda: VGGSpec((64, 0), ()), r"widths\[1\]"),
    (lambda: VGGSpec((64, 64), (2,)), "pool_after"),
    (lambda: VGGSpec((64,), (), hidden=(0,)), "hidden"),
    (lambda: VGGSpec((64,), (), dropout=1.0), "dropout"),
    (lambda: ResNet9Spec(layer1=200), "res1"),
    (lambda: ResNet9Spec(res2=(512,)), "res2"),
    (lambda: ResNet9Spec(prep=0), "prep"),
    (lambda: models.prunetrain_resnet_spec(33), "depth"),
    (lambda: models.clicktrain_vgg_spec(12), "depth"),
    (lambda: models.prunetrain_resnet_spec(20).scaled(0), "multiplier"),
    (lambda: ResNet(models.prunetrain_resnet_spec(20), num_classes=0, rngs=nnx.Rngs(0)), "num_classes"),
    (lambda: ResNet(models.prunetrain_vgg_spec(11), num_classes=10, rngs=nnx.Rngs(0)), "spec"),
    (lambda: BasicBlock(16, 32, projection=False, rngs=nnx.Rngs(0)), "projection"),
  ],
)  # fmt: skip
def test_bad_specs_raise_value_error(make, field):
  with pytest.raises(ValueError, match=field):
    make()


def test_model_params_experiment_writes_table(tmp_path, monkeypatch):
  from experiments.benchmarks import model_params

  names = ["prunetrain-resnet20", "sdgp-resnet9"]
  monkeypatch.setattr(model_params.models, "available", lambda: names)
  output = tmp_path / "params.md"
  text = model_params.main(["--output", str(output)])
  assert output.read_text() == text
  for name in names:
    assert f"| `{name}` | `{type(_abstract(name)).__name__}` |" in text
    assert f"{models.param_count(_abstract(name)):,}" in text


@pytest.mark.parametrize("rngs", [None, 0])
def test_create_without_rngs_raises_naming_rngs_not_deep_in_flax(rngs):
  with pytest.raises(ValueError, match="rngs"):
    models.create("prunetrain-resnet32", num_classes=10, rngs=rngs)
