"""The aligned (group-shared) pattern convolution against the dense masked convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxprune.clicktrain import patterns
from jaxprune.clicktrain.aligned_conv import aligned_conv
from jaxprune.clicktrain.aligned_layout import aligned_mask, build_aligned_layout, group_filters
from jaxprune.clicktrain.sparse_execution import AlignedConv, convert_model

_NHWC = ("NHWC", "HWIO", "NHWC")


def _random_taps(rng, groups, cin, keep=0.6, size=3):
  """(G, Cin, size, size): a library pattern (3x3) or the single tap (1x1) per kept channel."""
  library = patterns.library_patterns() if size == 3 else np.ones((1, 1, 1))
  taps = np.zeros((groups, cin, size, size), np.float32)
  for g in range(groups):
    for c in range(cin):
      if rng.random() < keep:
        taps[g, c] = library[rng.integers(len(library))]
  return taps


def _dense(mask, strides, padding):
  def conv(x, w):
    return lax.conv_general_dilated(
      x, w * mask, strides, padding, dimension_numbers=_NHWC, precision="highest"
    )

  return conv


CASES = [
  # (H, W, Cin, Cout, G, kernel side, strides, padding)
  (9, 7, 6, 8, 2, 3, (1, 1), "SAME"),
  (9, 7, 6, 8, 4, 3, (2, 2), "VALID"),
  (8, 8, 5, 6, 1, 3, (2, 2), "SAME"),
  (7, 9, 4, 6, 3, 3, (1, 2), ((1, 0), (2, 1))),
  (5, 5, 7, 4, 2, 1, (1, 1), "VALID"),
  (6, 5, 5, 6, 6, 3, (1, 1), "SAME"),  # one filter per group: the fine-grained limit
]


@pytest.mark.parametrize("h,w,cin,cout,groups,k,strides,padding", CASES)
def test_forward_and_gradients_match_dense_masked_vjp(h, w, cin, cout, groups, k, strides, padding):
  rng = np.random.default_rng(h * 100 + cin * 10 + groups)
  mask = aligned_mask(_random_taps(rng, groups, cin, size=k), cout)
  layout = build_aligned_layout(mask, groups)
  x = jnp.asarray(rng.normal(size=(2, h, w, cin)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(k, k, cin, cout)), jnp.float32)

  def aligned(x, w):
    return aligned_conv(x, w, layout, strides=strides, padding=padding, precision="highest")

  y_ref, vjp_ref = jax.vjp(_dense(mask, strides, padding), x, kernel)
  y, vjp = jax.vjp(aligned, x, kernel)
  cot = jnp.asarray(rng.normal(size=y_ref.shape), jnp.float32)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for got, want in zip(vjp(cot), vjp_ref(cot)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  dw = vjp(cot)[1]
  assert np.all(np.asarray(dw)[mask == 0] == 0)  # no gradient leaks to pruned weights


def test_layout_is_valid_and_counts_kept_weights():
  rng = np.random.default_rng(0)
  taps = _random_taps(rng, 2, 8)
  mask = aligned_mask(taps, 6)
  layout = build_aligned_layout(mask, 2)
  assert layout.nnz == int(mask.sum())
  np.testing.assert_array_equal(layout.mask(), mask)
  for group in layout.groups:
    seen = set()
    for taps_, chans in group.blocks:
      assert len(taps_) == 4  # every kept kernel of a library pattern keeps 4 weights
      assert not seen & set(chans)  # one pattern per (group, channel)
      seen |= set(chans)
  # Kept kernels share one pattern within a group: filter 0..2 and 3..5 agree.
  kernels = mask.reshape(9, 8, 6)
  for lo in (0, 3):
    assert (kernels[:, :, lo : lo + 3] == kernels[:, :, lo : lo + 1]).all()


def test_explicit_groups_permute_outputs_back():
  rng = np.random.default_rng(1)
  groups = [(0, 3, 4), (1, 2, 5)]
  mask = aligned_mask(_random_taps(rng, 2, 5), 6, groups)
  layout = build_aligned_layout(mask, groups)
  assert layout.filter_order == (0, 3, 4, 1, 2, 5)
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 5)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(3, 3, 5, 6)), jnp.float32)
  want = _dense(mask, (1, 1), "SAME")(x, kernel)
  got = aligned_conv(x, kernel, layout, precision="highest")
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_all_pruned_group_gives_zeros():
  taps = np.zeros((2, 3, 3, 3), np.float32)
  taps[0, 1] = patterns.library_patterns()[0]
  mask = aligned_mask(taps, 4)
  layout = build_aligned_layout(mask, 2)
  x = jnp.ones((1, 4, 4, 3))
  y = aligned_conv(x, jnp.ones((3, 3, 3, 4)), layout)
  assert np.all(np.asarray(y[..., 2:]) == 0)
  want = _dense(mask, (1, 1), "SAME")(x, jnp.ones((3, 3, 3, 4)))
  np.testing.assert_allclose(y, want)


@pytest.mark.parametrize("bad", [0, -1, 3, 2.0, [(0, 1), (1, 2, 3)], [(0,), (1, 2)]])
def test_bad_filter_groups_raise(bad):
  with pytest.raises(ValueError, match="filter_groups"):
    group_filters(bad, 4)


def test_mask_not_shared_within_group_raises():
  rng = np.random.default_rng(2)
  mask = aligned_mask(_random_taps(rng, 1, 4, keep=1.0), 4)
  mask[0, 0, 2, 3] = 1 - mask[0, 0, 2, 3]
  with pytest.raises(ValueError, match="filter 3 differs from filter 0 at input channel 2"):
    build_aligned_layout(mask, 1)
  build_aligned_layout(mask, 4)  # every filter its own group: any mask is aligned


def test_non_binary_mask_raises():
  with pytest.raises(ValueError, match="only 0 and 1"):
    build_aligned_layout(np.full((3, 3, 2, 2), 0.5), 1)
  with pytest.raises(ValueError, match="only 0 and 1"):
    build_aligned_layout(np.full((3, 3, 2, 2), np.nan), 1)


def test_nonfinite_inputs_reach_exactly_the_outputs_of_kept_taps():
  # A pruned weight is absent, not a zero that multiplies: a NaN pixel reaches the outputs
  # whose window reads it through a kept weight, and no other (the dense masked conv would
  # spread it through 0 * NaN as well).
  rng = np.random.default_rng(3)
  mask = aligned_mask(_random_taps(rng, 1, 3, keep=1.0), 2)
  layout = build_aligned_layout(mask, 1)
  x = np.zeros((1, 5, 5, 3), np.float32)
  x[0, 2, 2, 0] = np.nan
  got = np.isnan(np.asarray(aligned_conv(jnp.asarray(x), jnp.ones((3, 3, 3, 2)), layout)))
  reach = _dense(mask, (1, 1), "SAME")(
    jnp.asarray(np.isnan(x), jnp.float32), jnp.ones((3, 3, 3, 2))
  )
  np.testing.assert_array_equal(got, np.asarray(reach) > 0)
  assert got.any()


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.a = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.b = nnx.Conv(8, 8, (3, 3), strides=(2, 2), rngs=rngs)

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x))).mean(axis=(1, 2))


def test_convert_keeps_variables_and_function():
  rng = np.random.default_rng(4)
  model = _Net(nnx.Rngs(0))
  mask = aligned_mask(_random_taps(rng, 2, 8), 8)
  params = nnx.state(model, nnx.Param)
  masks = jax.tree.map(lambda _: None, nnx.as_pure(params))
  masks["b"]["kernel"] = jnp.asarray(mask)
  model.b.kernel[...] = model.b.kernel[...] * mask
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 3)), jnp.float32)
  with jax.default_matmul_precision("highest"):
    before = model(x)
    kernel_var = model.b.kernel
    _, choices = convert_model(model, masks, threshold=0.0, filter_groups=2)
    assert [c.backend for c in choices] == ["aligned"]
    assert isinstance(model.b, AlignedConv) and model.b.kernel is kernel_var
    np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="b: mask is not shared"):
    convert_model(_Net(nnx.Rngs(0)), masks, threshold=0.0, filter_groups=[(0,), tuple(range(1, 8))])
