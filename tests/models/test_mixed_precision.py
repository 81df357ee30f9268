"""Mixed precision: bfloat16 compute, float32 parameters, statistics, optimizer state and logits;
the converters (SDGP, ClickTrain's sparse layers) and PruneTrain's rebuild keep the dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import clicktrain, data, models, sdgp, train
from jaxprune import prunetrain as pt
from jaxprune.clicktrain.execution import to_sparse_layers as sparse_convert
from jaxprune.clicktrain.execution.sparse_layers import AlignedConv, PatternConv
from jaxprune.sdgp.prune import SDGPSettings

BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)

# Relative tolerance of a bf16 forward against the fp32 one with the same parameters, as a
# fraction of the largest fp32 logit: bf16 keeps 8 mantissa bits (rounding 2^-9 ≈ 0.2 %), and
# the rounding of every layer's input adds up over depth; 0.5-0.6 % was seen on these models.
_FORWARD_RTOL = 3e-2


def _create(name, dtype=None, *, width_multiplier=0.125, **kwargs):
  return models.create(
    name,
    num_classes=10,
    rngs=nnx.Rngs(0),
    width_multiplier=width_multiplier,
    dtype=dtype,
    **kwargs,
  )


def _images(shape=(4, 16, 16, 3), seed=1):
  """Normal NHWC images (PruneTrain's VGG pools 5 times: it needs 32x32)."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _dtypes(tree):
  return {jnp.dtype(x.dtype) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)}


def _conv_dtypes(model):
  return {m.dtype for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Conv)}


@pytest.mark.parametrize("name", ["prunetrain-resnet20", "sdgp-resnet9", "prunetrain-vgg11"])
def test_bf16_forward_is_close_to_fp32_with_the_same_parameters(name):
  fp32, bf16 = _create(name), _create(name, jnp.bfloat16)
  # Same seed, same float32 parameters and statistics: only the compute dtype differs.
  for kind in (nnx.Param, nnx.BatchStat):
    for a, b in zip(jax.tree.leaves(nnx.state(fp32, kind)), jax.tree.leaves(nnx.state(bf16, kind))):
      np.testing.assert_array_equal(a, b)
  assert _conv_dtypes(bf16) == {BF16} and _conv_dtypes(fp32) == {None}
  x = _images((4, 32, 32, 3) if "vgg" in name else (4, 16, 16, 3))
  for mode in ("train", "eval"):
    getattr(fp32, mode)()
    getattr(bf16, mode)()
    want, got = fp32(x), bf16(x)
    assert want.dtype == F32 and got.dtype == F32  # the loss starts from float32 logits
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) <= _FORWARD_RTOL * scale
    # ...and bf16 did round: the two forwards are not the same computation.
    assert float(jnp.max(jnp.abs(got - want))) > 0


def test_activations_run_in_bf16_and_bn_statistics_update_in_float32():
  model = _create("prunetrain-resnet20", jnp.bfloat16)
  x = _images()
  h = model.stem(x)
  assert h.dtype == BF16
  assert model.stages[0][0](h).dtype == BF16
  # The running statistics are those of float32 normalisation of the same bf16 conv output.
  conv_out = model.stem.conv(x)
  assert conv_out.dtype == BF16
  batch = np.asarray(conv_out, np.float64)
  momentum = model.stem.bn.momentum
  np.testing.assert_allclose(
    model.stem.bn.mean[...], (1 - momentum) * batch.mean((0, 1, 2)), rtol=1e-5, atol=1e-7
  )
  assert model.stem.bn.mean[...].dtype == F32 and model.stem.bn.var[...].dtype == F32


def _loader(seed=0, size=16):
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, size=(32, size, size, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, size=32).astype(np.int32)
  dataset = data.Dataset.from_arrays(images, labels, num_classes=10)
  return data.Loader(dataset, 16, shuffle=True, seed=0, drop_last=True, prefetch=0)


def _clicktrain_tx():
  # The pattern pool from the first step: importance scores and votes accumulate during it.
  return clicktrain.clicktrain(
    train.sgd(0.05, momentum=0.9),
    steps_per_epoch=2,
    hard_prune_epoch=4,
    pool_start_epoch=0,
    pool_epochs=1,
    finalize_epochs=1,
  )


@pytest.mark.parametrize(
  ("name", "method"),
  [
    ("prunetrain-resnet20", "sgd"),
    ("clicktrain-vgg11", "sgd"),
    ("prunetrain-resnet20", "clicktrain"),
  ],
)
def test_parameters_statistics_and_optimizer_state_stay_float32_after_steps(name, method):
  model = _create(name, jnp.bfloat16)
  tx = _clicktrain_tx() if method == "clicktrain" else train.sgd(0.05, momentum=0.9)
  trainer = train.Trainer(model, tx, progress=False)
  before = jax.tree.map(np.asarray, nnx.as_pure(nnx.state(model, nnx.Param)))
  trainer.fit(_loader(), epochs=2)
  assert _dtypes(trainer.params) == {F32}
  assert _dtypes(trainer.opt_state) == {F32}
  stats = nnx.state(trainer.model, nnx.BatchStat)
  assert _dtypes(stats) == {F32}
  after = nnx.as_pure(nnx.state(trainer.model, nnx.Param))
  # The steps did train (small updates are not lost to bf16 rounding of the parameters).
  moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), after, before)
  assert all(jax.tree.leaves(moved))
  assert all(np.isfinite(r["train_loss"]) for r in trainer.history)
  assert trainer.model.dtype == BF16


def test_sdgp_conversion_keeps_bf16_and_prunes_bf16_cotangents(monkeypatch):
  model = sdgp.convert_model(
    _create("sdgp-resnet9", jnp.bfloat16), n=2, m=4, method="magnitude", seed=0
  )
  convs = [m for _, m in nnx.iter_modules(model) if isinstance(m, sdgp.SDGPConv)]
  assert convs and {c.dtype for c in convs} == {BF16}
  assert _dtypes(nnx.state(model, nnx.Param)) == {F32}
  seen = []
  prune = SDGPSettings.prune

  def spy(self, x, key):
    seen.append(jnp.dtype(x.dtype))
    return prune(self, x, key)

  monkeypatch.setattr(SDGPSettings, "prune", spy)
  x = _images()

  def loss(m):
    return jnp.mean(m(x) ** 2)

  grads = nnx.grad(loss)(model)
  assert seen and set(seen) == {BF16}
  assert len(seen) == len(convs)
  assert _dtypes(grads) == {F32}


def _shared_pattern_masks(model, seed=0):
  """A 4-of-9 pattern per input channel, shared by every filter (aligned for any filter
  grouping), on every 3x3 conv but the stem: ``(masks pytree, paths)``."""
  rng = np.random.default_rng(seed)
  pool = clicktrain.all_patterns(4, 3)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  masks = jax.tree.map(lambda _: None, params)
  for i, layer in enumerate(model.features):
    if i == 0:
      continue
    kh, kw, cin, cout = layer.conv.kernel.shape
    taps = np.transpose(pool[rng.integers(0, len(pool), cin)], (1, 2, 0))  # (3, 3, cin)
    mask = np.broadcast_to(taps[..., None], (kh, kw, cin, cout)).astype(np.float32)
    masks["features"][i]["conv"]["kernel"] = mask
    layer.conv.kernel[...] = layer.conv.kernel[...] * mask
  return masks


@pytest.mark.parametrize("filter_groups", [None, 1], ids=["pattern", "aligned"])
def test_clicktrain_sparse_layers_keep_bf16(filter_groups):
  model = _create("prunetrain-vgg11", jnp.bfloat16)
  masks = _shared_pattern_masks(model)
  x = _images((2, 32, 32, 3))
  model.eval()
  forward = nnx.jit(lambda m, x: m(x))  # eager, the sparse layers dispatch op by op
  want = forward(model, x)
  sparse_convert(model, masks, threshold=0.0, backend="reference", filter_groups=filter_groups)
  layer_class = PatternConv if filter_groups is None else AlignedConv
  converted = [m for _, m in nnx.iter_modules(model) if isinstance(m, layer_class)]
  assert len(converted) == len(model.features) - 1
  assert {c.dtype for c in converted} == {BF16}
  assert {c.param_dtype for c in converted} == {F32}
  assert model.features[1](model.features[0](x)).dtype == BF16
  got = forward(model, x)
  assert got.dtype == F32
  # Same bf16 products, summed in another order.
  assert float(jnp.max(jnp.abs(got - want))) <= _FORWARD_RTOL * float(jnp.max(jnp.abs(want)))


def test_measured_dispatch_times_the_layers_in_bf16(monkeypatch):
  """The default dispatch times each layer in its compute dtype: a bf16 model's pruned convs
  dense and sparse in bf16 (before, a float32 kernel and mask timed float32 convolutions)."""
  from jaxprune.clicktrain.execution import conversion

  seen = []

  def spy(conv, input_shape, kernel, *, repeats):
    x = jax.ShapeDtypeStruct(tuple(input_shape), kernel.dtype)
    seen.append((jnp.dtype(kernel.dtype), jnp.dtype(jax.eval_shape(conv, x, kernel).dtype)))
    return 2.0 if len(seen) % 2 else 1.0  # dense, then sparse: the sparse layer is faster

  monkeypatch.setattr(conversion, "time_train_pass", spy)
  model = _create("prunetrain-vgg11", jnp.bfloat16)
  masks = _shared_pattern_masks(model)
  _, choices = sparse_convert(
    model,
    masks,
    backend="reference",
    filter_groups=1,
    input_shape=(2, 32, 32, 3),
    check_model=False,  # the per-layer timings are the subject here
  )
  assert seen and set(seen) == {(BF16, BF16)}
  assert {c.backend for c in choices} == {"aligned"}
  assert {m.dtype for _, m in nnx.iter_modules(model) if isinstance(m, AlignedConv)} == {BF16}


def test_prunetrain_reconfigure_keeps_bf16():
  model = sdgp.convert_model(
    _create("prunetrain-resnet20", jnp.bfloat16, width_multiplier=0.5),
    n=2,
    m=4,
    method="magnitude",
  )
  block = model.stages[1][0]  # inner width 16: kill channels 4-11 (whole groups of m = 4)
  for kernel, axis in ((block.conv1.conv.kernel, 3), (block.conv2.conv.kernel, 2)):
    array = np.array(kernel[...])
    np.moveaxis(array, axis, 0)[4:12] = 0.0
    kernel[...] = array
  new_model, _, report = pt.reconfigure(model, None, count_flops=False)
  assert report.channels_after["stages/1/0/conv1"] == 8
  assert (new_model.dtype, new_model.param_dtype) == (BF16, F32)
  assert _conv_dtypes(new_model) == {BF16}
  assert any(isinstance(m, sdgp.SDGPConv) for _, m in nnx.iter_modules(new_model))
  assert _dtypes(nnx.state(new_model, nnx.Param)) == {F32}
  x = _images()
  model.eval()
  new_model.eval()
  want, got = model(x), new_model(x)
  assert got.dtype == F32
  np.testing.assert_allclose(got, want, rtol=0, atol=_FORWARD_RTOL * float(jnp.max(jnp.abs(want))))


def _top_n_numpy(x, n, m):
  """Plain-loop magnitude N:M: top n by |x| per group of m, ties to the lower index."""
  flat = np.asarray(x, np.float32).reshape(-1, m)
  out = np.zeros_like(flat)
  for g, group in enumerate(flat):
    keep = np.argsort(-np.abs(group), kind="stable")[:n]
    out[g, keep] = group[keep]
  return out.reshape(np.shape(x))


@pytest.mark.parametrize("method", ["magnitude", "rescaled_magnitude", "random", "mvue"])
@pytest.mark.parametrize(("n", "m"), [(2, 4), (1, 4), (4, 8)])
def test_nm_prune_on_bf16_keeps_exactly_n_of_m(method, n, m):
  rng = np.random.default_rng(n * 10 + m)
  # Few distinct nonzero values: many ties, which bf16 would create anyway.
  values = rng.choice([-3.0, -2.0, -1.0, -0.5, 0.5, 1.0, 2.0, 3.0], size=(2, 4, 4, 4 * m))
  x = jnp.asarray(values, jnp.bfloat16)
  key = jax.random.key(0) if method in ("random", "mvue") else None
  pruned = sdgp.nm_prune(x, n, m, method, key=key)
  assert pruned.dtype == BF16
  kept = np.count_nonzero(np.asarray(pruned, np.float32).reshape(-1, m), axis=-1)
  np.testing.assert_array_equal(kept, n)
  if method == "magnitude":
    np.testing.assert_array_equal(np.asarray(pruned, np.float32), _top_n_numpy(values, n, m))


@pytest.mark.parametrize("field", ["dtype", "param_dtype"])
def test_non_floating_dtype_raises_naming_the_argument(field):
  with pytest.raises(ValueError, match=field):
    models.create("prunetrain-resnet20", num_classes=10, rngs=nnx.Rngs(0), **{field: jnp.int32})
  with pytest.raises(ValueError, match=field):
    models.ConvBN(3, 8, rngs=nnx.Rngs(0), **{field: "not a dtype"})
