"""The shared conv-function protocol: PluggableConv against nnx.Conv, wrapper chains, keys."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import distributed, models

LAX_CONV = jax.lax.conv_general_dilated


@dataclasses.dataclass(frozen=True)
class _Scale:
  """A wrapper: ``factor * inner(...)``."""

  factor: float
  inner: models.ConvFunction = LAX_CONV

  def __call__(self, lhs, rhs, window_strides, padding, **geometry):
    return self.factor * self.inner(lhs, rhs, window_strides, padding, **geometry)


@dataclasses.dataclass(frozen=True)
class _Noisy:
  """A wrapper that draws: adds ``uniform(key)`` to every output (records nothing else)."""

  inner: models.ConvFunction = LAX_CONV

  def __call__(self, lhs, rhs, window_strides, padding, *, key, **geometry):
    y = self.inner(lhs, rhs, window_strides, padding, **geometry)
    return y + jax.random.uniform(key, y.shape, y.dtype)


def _shift(lhs, rhs, window_strides, padding, **geometry):
  """Another base: the dense conv plus one."""
  return LAX_CONV(lhs, rhs, window_strides, padding, **geometry) + 1.0


@pytest.mark.parametrize(
  "settings",
  [
    dict(strides=1, padding="SAME"),
    dict(strides=2, padding=1, use_bias=False),
    dict(strides=(1, 2), padding="VALID", kernel_dilation=2),
    dict(strides=1, padding=((1, 0), (2, 1)), feature_group_count=2, input_dilation=(2, 1)),
  ],
)
def test_pluggable_conv_with_lax_is_nnx_conv(settings):
  shape = (3, 3, 4 // settings.get("feature_group_count", 1), 6)
  mask = jnp.asarray(np.random.default_rng(0).integers(0, 2, shape), jnp.float32)
  conv = nnx.Conv(4, 6, (3, 3), mask=mask, rngs=nnx.Rngs(0), **settings)
  plugged = models.conv_sharing_variables(
    models.PluggableConv, conv, conv_general_dilated=LAX_CONV
  )
  assert plugged.kernel is conv.kernel and plugged.bias is conv.bias
  x = jax.random.normal(jax.random.key(1), (2, 7, 6, 4))

  def grads(layer):
    return nnx.grad(lambda layer, x: (layer(x) ** 2).sum(), argnums=(0, 1))(layer, x)

  np.testing.assert_allclose(plugged(x), conv(x), rtol=1e-6, atol=1e-6)
  (g_plugged, dx_plugged), (g_conv, dx_conv) = grads(plugged), grads(conv)
  np.testing.assert_allclose(dx_plugged, dx_conv, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(g_plugged["kernel"][...], g_conv["kernel"][...], rtol=1e-5)


def test_wrappers_compose_and_the_base_is_swapped_under_them():
  chain = _Scale(2.0, inner=_Scale(3.0))
  assert models.base_function(chain) is LAX_CONV
  swapped = models.with_base(chain, _shift)
  assert swapped == _Scale(2.0, inner=_Scale(3.0, inner=_shift))
  assert models.with_base(LAX_CONV, _shift) is _shift  # no wrapper: the base itself
  conv = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
  layer = models.conv_sharing_variables(models.PluggableConv, conv, conv_general_dilated=swapped)
  x = jax.random.normal(jax.random.key(2), (1, 5, 5, 3))
  expected = 6.0 * (conv(x) - conv.bias[...] + 1.0) + conv.bias[...]
  np.testing.assert_allclose(layer(x), expected, rtol=1e-5, atol=1e-5)


def _noisy_layer(key):
  conv = nnx.Conv(3, 4, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
  layer = models.conv_sharing_variables(models.PluggableConv, conv, conv_general_dilated=_Noisy())
  layer.draws = models.ConvKey(key)
  return conv, layer


def test_the_key_is_split_per_call_and_passed_explicitly():
  key = jax.random.key(7)
  conv, layer = _noisy_layer(key)
  x = jax.random.normal(jax.random.key(3), (1, 5, 5, 3))
  y1, y2 = layer(x), layer(x)
  # The reference: split the stored key, keep the first half, draw with the second.
  stored, first = jax.random.split(key)
  _, second = jax.random.split(stored)
  for y, draw in ((y1, first), (y2, second)):
    np.testing.assert_allclose(y - conv(x), jax.random.uniform(draw, y.shape), atol=1e-5)
  np.testing.assert_array_equal(
    jax.random.key_data(layer.draws[...]), jax.random.key_data(jax.random.split(stored)[0])
  )


def test_inside_a_mapped_step_each_device_folds_in_its_index():
  key = jax.random.key(7)
  conv, layer = _noisy_layer(key)
  graphdef, state = nnx.split(layer)
  x = jax.random.normal(jax.random.key(3), (2, 1, 5, 5, 3))

  def per_device(state, x):
    layer = nnx.merge(graphdef, state)
    return layer(x), nnx.state(layer)

  with distributed.per_device_keys("d"):
    y, states = jax.vmap(per_device, in_axes=(None, 0), axis_name="d")(state, x)
  stored, draw = jax.random.split(key)
  for device in range(2):
    expected = jax.random.uniform(jax.random.fold_in(draw, device), y[device].shape)
    np.testing.assert_allclose(y[device] - conv(x[device]), expected, atol=1e-5)
    # The stored key advances as on one device: the same on every device.
    np.testing.assert_array_equal(
      jax.random.key_data(states["draws"][...][device]), jax.random.key_data(stored)
    )


def test_a_converted_layer_keeps_the_key_variable():
  _, layer = _noisy_layer(jax.random.key(0))
  swapped = models.with_base(layer.conv_general_dilated, _shift)
  again = models.conv_sharing_variables(models.PluggableConv, layer, conv_general_dilated=swapped)
  assert again.draws is layer.draws and again.kernel is layer.kernel


def test_bad_layers_raise():
  with pytest.raises(ValueError, match="^padding 'CIRCULAR' is not supported by PluggableConv"):
    models.PluggableConv(
      3, 4, (3, 3), padding="CIRCULAR", conv_general_dilated=LAX_CONV, rngs=nnx.Rngs(0)
    )
  layer = models.PluggableConv(3, 4, (3, 3), conv_general_dilated=LAX_CONV, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="2-D convolutions only"):
    layer(jnp.ones((2, 1, 5, 5, 3)))
  layer.a = models.ConvKey(jax.random.key(0))
  layer.b = models.ConvKey(jax.random.key(1))
  with pytest.raises(ValueError, match="2 ConvKey Variables"):
    layer(jnp.ones((1, 5, 5, 3)))
