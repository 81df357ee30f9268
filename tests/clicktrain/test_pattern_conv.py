"""Fixed-position layout and pattern-sparse convolution against the dense masked conv."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_kernels
from jaxprune.clicktrain import patterns
from jaxprune.clicktrain.execution.pattern_conv import pattern_conv, pattern_conv_values
from jaxprune.clicktrain.execution.pattern_layout import (
  build_layout,
  to_dense,
  to_values,
  transposed_values,
)

_NHWC = ("NHWC", "HWIO", "NHWC")
# The interpreted Pallas kernels need Pallas's Triton backend, which a future JAX may drop.
_NEEDS_TRITON = pytest.mark.skipif(
  not pallas_kernels.triton_available(),
  reason="this JAX has no Pallas Triton backend: the kernels are unavailable (the reference runs)",
)


def _pattern_mask(rng, cin, cout, kernel_keep=0.6, balanced=False):
  """ClickTrain-like mask: a random 4-of-9 pattern per kernel, a fraction of kernels kept."""
  pats = patterns.all_patterns(4, 3)
  mask = np.transpose(pats[rng.integers(0, len(pats), (cin, cout))], (2, 3, 0, 1)).astype(bool)
  if balanced:  # the same number of kernels kept in every filter
    kept = max(1, round(kernel_keep * cin))
    keep = np.zeros((cin, cout), bool)
    for f in range(cout):
      keep[rng.permutation(cin)[:kept], f] = True
  else:
    keep = rng.random((cin, cout)) < kernel_keep
  return mask & keep[None, None]


def _loop_filter_rows(mask):
  """Kept (c, i, j) positions per filter, by plain loops, as patch columns."""
  kh, kw, cin, cout = mask.shape
  return [
    [
      c * kh * kw + i * kw + j
      for c in range(cin)
      for i in range(kh)
      for j in range(kw)
      if mask[i, j, c, f]
    ]
    for f in range(cout)
  ]


@pytest.mark.parametrize("balanced", [False, True])
def test_layout_matches_loops_and_round_trips(balanced):
  rng = np.random.default_rng(0)
  mask = _pattern_mask(rng, 6, 5, balanced=balanced)
  layout = build_layout(mask)
  rows = _loop_filter_rows(mask)
  assert layout.row_nnz.tolist() == [len(r) for r in rows]
  assert layout.col_ind.tolist() == [c for r in rows for c in r]
  assert (
    layout.row_ptr.tolist() == np.concatenate([[0], np.cumsum([len(r) for r in rows])]).tolist()
  )
  assert layout.balanced == (len({len(r) for r in rows}) == 1)
  assert layout.nnz == int(mask.sum())
  w = rng.normal(size=mask.shape).astype(np.float32)
  values = np.asarray(to_values(jnp.asarray(w), layout))
  for f, r in enumerate(rows):  # values[f, k] is the weight at column rows[f][k]
    flat = np.transpose(w, (3, 2, 0, 1)).reshape(mask.shape[3], -1)[f]
    np.testing.assert_array_equal(values[f, : len(r)], flat[r])
    assert np.all(values[f, len(r) :] == 0)
  np.testing.assert_array_equal(np.asarray(to_dense(jnp.asarray(values), layout)), w * mask)


@pytest.mark.parametrize("balanced", [False, True])
def test_transposed_layout_lists_the_entries_of_each_column(balanced):
  rng = np.random.default_rng(3)
  mask = _pattern_mask(rng, 4, 5, balanced=balanced)
  layout = build_layout(mask)
  columns, valid = np.asarray(layout.columns), np.asarray(layout.valid)
  entries, t_valid = np.asarray(layout.transposed_entries), np.asarray(layout.transposed_valid)
  assert entries.shape[0] == 4 * 9
  for r in range(entries.shape[0]):  # plain loop over the ELL entries, in flat order
    readers = [
      f * layout.width + k
      for f in range(columns.shape[0])
      for k in range(layout.width)
      if valid[f, k] and columns[f, k] == r
    ]
    assert entries[r][t_valid[r]].tolist() == readers
  w = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
  t_values = np.asarray(transposed_values(to_values(w, layout), layout))
  filter_matrix = np.transpose(np.asarray(w) * mask, (3, 2, 0, 1)).reshape(5, -1)
  for r in range(entries.shape[0]):  # row r of Wᵀ: the weights of column r, zeros on padding
    f = entries[r][t_valid[r]] // layout.width
    np.testing.assert_array_equal(t_values[r][t_valid[r]], filter_matrix[f, r])
    assert np.all(t_values[r][~t_valid[r]] == 0)


def test_layout_rejects_bad_masks():
  mask = np.zeros((3, 3, 2, 2), bool)
  mask[:2, :2] = True
  mask[2, 2, 1, 0] = True  # one kernel with 5 non-zeros
  with pytest.raises(ValueError, match=r"input channel 1, filter 0\) keeps 5"):
    build_layout(mask)
  assert build_layout(mask, nnz_per_kernel=None).nnz == 17
  with pytest.raises(ValueError, match="4-D"):
    build_layout(np.ones((3, 3, 2)))
  with pytest.raises(ValueError, match="only 0 and 1"):
    build_layout(np.full((3, 3, 2, 2), 0.5))
  with pytest.raises(ValueError, match="only 0 and 1"):
    build_layout(np.full((3, 3, 2, 2), np.nan))
  good = np.zeros((3, 3, 2, 2), bool)
  good[:2, :2] = True
  with pytest.raises(ValueError, match="does not match mask shape"):
    build_layout(good, kernel=np.zeros((3, 3, 2, 3)))
  with pytest.raises(ValueError, match="pruned positions"):
    build_layout(good, kernel=np.ones((3, 3, 2, 2)))
  with pytest.raises(ValueError, match="pruned positions"):
    build_layout(good, kernel=np.where(good, 1.0, np.nan))
  layout = build_layout(good)
  with pytest.raises(ValueError, match="kernel shape"):
    to_values(jnp.zeros((3, 3, 2, 3)), layout)
  with pytest.raises(ValueError, match="values shape"):
    to_dense(jnp.zeros((2, 3)), layout)
  with pytest.raises(ValueError, match="values shape"):
    transposed_values(jnp.zeros((2, 3)), layout)


def _check_against_dense_masked_conv(rng, mask, x_shape, strides, padding, backend):
  """Forward, dX and dW of ``pattern_conv`` equal the dense masked conv's ``jax.vjp``."""
  layout = build_layout(mask)
  w = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
  x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  s = (strides, strides)

  def dense(x, w):
    return lax.conv_general_dilated(
      x, w * mask, s, padding, dimension_numbers=_NHWC, precision=lax.Precision.HIGHEST
    )

  def sparse(x, w):
    return pattern_conv(x, w, layout, strides=strides, padding=padding, backend=backend)

  y0, vjp0 = jax.vjp(dense, x, w)
  y1, vjp1 = jax.vjp(sparse, x, w)
  np.testing.assert_allclose(y1, y0, rtol=1e-5, atol=1e-5)
  cot = jnp.asarray(rng.normal(size=y0.shape), jnp.float32)
  (dx0, dw0), (dx1, dw1) = vjp0(cot), vjp1(cot)
  np.testing.assert_allclose(dx1, dx0, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw1, dw0, rtol=1e-5, atol=2e-5)
  assert np.all(np.asarray(dw1)[~mask] == 0)  # weight gradient only at kept positions


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("strides", [1, 2])
@pytest.mark.parametrize("padding", ["SAME", "VALID", ((1, 2), (0, 1))])
@pytest.mark.parametrize("backend", ["reference", "dense"])
def test_pattern_conv_equals_dense_masked_conv(balanced, strides, padding, backend):
  # Odd sizes: 9x11 input, 5 -> 7 channels, a filter may lose every kernel.
  rng = np.random.default_rng(1)
  mask = _pattern_mask(rng, 5, 7, balanced=balanced)
  mask[..., 0] = False  # one filter fully pruned
  _check_against_dense_masked_conv(rng, mask, (2, 9, 11, 5), strides, padding, backend)


@pytest.mark.parametrize(
  "strides, padding, balanced",
  [
    (1, "SAME", False),
    (1, "VALID", False),
    (2, "SAME", False),
    (2, "VALID", False),
    (2, "SAME", True),
  ],
)
@_NEEDS_TRITON
def test_pallas_pattern_conv_equals_dense_masked_conv(strides, padding, balanced):
  # The Pallas kernels, interpreted on CPU (slow: tiny 7x6 input, 3 -> 5 channels); the
  # unbalanced masks also have one filter fully pruned.
  rng = np.random.default_rng(3)
  mask = _pattern_mask(rng, 3, 5, balanced=balanced)
  mask[..., 0] &= balanced
  _check_against_dense_masked_conv(rng, mask, (1, 7, 6, 3), strides, padding, "pallas")


def test_pattern_conv_values_gradient_is_the_kept_position_weight_gradient():
  rng = np.random.default_rng(2)
  mask = _pattern_mask(rng, 4, 3)
  layout = build_layout(mask)
  w = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
  x = jnp.asarray(rng.normal(size=(1, 6, 6, 4)), jnp.float32)
  values = to_values(w, layout)
  d_values = jax.grad(lambda v: jnp.sum(pattern_conv_values(x, v, layout) ** 2))(values)
  d_dense = jax.grad(
    lambda k: jnp.sum(
      lax.conv_general_dilated(x, k * mask, (1, 1), "SAME", dimension_numbers=_NHWC) ** 2
    )
  )(w)
  np.testing.assert_allclose(d_values, to_values(d_dense, layout), rtol=1e-4, atol=1e-4)
  assert np.all(np.asarray(d_values)[~np.asarray(layout.valid)] == 0)


def test_pattern_conv_rejects_bad_arguments():
  mask = np.zeros((3, 3, 2, 2), bool)
  mask[:2, :2] = True
  layout = build_layout(mask)
  x, w = jnp.zeros((1, 4, 4, 2)), jnp.zeros((3, 3, 2, 2))
  with pytest.raises(ValueError, match="backend"):
    pattern_conv(x, w, layout, backend="cusparse")
  with pytest.raises(ValueError, match="3 channels|2 channels"):
    pattern_conv(jnp.zeros((1, 4, 4, 3)), w, layout)
  with pytest.raises(ValueError, match="strides"):
    pattern_conv(x, w, layout, strides=0)
  with pytest.raises(ValueError, match="padding"):
    pattern_conv(x, w, layout, padding="FULL")
  with pytest.raises(ValueError, match="values shape"):
    pattern_conv_values(x, jnp.zeros((2, 3)), layout)


@pytest.mark.parametrize(
  "backend", ["reference", pytest.param("pallas", marks=_NEEDS_TRITON), "dense"]
)
def test_pattern_conv_non_finite_values(backend):
  # Pruned entries of the kernel are never read (the layout drops them), so a NaN there does
  # not propagate; a NaN input read by a kept weight propagates as in the dense conv.
  mask = np.zeros((3, 3, 2, 2), bool)
  mask[:2, :2] = True
  layout = build_layout(mask)
  w = jnp.where(jnp.asarray(mask), 1.0, jnp.nan)
  x = jnp.ones((1, 4, 4, 2))
  y = pattern_conv(x, w, layout, backend=backend)
  assert np.all(np.isfinite(y))
  y_nan = pattern_conv(
    x.at[0, 1, 1, 0].set(jnp.nan), jnp.where(jnp.asarray(mask), 1.0, 0.0), layout, backend=backend
  )
  dense = lax.conv_general_dilated(
    x.at[0, 1, 1, 0].set(jnp.nan),
    jnp.asarray(mask, jnp.float32),
    (1, 1),
    "SAME",
    dimension_numbers=_NHWC,
  )
  np.testing.assert_array_equal(np.isnan(y_nan), np.isnan(dense))
  assert np.isnan(y_nan).any()


def test_reference_data_gradient_without_the_transposed_layout():
  # A layout built without the transpose (e.g. by hand) takes the scatter form of the data
  # gradient; both forms equal the dense masked conv's.
  import dataclasses

  rng = np.random.default_rng(4)
  mask = _pattern_mask(rng, 5, 6)
  full = build_layout(mask)
  bare = dataclasses.replace(full, transposed_entries=None, transposed_valid=None)
  w = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)
  x = jnp.asarray(rng.normal(size=(2, 7, 7, 5)), jnp.float32)
  dense = lambda x: lax.conv_general_dilated(x, w * mask, (1, 1), "SAME", dimension_numbers=_NHWC)
  cot = jnp.asarray(rng.normal(size=(2, 7, 7, 6)), jnp.float32)
  (dx0,) = jax.vjp(dense, x)[1](cot)
  for layout in (full, bare):
    (dx,) = jax.vjp(lambda x: pattern_conv(x, w, layout, backend="reference"), x)[1](cot)
    np.testing.assert_allclose(dx, dx0, rtol=1e-5, atol=1e-5)


def test_without_the_triton_backend_auto_runs_the_reference_and_pallas_raises(monkeypatch):
  # What a JAX that dropped jax.experimental.pallas.triton does: "auto" lowered for CUDA (forced
  # here) runs the reference, with no Triton call; an explicit "pallas" says why it cannot.
  monkeypatch.setattr(pallas_kernels, "triton_available", lambda: False)
  rng = np.random.default_rng(4)
  mask = _pattern_mask(rng, 4, 8)
  layout = build_layout(mask)
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 4)), jnp.float32)
  w = jnp.asarray(rng.normal(size=mask.shape), jnp.float32)

  def loss(x, w, backend):
    return jnp.sum(pattern_conv(x, w, layout, backend=backend) ** 2)

  grad = jax.grad(lambda x, w: loss(x, w, "auto"), argnums=(0, 1))
  text = jax.export.export(jax.jit(grad), platforms=["cuda"])(x, w).mlir_module()
  assert "__gpu$xla.gpu.triton" not in text
  reference = jax.grad(lambda x, w: loss(x, w, "reference"), argnums=(0, 1))(x, w)
  for got, want in zip(grad(x, w), reference):
    np.testing.assert_array_equal(got, want)
  with pytest.raises(
    ValueError, match=r"^backend='pallas': the Pallas Triton backend .*'reference'"
  ):
    pattern_conv(x, w, layout, backend="pallas")
