"""BlurPool (Zhang 2019) against a NumPy blur-then-subsample, and its place in the ResNets."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import models, sdgp
from jaxprune.models.layers import BlurPool, ConvBN, binomial_filter


def _blurpool_reference(x, size, stride, padding):
  """Blur every channel with the binomial filter (a plain loop), then keep every stride-th."""
  row = np.array([1.0])
  for _ in range(size - 1):
    row = np.convolve(row, [1.0, 1.0])  # Pascal's triangle
  f = np.outer(row, row) / np.outer(row, row).sum()
  lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
  mode = "constant" if padding == "zeros" else "reflect"
  xp = np.pad(x, ((0, 0), (lo, hi), (lo, hi), (0, 0)), mode=mode)
  n, h, w, c = x.shape
  blurred = np.zeros((n, h, w, c))
  for i, j in itertools.product(range(h), range(w)):
    blurred[:, i, j, :] = np.einsum("nabc,ab->nc", xp[:, i : i + size, j : j + size, :], f)
  return blurred[:, ::stride, ::stride, :]


@pytest.mark.parametrize(
  "size, stride, padding",
  [
    (3, 2, "zeros"),
    (3, 1, "zeros"),
    (3, 2, "reflect"),
    (4, 2, "reflect"),
    (5, 3, "zeros"),
    (1, 2, "zeros"),
  ],
)
def test_blurpool_matches_numpy_blur_then_stride(size, stride, padding):
  x = np.asarray(jax.random.normal(jax.random.key(0), (2, 9, 10, 3)))
  got = BlurPool(filter_size=size, stride=stride, padding=padding)(jnp.asarray(x))
  np.testing.assert_allclose(got, _blurpool_reference(x, size, stride, padding), atol=1e-5)


def test_binomial_filter_by_hand():
  np.testing.assert_allclose(binomial_filter(3), np.array([[1, 2, 1], [2, 4, 2], [1, 2, 1]]) / 16)
  assert binomial_filter(5).sum() == pytest.approx(1.0)


def test_blurpool_bad_arguments():
  with pytest.raises(ValueError, match="^filter_size must be an int in"):
    BlurPool(filter_size=8)
  with pytest.raises(ValueError, match="^stride must be a positive int"):
    BlurPool(stride=0)
  with pytest.raises(ValueError, match="^padding must be one of"):
    BlurPool(padding="same")
  with pytest.raises(ValueError, match="^x must be NHWC"):
    BlurPool()(jnp.zeros((4, 4, 3)))


def test_convbn_blurpool_blurs_then_convolves():
  x = np.asarray(jax.random.normal(jax.random.key(1), (2, 8, 8, 16)))
  blurred = ConvBN(16, 8, 3, strides=2, blurpool=True, rngs=nnx.Rngs(3))
  plain = ConvBN(16, 8, 3, strides=2, rngs=nnx.Rngs(3))  # same params: the blur has none
  jax.tree.map(
    np.testing.assert_array_equal, nnx.state(blurred, nnx.Param), nnx.state(plain, nnx.Param)
  )
  forward = nnx.jit(lambda layer, x: layer(x))
  want = forward(plain, jnp.asarray(_blurpool_reference(x, 3, 1, "zeros"), jnp.float32))
  np.testing.assert_allclose(forward(blurred, jnp.asarray(x)), want, atol=1e-5)


def _blurred_paths(model):
  return sorted(
    "/".join(map(str, path))
    for path, m in nnx.iter_modules(model)
    if isinstance(m, ConvBN) and m.blur is not None
  )


def test_imagenet_resnet50_blurpool_sits_before_every_strided_conv_but_the_stem():
  model = nnx.eval_shape(lambda: sdgp.paper_model("imagenet", num_classes=1000, rngs=nnx.Rngs(0)))
  assert model.spec.blurpool
  # Strided convs with >= 16 input channels (the released apply_blurpool rule): each later
  # stage's first 3x3 and its projection; stage 0 has stride 1 and the stem reads RGB.
  assert _blurred_paths(model) == [
    f"stages/{s}/0/{name}" for s in (1, 2, 3) for name in ("conv2", "shortcut")
  ]
  assert models.param_count(model) == 25_557_032  # BlurPool has no parameters


def test_small_blurpool_resnet_runs_rebuilds_and_converts():
  spec = models.ResNetSpec.uniform(
    "bottleneck",
    stem_width=8,
    stage_widths=(16, 32),
    num_blocks=(1, 1),
    strides=(1, 2),
    inner_widths=((4, 4), (8, 8)),
    blurpool=True,
  )
  model = models.ResNet(spec, num_classes=3, rngs=nnx.Rngs(0))
  assert _blurred_paths(model) == ["stages/1/0/conv2", "stages/1/0/shortcut"]
  rebuilt = nnx.eval_shape(lambda: models.rebuild(model))
  assert _blurred_paths(rebuilt) == _blurred_paths(model)
  sdgp.convert_model(model, n=2, m=4, method="magnitude")
  assert isinstance(model.stages[1][0].conv2.conv, sdgp.SDGPConv)
  # traced, not compiled: the blur feeds the converted conv and the shapes line up
  assert nnx.eval_shape(lambda m, x: m(x), model, jnp.ones((1, 8, 8, 3))).shape == (1, 3)
  with pytest.raises(ValueError, match="^blurpool must be a bool"):
    models.create("imagenet-resnet18", num_classes=2, rngs=nnx.Rngs(0), blurpool=1)
