"""The aligned (group-shared) pattern convolution against the dense masked convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from jaxprune.clicktrain import patterns
from jaxprune.clicktrain.execution import AlignedConv, SparseExecution, to_sparse_layers
from jaxprune.clicktrain.execution.aligned_conv import COLUMNS, aligned_conv, shared_columns
from jaxprune.clicktrain.execution.aligned_layout import (
  aligned_mask,
  build_aligned_layout,
  group_filters,
)

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


# Shared columns differ from per-group ones only with several groups.
_WITH_COLUMNS = [(*case, c) for case in CASES for c in COLUMNS if case[4] > 1 or c == "per_group"]


@pytest.mark.parametrize("h,w,cin,cout,groups,k,strides,padding,columns", _WITH_COLUMNS)
def test_forward_and_gradients_match_dense_masked_vjp(
  h, w, cin, cout, groups, k, strides, padding, columns
):
  rng = np.random.default_rng(h * 100 + cin * 10 + groups)
  mask = aligned_mask(_random_taps(rng, groups, cin, size=k), cout)
  layout = build_aligned_layout(mask, groups)
  x = jnp.asarray(rng.normal(size=(2, h, w, cin)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(k, k, cin, cout)), jnp.float32)

  def aligned(x, w):
    return aligned_conv(
      x, w, layout, strides=strides, padding=padding, precision="highest", columns=columns
    )

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


@pytest.mark.parametrize("columns", COLUMNS)
def test_explicit_groups_permute_outputs_back(columns):
  rng = np.random.default_rng(1)
  groups = [(0, 3, 4), (1, 2, 5)]
  mask = aligned_mask(_random_taps(rng, 2, 5), 6, groups)
  layout = build_aligned_layout(mask, groups)
  assert layout.filter_order == (0, 3, 4, 1, 2, 5)
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 5)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(3, 3, 5, 6)), jnp.float32)
  want = _dense(mask, (1, 1), "SAME")(x, kernel)
  got = aligned_conv(x, kernel, layout, precision="highest", columns=columns)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("keep", [1.0, 0.6])
def test_groups_of_uneven_sizes_match_dense_masked_vjp(columns, keep):
  """Groups of 3, 2 and 1 filters (what PruneTrain leaves of 2-filter groups after removing
  filters from some): keep=1.0 gives every group the same contraction, so groups of one
  contraction but several filter counts meet in one batch (they used to be stacked together
  and fail); keep=0.6 mixes contractions too."""
  rng = np.random.default_rng(3)
  groups = [(0, 1, 2), (3, 4), (5,)]
  mask = aligned_mask(_random_taps(rng, 3, 5, keep=keep), 6, groups)
  layout = build_aligned_layout(mask, groups)
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 5)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(3, 3, 5, 6)), jnp.float32)

  def aligned(x, w):
    return aligned_conv(x, w, layout, precision="highest", columns=columns)

  y_ref, vjp_ref = jax.vjp(_dense(mask, (1, 1), "SAME"), x, kernel)
  y, vjp = jax.vjp(aligned, x, kernel)
  cot = jnp.asarray(rng.normal(size=y_ref.shape), jnp.float32)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for got, want in zip(vjp(cot), vjp_ref(cot)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("columns", COLUMNS)
def test_all_pruned_group_gives_zeros(columns):
  taps = np.zeros((2, 3, 3, 3), np.float32)
  taps[0, 1] = patterns.library_patterns()[0]
  mask = aligned_mask(taps, 4)
  layout = build_aligned_layout(mask, 2)
  x = jnp.ones((1, 4, 4, 3))
  y = aligned_conv(x, jnp.ones((3, 3, 3, 4)), layout, columns=columns)
  assert np.all(np.asarray(y[..., 2:]) == 0)
  want = _dense(mask, (1, 1), "SAME")(x, jnp.ones((3, 3, 3, 4)))
  np.testing.assert_allclose(y, want)
  empty = build_aligned_layout(np.zeros((3, 3, 3, 4), np.float32), 2)
  assert np.all(np.asarray(aligned_conv(x, jnp.ones((3, 3, 3, 4)), empty, columns=columns)) == 0)


def test_shared_columns_hold_the_union_of_the_groups_pairs_once():
  # Hand-built: channel 0 keeps taps A in group 0 and B in group 1 (|A ∪ B| = 6 here),
  # channel 1 keeps A in group 0 only, channel 2 nothing: 6 + 4 columns, each read by the
  # filters of the groups that keep it.
  library = patterns.library_patterns()
  a, b = library[0], next(p for p in library if (p * library[0]).sum() == 2)
  taps = np.zeros((2, 3, 3, 3), np.float32)
  taps[0, 0], taps[1, 0], taps[0, 1] = a, b, a
  mask = aligned_mask(taps, 4)
  group, group_mask, filter_group = shared_columns(build_aligned_layout(mask, 2))
  assert group.filters == (0, 1, 2, 3) and group.contraction == 6 + 4
  assert sorted(group.channels) == [0, 1]
  np.testing.assert_array_equal(filter_group, [0, 0, 1, 1])
  rows = [(i, j, c) for t, chans in group.blocks for i, j in t for c in chans]
  packed_mask = group_mask[:, filter_group]
  np.testing.assert_array_equal(packed_mask, np.stack([mask[i, j, c] for i, j, c in rows]))
  assert packed_mask.sum() == mask.sum()  # every kept weight once
  assert group_mask.sum(axis=0).tolist() == [8, 4]  # group 0: A at channels 0, 1; group 1: B


def test_bad_columns_raise():
  layout = build_aligned_layout(aligned_mask(_random_taps(np.random.default_rng(0), 2, 3), 4), 2)
  with pytest.raises(ValueError, match="columns"):
    aligned_conv(jnp.ones((1, 4, 4, 3)), jnp.ones((3, 3, 3, 4)), layout, columns="per_filter")
  conv = nnx.Conv(3, 4, (3, 3), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="columns"):
    AlignedConv.from_conv(conv, layout, columns="union")
  with pytest.raises(ValueError, match="columns"):
    to_sparse_layers(_Net(nnx.Rngs(0)), {}, threshold=0.0, filter_groups=2, columns="union")
  with pytest.raises(ValueError, match="columns"):
    SparseExecution(filter_groups=2, columns=1)


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


def test_nonfinite_inputs_with_shared_columns_reach_the_outputs_of_every_kept_pair():
  # Shared columns are read by every filter, a group that does not keep a pair multiplying it
  # by an exact zero: a NaN pixel reaches the outputs whose window reads it through a (tap,
  # channel) pair that any group keeps (as the dense masked conv would, through all pairs).
  rng = np.random.default_rng(5)
  taps = _random_taps(rng, 2, 3, keep=1.0)
  taps[1, 0] = 0  # channel 0 only in group 0: group 1's outputs see its NaN all the same
  mask = aligned_mask(taps, 4)
  layout = build_aligned_layout(mask, 2)
  x = np.zeros((1, 5, 5, 3), np.float32)
  x[0, 2, 2, 0] = np.nan
  got = np.isnan(
    np.asarray(aligned_conv(jnp.asarray(x), jnp.ones((3, 3, 3, 4)), layout, columns="shared"))
  )
  union = np.repeat(mask.max(axis=3, keepdims=True), 4, axis=3)
  reach = _dense(union, (1, 1), "SAME")(
    jnp.asarray(np.isnan(x), jnp.float32), jnp.ones((3, 3, 3, 4))
  )
  np.testing.assert_array_equal(got, np.asarray(reach) > 0)
  per_group = np.isnan(np.asarray(aligned_conv(jnp.asarray(x), jnp.ones((3, 3, 3, 4)), layout)))
  assert got[..., 2:].any() and not per_group[..., 2:].any()


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
    _, choices = to_sparse_layers(model, masks, threshold=0.0, filter_groups=2)
    assert [c.backend for c in choices] == ["aligned"]
    assert isinstance(model.b, AlignedConv) and model.b.kernel is kernel_var
    np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="b: mask is not shared"):
    to_sparse_layers(
      _Net(nnx.Rngs(0)), masks, threshold=0.0, filter_groups=[(0,), tuple(range(1, 8))]
    )


@pytest.mark.parametrize("fastest", COLUMNS)
def test_measured_dispatch_runs_several_groups_on_the_faster_columns(monkeypatch, fastest):
  # A layer of two groups is timed dense, then with its columns per group, then shared
  # (planted times), and runs the fastest; one group has one way only.
  from jaxprune.clicktrain.execution import conversion

  def planted(conv, input_shape, kernel, *, repeats):
    planted.calls.append(tuple(kernel.shape))
    nth = planted.calls.count(tuple(kernel.shape))
    return {1: 5.0, 2: 1.0 if fastest == "per_group" else 3.0, 3: 2.0}[nth]

  planted.calls = []
  monkeypatch.setattr(conversion, "time_train_pass", planted)
  rng = np.random.default_rng(6)
  model = _Net(nnx.Rngs(0))
  mask = aligned_mask(_random_taps(rng, 2, 8), 8)
  masks = jax.tree.map(lambda _: None, nnx.as_pure(nnx.state(model, nnx.Param)))
  masks["b"]["kernel"] = jnp.asarray(mask)
  model.b.kernel[...] = model.b.kernel[...] * mask
  x = jnp.asarray(rng.normal(size=(2, 8, 8, 3)), jnp.float32)
  with jax.default_matmul_precision("highest"):
    before = model(x)
    _, choices = to_sparse_layers(
      model, masks, input_shape=(2, 8, 8, 3), filter_groups=2, check_model=False
    )
    np.testing.assert_allclose(model(x), before, rtol=1e-5, atol=1e-5)
  assert len(planted.calls) == 3  # dense, per group, shared
  label = "aligned" if fastest == "per_group" else "aligned (shared columns)"
  assert [(c.backend, c.dense_ms, c.sparse_ms) for c in choices] == [
    (label, 5.0, 1.0 if fastest == "per_group" else 2.0)
  ]
  assert isinstance(model.b, AlignedConv) and model.b.columns == fastest
  # Named, a way is built without timing the other.
  planted.calls = []
  model = _Net(nnx.Rngs(0))
  to_sparse_layers(
    model, masks, input_shape=(2, 8, 8, 3), filter_groups=2, check_model=False, columns=fastest
  )
  assert len(planted.calls) == 2 and model.b.columns == fastest
  planted.calls = []
  one = aligned_mask(_random_taps(rng, 1, 8), 8)
  masks["b"]["kernel"] = jnp.asarray(one)
  model = _Net(nnx.Rngs(0))
  to_sparse_layers(model, masks, input_shape=(2, 8, 8, 3), filter_groups=1, check_model=False)
  assert len(planted.calls) == 2 and model.b.columns == "per_group"
