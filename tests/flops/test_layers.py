"""Tests for jaxprune.flops.layers: hand-counted per-layer FLOPs, masks, totals, library models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import flops, models, sdgp

# ---------------------------------------------------------------------------------------------
# Hand-counted FLOPs
# ---------------------------------------------------------------------------------------------


def test_conv_bn_linear_hand_count(conv_bn_linear):
  model = conv_bn_linear
  batch = 2
  layers = flops.layer_flops(model, (batch, 8, 8, 3))
  assert [layer.kind for layer in layers] == ["conv", "dense"]
  conv, linear = layers
  # 3x3 conv 3→8 on 8x8 SAME: 8·8 outputs per channel, each 3·3·3 MACs, 8 channels, 2 FLOPs/MAC.
  conv_fwd = batch * 2 * 8 * 8 * 3 * 3 * 3 * 8
  assert conv.forward == conv_fwd == 2 * 27648
  assert conv.backward_weight == conv_fwd
  assert conv.backward_data == 0  # first layer: no gradient w.r.t. the images
  assert not conv.has_input_grad
  # Linear 8→10 on the pooled features: batch·8·10 MACs.
  lin_fwd = batch * 2 * 8 * 10
  assert (linear.forward, linear.backward_data, linear.backward_weight) == (lin_fwd,) * 3
  assert linear.has_input_grad
  assert flops.inference_flops(model, (batch, 8, 8, 3)) == conv_fwd + lin_fwd
  assert flops.training_flops_per_step(model, (batch, 8, 8, 3)) == 2 * conv_fwd + 3 * lin_fwd
  # The same totals from the precomputed layer list.
  assert flops.training_flops_per_step(layers) == 2 * conv_fwd + 3 * lin_fwd
  assert flops.inference_flops(layers) == conv_fwd + lin_fwd


@pytest.mark.parametrize(
  "strides, padding, groups, cin, cout, out_hw",
  [
    ((1, 1), "SAME", 1, 4, 6, (8, 8)),
    ((1, 1), "VALID", 1, 4, 6, (6, 6)),  # 8 − 3 + 1
    ((2, 2), "SAME", 1, 4, 6, (4, 4)),  # ceil(8 / 2)
    ((2, 2), "VALID", 1, 4, 6, (3, 3)),  # floor((8 − 3) / 2) + 1
    ((2, 1), ((1, 1), (0, 0)), 1, 4, 6, (4, 6)),
    ((1, 1), "SAME", 2, 4, 6, (8, 8)),  # grouped: each filter sees 4/2 channels
    ((1, 1), "SAME", 4, 4, 8, (8, 8)),  # depthwise with multiplier 2
  ],
)
def test_conv_stride_padding_groups(strides, padding, groups, cin, cout, out_hw, single_conv_fn):
  kernel = jnp.ones((3, 3, cin // groups, cout))
  fn = single_conv_fn(strides, padding, groups)
  (layer,) = flops.layer_flops(fn, (3, 8, 8, cin), params={"w": kernel})
  oh, ow = out_hw
  expected = 2 * 3 * oh * ow * 3 * 3 * (cin // groups) * cout
  assert layer.output_shape == (3, oh, ow, cout)
  assert layer.forward == expected
  assert layer.strides == tuple(strides)
  assert layer.feature_group_count == groups
  assert layer.kernel_shape == (3, 3, cin // groups, cout)


def test_valid_conv_and_dense_match_xla_cost_analysis(single_conv_fn):
  """XLA's own count (no padding involved, so the conventions agree) as an independent oracle."""
  x = jnp.ones((2, 9, 9, 4))
  w = jnp.ones((3, 3, 4, 5))
  fn = single_conv_fn((2, 2), "VALID", 1)
  cost = jax.jit(fn).lower({"w": w}, x).compile().cost_analysis()
  if not cost or "flops" not in cost:
    pytest.skip("XLA cost analysis unavailable on this backend")
  (layer,) = flops.layer_flops(fn, x.shape, params={"w": w})
  assert layer.forward == int(cost["flops"])

  dense_fn = lambda p, x: x @ p["w"]
  params = {"w": jnp.ones((7, 3))}
  cost = jax.jit(dense_fn).lower(params, jnp.ones((5, 7))).compile().cost_analysis()
  (layer,) = flops.layer_flops(dense_fn, (5, 7), params=params)
  assert layer.forward == int(cost["flops"]) == 2 * 5 * 7 * 3


def test_linear_on_sequence_counts_every_row():
  model = nnx.eval_shape(lambda: nnx.Linear(6, 4, rngs=nnx.Rngs(0)))
  (layer,) = flops.layer_flops(model, (2, 5, 6))
  assert layer.kind == "dense"
  assert layer.param_path == ("kernel",)
  assert layer.forward == 2 * (2 * 5) * 6 * 4
  # The input is the data itself: no input gradient.
  assert layer.backward_data == 0 and layer.backward_weight == layer.forward


def test_residual_block_counts_and_paths(tiny_resnet):
  model = tiny_resnet
  layers = flops.layer_flops(model, (1, 8, 8, 3))
  by_path = {layer.param_path: layer for layer in layers}
  block = ("stages", 0, 0)
  expected = {
    # stem 3x3 3→4 at 8x8
    ("stem", "conv", "kernel"): 2 * 8 * 8 * 3 * 3 * 3 * 4,
    # conv1 3x3 4→8 stride 2 → 4x4
    block + ("conv1", "conv", "kernel"): 2 * 4 * 4 * 3 * 3 * 4 * 8,
    # conv2 3x3 8→8 at 4x4
    block + ("conv2", "conv", "kernel"): 2 * 4 * 4 * 3 * 3 * 8 * 8,
    # shortcut 1x1 4→8 stride 2 → 4x4
    block + ("shortcut", "conv", "kernel"): 2 * 4 * 4 * 1 * 1 * 4 * 8,
    ("head", "kernel"): 2 * 8 * 5,
  }
  assert set(by_path) == set(expected)
  for path, fwd in expected.items():
    assert by_path[path].forward == fwd, path
  # Every mapped path names a real leaf of that shape.
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  for layer in layers:
    leaf = state
    for key in layer.param_path:
      leaf = leaf[key]
    assert leaf.shape == layer.param_shape == layer.kernel_shape
  # Only the stem reads the images; everything else needs the input gradient.
  assert [layer.has_input_grad for layer in layers] == [
    layer.param_path != ("stem", "conv", "kernel") for layer in layers
  ]


def test_input_normalization_still_has_no_input_gradient(conv):
  """Preprocessing without parameters does not create a need for the input gradient."""
  params = {"w": jnp.ones((3, 3, 3, 4)), "scale": jnp.ones((3,))}
  normalized = lambda p, x: conv((x - 0.5) / 0.25, p["w"])
  (layer,) = flops.layer_flops(normalized, (1, 8, 8, 3), params=params)
  assert layer.backward_data == 0
  # A learnable input scale does: the conv's input now depends on a parameter.
  scaled = lambda p, x: conv(x * p["scale"], p["w"])
  (layer,) = flops.layer_flops(scaled, (1, 8, 8, 3), params=params)
  assert layer.backward_data == layer.forward == 2 * 8 * 8 * 9 * 3 * 4


def test_stop_gradient_removes_the_gradients_it_blocks(conv):
  params = {"w1": jnp.ones((3, 3, 3, 4)), "w2": jnp.ones((3, 3, 4, 4))}

  def fn(p, x):
    y = conv(x, p["w1"])
    # Frozen second kernel, and a frozen feature extractor in front of it.
    return conv(jax.lax.stop_gradient(y), jax.lax.stop_gradient(p["w2"]))

  first, second = flops.layer_flops(fn, (1, 6, 6, 3), params=params)
  assert second.param_path == ("w2",)
  assert second.backward_data == 0 and second.backward_weight == 0
  assert first.backward_weight == first.forward


# ---------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------


def _half_masks(model):
  """Pure-dict masks keeping the first half of every conv's filters and dense columns."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  masks = jax.tree.map(lambda a: np.ones(a.shape, bool), params)
  masks["conv"]["kernel"][..., 4:] = False
  masks["linear"]["kernel"][:, 5:] = False
  return masks


def test_masks_halve_flops(conv_bn_linear):
  model = conv_bn_linear
  dense = flops.layer_flops(model, (2, 8, 8, 3))
  masked = flops.layer_flops(model, (2, 8, 8, 3), masks=_half_masks(model))
  for d, m in zip(dense, masked):
    assert 2 * m.forward == d.forward == m.dense_forward
    assert 2 * m.backward_weight == d.backward_weight
    assert 2 * m.backward_data == d.backward_data
    assert 2 * m.weight_nnz == d.weight_size
  # Masked conv: 2 · out_h · out_w · batch · nnz(kernel).
  assert masked[0].forward == 2 * 8 * 8 * 2 * (3 * 3 * 3 * 4)


def test_channel_masks_equal_the_reconfigured_narrow_model(conv):
  """PruneTrain invariant: masking dead channels costs what the smaller rebuilt model costs."""

  def two_convs(p, x):
    return conv(jax.nn.relu(conv(x, p["c1"], (2, 2))), p["c2"])

  wide = {"c1": jnp.ones((3, 3, 3, 8)), "c2": jnp.ones((3, 3, 8, 6))}
  keep = np.array([1, 0, 1, 1, 0, 0, 1, 0], bool)  # 4 of 8 middle channels live
  masks = {
    "c1": np.broadcast_to(keep, (3, 3, 3, 8)),  # dead output filters of c1
    "c2": np.broadcast_to(keep[:, None], (3, 3, 8, 6)),  # and the inputs reading them
  }
  narrow = {"c1": jnp.ones((3, 3, 3, 4)), "c2": jnp.ones((3, 3, 4, 6))}
  masked = flops.layer_flops(two_convs, (2, 9, 9, 3), params=wide, masks=masks)
  rebuilt = flops.layer_flops(two_convs, (2, 9, 9, 3), params=narrow)
  for m, r in zip(masked, rebuilt):
    assert (m.forward, m.backward_data, m.backward_weight) == (
      r.forward,
      r.backward_data,
      r.backward_weight,
    )
  # A run that trains 10 epochs wide, then 20 epochs narrow (100 images per epoch).
  per_image = lambda p: flops.training_flops_per_step(two_convs, (1, 9, 9, 3), params=p)
  segments = [(per_image(wide), 10 * 100), (per_image(narrow), 20 * 100)]
  total = flops.integrate_training_flops(segments)
  assert total == 1000 * per_image(wide) + 2000 * per_image(narrow)
  assert per_image(narrow) * 2 == per_image(wide)  # both convs halve


def test_mask_forms_agree(conv_bn_linear):
  model = conv_bn_linear
  pattern = np.zeros((3, 3, 3, 8), bool)
  pattern[0, 0] = pattern[1, 1] = pattern[2, 2] = pattern[1, 2] = True  # 4 of 9 per kernel
  per_layer = flops.layer_flops(model, (1, 8, 8, 3), masks={("conv", "kernel"): pattern})
  as_tree = flops.layer_flops(model, (1, 8, 8, 3), masks={"conv": {"kernel": pattern}})
  state = nnx.state(model, nnx.Param)
  as_state = jax.tree.map(lambda a: np.ones(a.shape), state)
  as_state["conv"]["kernel"].set_value(pattern)
  from_state = flops.layer_flops(model, (1, 8, 8, 3), masks=as_state)
  assert per_layer == as_tree == from_state
  assert per_layer[0].forward == 2 * 8 * 8 * 4 * 3 * 8
  assert per_layer[1].forward == 2 * 8 * 10  # linear unmasked


def test_backward_data_density_scales_conv_data_gradients_only(tiny_resnet):
  model = tiny_resnet
  layers = flops.layer_flops(model, (1, 8, 8, 3))
  conv_data = sum(l.backward_data for l in layers if l.kind == "conv")
  full = flops.training_flops_per_step(layers)
  sparse = flops.training_flops_per_step(layers, backward_data_density=0.5)
  assert full - sparse == pytest.approx(conv_data / 2)


# ---------------------------------------------------------------------------------------------
# Integration over a run
# ---------------------------------------------------------------------------------------------


def test_integrate_training_flops_sums_segments():
  # PruneTrain-like run: 3 segments of 10 epochs × 100 images with shrinking per-image cost.
  segments = [(900.0, 1000), (600.0, 1000), (300.0, 1000)]
  assert flops.integrate_training_flops(segments) == 900 * 1000 + 600 * 1000 + 300 * 1000
  assert flops.integrate_training_flops([]) == 0.0
  with pytest.raises(ValueError, match="segments"):
    flops.integrate_training_flops([(1.0, -1)])
  with pytest.raises(ValueError, match="segments"):
    flops.integrate_training_flops([(1.0, 2.0, 3.0)])


# ---------------------------------------------------------------------------------------------
# The library's models
# ---------------------------------------------------------------------------------------------


def _resnet20_macs_per_image() -> int:
  """He et al. CIFAR ResNet-20 with 1x1 projection shortcuts (PruneTrain), counted by hand."""
  conv = lambda hw, k, cin, cout: hw * hw * k * k * cin * cout  # MACs of one conv
  stem = conv(32, 3, 3, 16)
  stage1 = 6 * conv(32, 3, 16, 16)  # 3 blocks × 2 convs at 32x32
  stage2 = (
    conv(16, 3, 16, 32)  # first conv, stride 2 → 16x16
    + conv(16, 1, 16, 32)  # projection shortcut
    + 5 * conv(16, 3, 32, 32)
  )
  stage3 = conv(8, 3, 32, 64) + conv(8, 1, 32, 64) + 5 * conv(8, 3, 64, 64)
  head = 64 * 10
  return stem + stage1 + stage2 + stage3 + head


def test_prunetrain_resnet20_matches_hand_count():
  model = nnx.eval_shape(
    lambda: models.create("prunetrain-resnet20", num_classes=10, rngs=nnx.Rngs(0))
  )
  macs = _resnet20_macs_per_image()
  # Conv MACs with identity shortcuts are the commonly quoted ≈ 40.55 M (40 550 400); PruneTrain's
  # two 1x1 projections add 2 × 131 072 and the 64→10 head 640.
  assert macs == 40_550_400 + 2 * 131_072 + 640 == 40_813_184
  layers = flops.layer_flops(model, (1, 32, 32, 3))
  assert flops.inference_flops(layers) == 2 * macs  # ≈ 81.6 MFLOPs at 2 FLOPs / MAC
  assert len(layers) == 1 + 18 + 2 + 1  # stem, 9 blocks × 2 convs, 2 projections, head
  assert layers[0].param_path == ("stem", "conv", "kernel")
  assert layers[1].param_path == ("stages", 0, 0, "conv1", "conv", "kernel")
  assert layers[-1].param_path == ("head", "kernel")
  # Training: fwd + bwd-weight for every layer, bwd-data for all but the stem.
  stem_fwd = 2 * 32 * 32 * 3 * 3 * 3 * 16
  assert flops.training_flops_per_step(layers) == 3 * 2 * macs - stem_fwd
  # Batch scales linearly.
  assert flops.inference_flops(model, (4, 32, 32, 3)) == 4 * 2 * macs
  report = flops.model_flops_report(model, (1, 32, 32, 3))
  assert f"inference FLOPs: {2 * macs:,}" in report


def _imagenet_resnet50_macs_per_image() -> int:
  """torchvision ResNet-50 v1.5 (stride on the 3x3 of the bottleneck) at 224x224, by hand."""
  conv = lambda hw, k, cin, cout: hw * hw * k * k * cin * cout
  macs = conv(112, 7, 3, 64)  # stem 7x7/2, then 3x3/2 max pool → 56x56
  cin, hw = 64, 56
  for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
    for b in range(blocks):
      s = stride if b == 0 else 1
      out_hw = hw // s
      macs += conv(hw, 1, cin, width)  # 1x1 reduce at the input resolution
      macs += conv(out_hw, 3, width, width)  # strided 3x3
      macs += conv(out_hw, 1, width, 4 * width)  # 1x1 expand
      if b == 0:
        macs += conv(out_hw, 1, cin, 4 * width)  # projection shortcut
      cin, hw = 4 * width, out_hw
  return macs + 2048 * 1000  # head


@pytest.mark.slow
def test_imagenet_resnet50_matches_hand_count():
  model = nnx.eval_shape(
    lambda: models.create("imagenet-resnet50", num_classes=1000, rngs=nnx.Rngs(0))
  )
  macs = _imagenet_resnet50_macs_per_image()
  assert 4.08e9 < macs < 4.10e9  # the commonly quoted ≈ 4.09 GMACs
  assert flops.inference_flops(model, (1, 224, 224, 3)) == 2 * macs


def test_sdgp_converted_model_keeps_its_layers():
  """SDGP's custom-VJP convs are traced through: same layers, same paths, same counts."""
  model = nnx.eval_shape(
    lambda: models.create("prunetrain-resnet20", num_classes=10, rngs=nnx.Rngs(0))
  )
  before = flops.layer_flops(model, (1, 32, 32, 3))
  converted = sdgp.convert_model(model, n=2, m=4, method="magnitude")
  swapped = [m for _, m in nnx.iter_modules(converted) if isinstance(m, sdgp.SDGPConv)]
  assert len(swapped) == len(before) - 2  # every conv except the RGB stem; not the head
  graphdef, state = nnx.split(converted)
  forward = lambda s, x: nnx.merge(graphdef, s)(x)
  x = jax.ShapeDtypeStruct((1, 8, 8, 3), jnp.float32)
  assert "custom_vjp_call" in str(jax.make_jaxpr(forward)(state, x))
  after = flops.layer_flops(converted, (1, 32, 32, 3))
  assert after == before
  # SDGP's FLOPs view: the 2:4 pruned output gradient halves the data-gradient convs.
  conv_data = sum(l.backward_data for l in after if l.kind == "conv")
  assert flops.training_flops_per_step(after, backward_data_density=0.5) == pytest.approx(
    flops.training_flops_per_step(after) - conv_data / 2
  )


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_bad_input_raises_value_error(conv_bn_linear, single_conv_fn):
  model = conv_bn_linear
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops(model, (8, 3))  # rank 2: a 2-D conv needs (batch..., H, W, C)
  with pytest.raises(ValueError, match="input_shape"):
    conv_fn = single_conv_fn((1, 1), "SAME", 1)
    flops.layer_flops(conv_fn, (8, 8, 3), params={"w": jnp.ones((3, 3, 3, 4))})
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops(model, (1, 8, 8, 5))  # wrong channel count
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops(model, (0, 8, 8, 3))
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops(model, 7)
  with pytest.raises(ValueError, match="masks"):
    flops.layer_flops(model, (1, 8, 8, 3), masks={"conv": {"kernel": np.ones((3, 3, 3, 4))}})
  with pytest.raises(ValueError, match="masks"):
    flops.layer_flops(model, (1, 8, 8, 3), masks={("nope", "kernel"): np.ones(3)})
  with pytest.raises(ValueError, match="params"):
    flops.layer_flops(lambda p, x: x, (1, 3))
  with pytest.raises(ValueError, match="params"):
    flops.layer_flops(model, (1, 8, 8, 3), params={"w": 1})
  with pytest.raises(ValueError, match="model_or_fn"):
    flops.layer_flops(42, (1, 3), params={})
  with pytest.raises(ValueError, match="backward_data_density"):
    flops.training_flops_per_step(model, (1, 8, 8, 3), backward_data_density=1.5)
  with pytest.raises(ValueError, match="input_shape"):
    flops.inference_flops(model)
