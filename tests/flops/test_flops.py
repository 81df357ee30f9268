"""Tests for jaxprune.flops: hand-counted FLOPs, tracing-based layer discovery, masks, ratios."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import flops


# ---------------------------------------------------------------------------------------------
# Small models defined here, independent of jaxprune.models
# ---------------------------------------------------------------------------------------------


class ConvBNLinear(nnx.Module):
  """3x3 conv 3→8 (SAME) → BN → ReLU → global average pool → Linear 8→10."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(3, 8, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.linear = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    return self.linear(x.mean(axis=(1, 2)))


class ConvBNAct(nnx.Module):
  def __init__(self, cin, cout, k, stride, rngs):
    self.conv = nnx.Conv(cin, cout, (k, k), strides=stride, use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(cout, rngs=rngs)

  def __call__(self, x):
    return self.bn(self.conv(x))


class ResidualBlock(nnx.Module):
  """relu(conv2(relu(conv1(x))) + shortcut(x)) with a strided 1x1 projection shortcut."""

  def __init__(self, cin, cout, stride, rngs):
    self.conv1 = ConvBNAct(cin, cout, 3, stride, rngs)
    self.conv2 = ConvBNAct(cout, cout, 3, 1, rngs)
    self.shortcut = ConvBNAct(cin, cout, 1, stride, rngs)

  def __call__(self, x):
    y = self.conv2(nnx.relu(self.conv1(x)))
    return nnx.relu(y + self.shortcut(x))


class TinyResNet(nnx.Module):
  def __init__(self, rngs):
    self.stem = ConvBNAct(3, 4, 3, 1, rngs)
    self.stages = nnx.List([nnx.List([ResidualBlock(4, 8, 2, rngs)])])
    self.head = nnx.Linear(8, 5, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    for stage in self.stages:
      for block in stage:
        x = block(x)
    return self.head(x.mean(axis=(1, 2)))


def _abstract(model_class, *args):
  """The model with shape-only weights: FLOPs need no values, and eager init is slow on CPU."""
  return nnx.eval_shape(lambda: model_class(*args, nnx.Rngs(0)))


def _conv(x, w, strides=(1, 1), padding="SAME", groups=1):
  return jax.lax.conv_general_dilated(
    x,
    w,
    strides,
    padding,
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
    feature_group_count=groups,
  )


def _single_conv_fn(strides, padding, groups):
  return lambda p, x: _conv(x, p["w"], strides, padding, groups)


# ---------------------------------------------------------------------------------------------
# Hand-counted FLOPs
# ---------------------------------------------------------------------------------------------


def test_conv_bn_linear_hand_count():
  model = _abstract(ConvBNLinear)
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
def test_conv_stride_padding_groups(strides, padding, groups, cin, cout, out_hw):
  kernel = jnp.ones((3, 3, cin // groups, cout))
  fn = _single_conv_fn(strides, padding, groups)
  (layer,) = flops.layer_flops(fn, (3, 8, 8, cin), params={"w": kernel})
  oh, ow = out_hw
  expected = 2 * 3 * oh * ow * 3 * 3 * (cin // groups) * cout
  assert layer.output_shape == (3, oh, ow, cout)
  assert layer.forward == expected
  assert layer.strides == tuple(strides)
  assert layer.feature_group_count == groups
  assert layer.kernel_shape == (3, 3, cin // groups, cout)


def test_valid_conv_and_dense_match_xla_cost_analysis():
  """XLA's own count (no padding involved, so the conventions agree) as an independent oracle."""
  x = jnp.ones((2, 9, 9, 4))
  w = jnp.ones((3, 3, 4, 5))
  fn = _single_conv_fn((2, 2), "VALID", 1)
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


def test_residual_block_counts_and_paths():
  model = _abstract(TinyResNet)
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


def test_input_normalization_still_has_no_input_gradient():
  """Preprocessing without parameters does not create a need for the input gradient."""
  params = {"w": jnp.ones((3, 3, 3, 4)), "scale": jnp.ones((3,))}
  normalized = lambda p, x: _conv((x - 0.5) / 0.25, p["w"])
  (layer,) = flops.layer_flops(normalized, (1, 8, 8, 3), params=params)
  assert layer.backward_data == 0
  # A learnable input scale does: the conv's input now depends on a parameter.
  scaled = lambda p, x: _conv(x * p["scale"], p["w"])
  (layer,) = flops.layer_flops(scaled, (1, 8, 8, 3), params=params)
  assert layer.backward_data == layer.forward == 2 * 8 * 8 * 9 * 3 * 4


def test_stop_gradient_removes_the_gradients_it_blocks():
  params = {"w1": jnp.ones((3, 3, 3, 4)), "w2": jnp.ones((3, 3, 4, 4))}

  def fn(p, x):
    y = _conv(x, p["w1"])
    # Frozen second kernel, and a frozen feature extractor in front of it.
    return _conv(jax.lax.stop_gradient(y), jax.lax.stop_gradient(p["w2"]))

  first, second = flops.layer_flops(fn, (1, 6, 6, 3), params=params)
  assert second.param_path == ("w2",)
  assert second.backward_data == 0 and second.backward_weight == 0
  assert first.backward_weight == first.forward


# ---------------------------------------------------------------------------------------------
# Tracing through wrappers
# ---------------------------------------------------------------------------------------------


def test_paths_found_through_jit_custom_vjp_mask_and_dtype_cast():
  @jax.custom_vjp
  def custom_conv(x, w):
    return _conv(x, w)

  custom_conv.defvjp(
    lambda x, w: (_conv(x, w), (x, w)),
    lambda res, g: jax.vjp(_conv, *res)[1](g),
  )

  def fn(params, x):
    kernel = (params["block"]["w"] * params["mask"]).astype(jnp.bfloat16).astype(jnp.float32)
    y = jax.jit(custom_conv)(x, kernel)
    y = jax.checkpoint(lambda y, w: _conv(jax.nn.relu(y), w))(y, params["second"])
    return y.mean(axis=(1, 2)) @ params["head"].T

  params = {
    "block": {"w": jnp.ones((3, 3, 3, 4))},
    "mask": jnp.ones((3, 3, 3, 4)),
    "second": jnp.ones((3, 3, 4, 4)),
    "head": jnp.ones((2, 4)),
  }
  layers = flops.layer_flops(fn, (1, 6, 6, 3), params=params)
  # The masked kernel multiplies two parameter leaves of the same shape: the first is kept.
  assert [layer.param_path for layer in layers] == [("block", "w"), ("second",), ("head",)]
  assert layers[2].kernel_shape == (4, 2)  # transposed view of the (2, 4) leaf
  assert layers[2].forward == 2 * 4 * 2


def test_scan_over_stacked_layers_multiplies_by_length():
  depth, width, batch = 3, 6, 4

  def fn(params, x):
    def body(h, w):
      return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, x, params["stack"])
    return h

  params = {"stack": jnp.ones((depth, width, width))}
  (layer,) = flops.layer_flops(fn, (batch, width), params=params)
  assert layer.count == depth
  assert layer.param_path == ("stack",)
  assert layer.forward == depth * 2 * batch * width * width
  # A mask keeping one third of the stacked weights keeps one third of the FLOPs in total.
  mask = np.zeros((depth, width, width))
  mask[:, :, :2] = 1
  (masked,) = flops.layer_flops(fn, (batch, width), params=params, masks={"stack": mask})
  assert masked.forward * 3 == layer.forward


def test_pallas_call_body_counts_once_per_grid_step():
  pallas = pytest.importorskip("jax.experimental.pallas")

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = x_ref[...] @ w_ref[...]

  def fn(params, x):
    return pallas.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((16, 8), jnp.float32),
      grid=(2,),
      in_specs=[
        pallas.BlockSpec((8, 4), lambda i: (i, 0)),
        pallas.BlockSpec((4, 8), lambda i: (0, 0)),
      ],
      out_specs=pallas.BlockSpec((8, 8), lambda i: (i, 0)),
      interpret=True,
    )(x, params["w"])

  (layer,) = flops.layer_flops(fn, (16, 4), params={"w": jnp.ones((4, 8))})
  assert layer.count == 2
  assert layer.forward == 2 * 16 * 4 * 8  # two 8-row blocks of the 16×4 @ 4×8 product
  assert layer.param_path == ("w",)  # the block is the whole weight


def test_activation_matmul_is_reported_without_weight():
  def fn(params, x):
    q = x @ params["wq"]
    return jnp.einsum("btd,bsd->bts", q, q)

  params = {"wq": jnp.ones((4, 4))}
  dense, matmul = flops.layer_flops(fn, (2, 5, 4), params=params)
  assert dense.kind == "dense" and dense.param_path == ("wq",)
  assert matmul.kind == "matmul" and matmul.param_path is None
  assert matmul.forward == 2 * 2 * 5 * 5 * 4
  assert matmul.backward_weight == 0
  assert matmul.backward_data == 2 * matmul.forward  # gradient to both operands


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


def test_masks_halve_flops():
  model = _abstract(ConvBNLinear)
  dense = flops.layer_flops(model, (2, 8, 8, 3))
  masked = flops.layer_flops(model, (2, 8, 8, 3), masks=_half_masks(model))
  for d, m in zip(dense, masked):
    assert 2 * m.forward == d.forward == m.dense_forward
    assert 2 * m.backward_weight == d.backward_weight
    assert 2 * m.backward_data == d.backward_data
    assert 2 * m.weight_nnz == d.weight_size
  # Masked conv: 2 · out_h · out_w · batch · nnz(kernel).
  assert masked[0].forward == 2 * 8 * 8 * 2 * (3 * 3 * 3 * 4)


def test_channel_masks_equal_the_reconfigured_narrow_model():
  """PruneTrain invariant: masking dead channels costs what the smaller rebuilt model costs."""

  def two_convs(p, x):
    return _conv(jax.nn.relu(_conv(x, p["c1"], (2, 2))), p["c2"])

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


def test_mask_forms_agree():
  model = _abstract(ConvBNLinear)
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


def test_backward_data_density_scales_conv_data_gradients_only():
  model = _abstract(TinyResNet)
  layers = flops.layer_flops(model, (1, 8, 8, 3))
  conv_data = sum(l.backward_data for l in layers if l.kind == "conv")
  full = flops.training_flops_per_step(layers)
  sparse = flops.training_flops_per_step(layers, backward_data_density=0.5)
  assert full - sparse == pytest.approx(conv_data / 2)


# ---------------------------------------------------------------------------------------------
# Integration, reports
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


def test_format_table_rows_and_totals():
  model = _abstract(TinyResNet)
  layers = flops.layer_flops(model, (1, 8, 8, 3))
  table = flops.format_table(layers, scale=1.0, unit="FLOPs")
  lines = table.splitlines()
  assert len(lines) == 2 + len(layers) + 1
  assert lines[2].startswith("| stem/conv/kernel | conv | 3×3×3×4 |")
  total_cells = [c.strip() for c in lines[-1].split("|")[1:-1]]
  assert float(total_cells[8]) == pytest.approx(sum(l.forward for l in layers), rel=1e-3)
  assert float(total_cells[11]) == pytest.approx(flops.training_flops_per_step(layers), rel=1e-3)


def test_model_flops_report_mentions_totals():
  model = _abstract(TinyResNet)
  report = flops.model_flops_report(model, (1, 8, 8, 3))
  inference = flops.inference_flops(model, (1, 8, 8, 3))
  assert f"inference FLOPs: {inference:,}" in report
  assert "stages/0/0/shortcut/conv/kernel" in report


# ---------------------------------------------------------------------------------------------
# Compression ratio, sparsity
# ---------------------------------------------------------------------------------------------


def _pattern_params(rng, cin=4, cout=6, kernel_prune=0.0):
  """Conv kernel with 4 of 9 weights kept per kernel, and a fraction of whole kernels zeroed."""
  w = rng.normal(size=(3, 3, cin, cout)) + 3.0  # no accidental zeros
  mask = np.zeros_like(w, dtype=bool)
  for c in range(cin):
    for f in range(cout):
      keep = rng.choice(9, size=4, replace=False)
      mask[:, :, c, f].flat[keep] = True
  n_pruned = int(round(kernel_prune * cin * cout))
  for flat in rng.choice(cin * cout, size=n_pruned, replace=False):
    mask[:, :, flat // cout, flat % cout] = False
  return {"conv": {"kernel": w}, "dense": {"kernel": np.ones((5, 3)), "bias": np.ones(3)}}, mask


def test_compression_ratio_pattern_and_kernel_pruning():
  rng = np.random.default_rng(0)
  params, mask = _pattern_params(rng)
  masks = {"conv": {"kernel": mask}}
  assert flops.compression_ratio(params, masks) == pytest.approx(9 / 4)
  assert flops.conv_sparsity(params, masks) == pytest.approx(5 / 9)
  # Zeroed in the params themselves (hard prune) instead of via masks: same ratio.
  hard = {"conv": {"kernel": params["conv"]["kernel"] * mask}, "dense": params["dense"]}
  assert flops.compression_ratio(hard) == pytest.approx(9 / 4)
  assert flops.compression_ratio(params) == 1.0  # dense
  # ClickTrain: 3x3 layer with kernel-prune ratio p → 9/4 · 1/(1 − p).
  params, mask = _pattern_params(rng, cin=4, cout=5, kernel_prune=0.5)
  assert flops.compression_ratio(params, {"conv": {"kernel": mask}}) == pytest.approx(
    9 / 4 / (1 - 0.5)
  )


def test_compression_ratio_edge_cases():
  params = {"conv": {"kernel": np.ones((3, 3, 2, 2))}}
  assert flops.compression_ratio(params, {"conv": {"kernel": np.zeros((3, 3, 2, 2))}}) == math.inf
  assert flops.conv_sparsity({"conv": {"kernel": np.zeros((3, 3, 2, 2))}}) == 1.0
  with pytest.raises(ValueError, match="conv kernels"):
    flops.compression_ratio({"dense": np.ones((4, 4))})
  with pytest.raises(ValueError, match="masks"):
    flops.compression_ratio(params, {"conv": {"kernel": np.ones((3, 3, 2, 3))}})
  # NNX State works too (Variables flatten through `.value`).
  abstract_state = nnx.state(_abstract(ConvBNLinear), nnx.Param)
  state = jax.tree.map(lambda a: np.full(a.shape, 0.5, np.float32), abstract_state)
  assert flops.compression_ratio(state) == 1.0
  with pytest.raises(ValueError, match="abstract"):
    flops.compression_ratio(nnx.state(_abstract(ConvBNLinear), nnx.Param))


# ---------------------------------------------------------------------------------------------
# Memory traffic and communication
# ---------------------------------------------------------------------------------------------


def test_batchnorm_traffic_found_by_tracing():
  model = _abstract(TinyResNet)
  traffic = flops.batchnorm_traffic(model, (2, 8, 8, 3))
  names = [t.name for t in traffic]
  assert names == [
    "stem/bn",
    "stages/0/0/conv1/bn",
    "stages/0/0/conv2/bn",
    "stages/0/0/shortcut/bn",
  ]
  shapes = [t.activation_shape for t in traffic]
  assert shapes == [(2, 8, 8, 4), (2, 4, 4, 8), (2, 4, 4, 8), (2, 4, 4, 8)]
  stem = traffic[0]
  assert stem.activation_bytes == 2 * 8 * 8 * 4 * 4  # float32
  # forward: 2 reads + 1 write; backward: 4 reads + 1 write; inference: 1 read + 1 write.
  assert (stem.forward_bytes, stem.backward_bytes, stem.inference_bytes) == (
    3 * stem.activation_bytes,
    5 * stem.activation_bytes,
    2 * stem.activation_bytes,
  )
  assert stem.training_bytes == 8 * stem.activation_bytes
  # A plain function: one BN assumed after each conv, on its output.
  fn_traffic = flops.batchnorm_traffic(
    _single_conv_fn((2, 2), "SAME", 1), (2, 8, 8, 3), params={"w": jnp.ones((3, 3, 3, 5))}
  )
  assert [t.activation_shape for t in fn_traffic] == [(2, 4, 4, 5)]


def test_layer_flops_and_batchnorm_traffic_equal_the_separate_calls():
  model = _abstract(TinyResNet)
  layers, traffic = flops.layer_flops_and_batchnorm_traffic(model, (2, 8, 8, 3))
  assert layers == flops.layer_flops(model, (2, 8, 8, 3))
  assert traffic == flops.batchnorm_traffic(model, (2, 8, 8, 3))
  fn, params = _single_conv_fn((2, 2), "SAME", 1), {"w": jnp.ones((3, 3, 3, 5))}
  fn_layers, fn_traffic = flops.layer_flops_and_batchnorm_traffic(fn, (2, 8, 8, 3), params=params)
  assert fn_layers == flops.layer_flops(fn, (2, 8, 8, 3), params=params)
  assert fn_traffic == flops.batchnorm_traffic(fn, (2, 8, 8, 3), params=params)
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops_and_batchnorm_traffic(model, (2, 8, 8))


def test_allreduce_bytes_ring_model():
  params = {"conv": np.ones((3, 3, 4, 8), np.float32), "bias": np.ones(8, np.float32)}
  grad_bytes = (3 * 3 * 4 * 8 + 8) * 4
  assert flops.allreduce_bytes(params, 4) == pytest.approx(2 * 3 / 4 * grad_bytes)
  assert flops.allreduce_bytes(params, 1) == 0.0
  mask = np.zeros((3, 3, 4, 8), bool)
  mask[1, 1] = True  # keep 4·8 entries
  masked = flops.allreduce_bytes(params, 8, masks={"conv": mask})
  assert masked == pytest.approx(2 * 7 / 8 * (4 * 8 + 8) * 4)
  half = {"conv": np.ones((3, 3, 4, 8), jnp.bfloat16)}
  assert flops.allreduce_bytes(half, 2) == pytest.approx(3 * 3 * 4 * 8 * 2)
  with pytest.raises(ValueError, match="num_devices"):
    flops.allreduce_bytes(params, 0)
  with pytest.raises(ValueError, match="num_devices"):
    flops.allreduce_bytes(params, 2.5)


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
  models = pytest.importorskip("jaxprune.models")
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
  models = pytest.importorskip("jaxprune.models")
  model = nnx.eval_shape(
    lambda: models.create("imagenet-resnet50", num_classes=1000, rngs=nnx.Rngs(0))
  )
  macs = _imagenet_resnet50_macs_per_image()
  assert 4.08e9 < macs < 4.10e9  # the commonly quoted ≈ 4.09 GMACs
  assert flops.inference_flops(model, (1, 224, 224, 3)) == 2 * macs


def test_sdgp_converted_model_keeps_its_layers():
  """SDGP's custom-VJP convs are traced through: same layers, same paths, same counts."""
  models = pytest.importorskip("jaxprune.models")
  sdgp = pytest.importorskip("jaxprune.sdgp")
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


def test_bad_input_raises_value_error():
  model = _abstract(ConvBNLinear)
  with pytest.raises(ValueError, match="input_shape"):
    flops.layer_flops(model, (8, 3))  # rank 2: a 2-D conv needs (batch..., H, W, C)
  with pytest.raises(ValueError, match="input_shape"):
    conv_fn = _single_conv_fn((1, 1), "SAME", 1)
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
