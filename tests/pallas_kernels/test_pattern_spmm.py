"""Pattern-sparse Pallas kernels: interpret mode (and compiled, on a GPU) = references = dense
NumPy, CUDA cross-lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
  "jax.experimental.pallas.triton",
  reason="this JAX has no Pallas Triton backend: the kernels are unavailable (the reference runs)",
)

from jaxprune.clicktrain import patterns
from jaxprune.clicktrain.execution.pattern_conv import pattern_conv
from jaxprune.clicktrain.execution.pattern_layout import (
  PatternLayout,
  build_layout,
  to_values,
  transposed_values,
)
from pallas_kernels import pattern_spmm as kernels

# Small tiles so that the odd shapes below span several ragged tiles in both directions.
_TILE = (8, 32)


def _ell(rng, rows, k, width):
  """Unbalanced ELL rows: row r keeps r % (width + 1) distinct columns, padding repeats."""
  columns = np.zeros((rows, width), np.int32)
  values = np.zeros((rows, width), np.float32)
  for r in range(rows):
    n = r % (width + 1)  # row 0 is fully pruned, rows of `width` have no padding
    cols = np.sort(rng.choice(k, n, replace=False))
    columns[r, :n] = cols
    columns[r, n:] = cols[-1] if n else 0
    values[r, :n] = rng.normal(size=n)
  return values, columns


def _dense_rows(values, columns, k):
  """The sparse matrix as a dense ``(R, K)`` NumPy array, by a plain loop."""
  dense = np.zeros((columns.shape[0], k), np.float64)
  for r in range(columns.shape[0]):
    for j in range(columns.shape[1]):
      dense[r, columns[r, j]] += values[r, j]
  return dense


# Interpreted everywhere; compiled (Triton) where a GPU exists (`gpu` tests skip elsewhere).
INTERPRET = [
  pytest.param(True, id="interpret"),
  pytest.param(False, id="compiled", marks=pytest.mark.gpu),
]


def _tol(dtype):
  return {"rtol": 1e-5, "atol": 1e-5} if dtype == jnp.float32 else {"rtol": 2e-2, "atol": 5e-2}


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_spmm_matches_reference_and_dense(dtype, interpret):
  # R = 19 rows over 8-row tiles, P = 45 points over 32-point tiles: both ragged.
  rng = np.random.default_rng(0)
  values, columns = _ell(rng, 19, 23, 5)
  xt = rng.normal(size=(23, 45)).astype(np.float32)
  v, x = jnp.asarray(values, dtype), jnp.asarray(xt, dtype)
  got = kernels.spmm(v, jnp.asarray(columns), x, tile=_TILE, interpret=interpret)
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
    ref = kernels.spmm_reference(v, jnp.asarray(columns), x)
  assert got.shape == (19, 45) and got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got, np.float32), ref, **_tol(dtype))
  dense = _dense_rows(np.asarray(v, np.float64), columns, 23) @ np.asarray(x, np.float64)
  np.testing.assert_allclose(ref, dense, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[0] == 0)  # the fully pruned row


@pytest.mark.parametrize("interpret", INTERPRET)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kept_weight_grad_matches_reference_and_dense(dtype, interpret):
  rng = np.random.default_rng(1)
  _, columns = _ell(rng, 19, 23, 5)
  xt = jnp.asarray(rng.normal(size=(23, 45)), dtype)
  dyt = jnp.asarray(rng.normal(size=(19, 45)), dtype)
  got = kernels.kept_weight_grad(dyt, xt, jnp.asarray(columns), tile=_TILE, interpret=interpret)
  with jax.default_matmul_precision("highest"):
    ref = kernels.kept_weight_grad_reference(dyt, xt, jnp.asarray(columns))
  assert got.shape == columns.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
  # Dense weight gradient dYt · Xtᵀ read at the kept positions.
  dense = np.asarray(dyt, np.float64) @ np.asarray(xt, np.float64).T
  np.testing.assert_allclose(ref, np.take_along_axis(dense, columns, axis=1), rtol=1e-5, atol=1e-4)


def test_data_gradient_is_spmm_on_the_transposed_layout():
  # A ClickTrain-like layout (4-of-9 patterns, some kernels and one filter fully pruned):
  # the transposed rows list, for each column r, the entries reading it, so the same SpMM
  # kernel gives dXt = Wᵀ · dYt.
  rng = np.random.default_rng(2)
  pats = patterns.all_patterns(4, 3)
  cin, cout = 3, 6
  mask = np.transpose(pats[rng.integers(0, len(pats), (cin, cout))], (2, 3, 0, 1)).astype(bool)
  mask &= (rng.random((cin, cout)) < 0.6)[None, None]
  mask[..., 2] = False
  layout = build_layout(mask)
  w = rng.normal(size=mask.shape).astype(np.float32)
  values = to_values(jnp.asarray(w), layout)
  t_columns = layout.transposed_entries // layout.width
  dyt = jnp.asarray(rng.normal(size=(cout, 37)), jnp.float32)
  got = kernels.spmm(transposed_values(values, layout), t_columns, dyt, tile=_TILE, interpret=True)
  filter_matrix = np.transpose(w * mask, (3, 2, 0, 1)).reshape(cout, -1)
  np.testing.assert_allclose(got, filter_matrix.T @ np.asarray(dyt), rtol=1e-5, atol=1e-5)


def test_kernels_reject_bad_arguments():
  columns = jnp.zeros((4, 3), jnp.int32)
  xt = jnp.zeros((5, 7))
  with pytest.raises(ValueError, match="values shape"):
    kernels.spmm(jnp.zeros((4, 2)), columns, xt)
  with pytest.raises(ValueError, match="columns"):
    kernels.spmm(jnp.zeros((4, 3)), columns.astype(jnp.float32), xt)
  with pytest.raises(ValueError, match="xt"):
    kernels.spmm(jnp.zeros((4, 3)), columns, jnp.zeros(5))
  with pytest.raises(ValueError, match="dyt shape"):
    kernels.kept_weight_grad(jnp.zeros((4, 6)), xt, columns)
  with pytest.raises(ValueError, match="dyt shape"):
    kernels.kept_weight_grad(jnp.zeros((3, 7)), xt, columns)
  # int32 offsets: a 576 x 2^22 operand has 2^31.17 elements.
  assert kernels.supports(64, 576, 2**21) and not kernels.supports(64, 576, 2**22)


def _pattern_mask(rng, cin, cout):
  pats = patterns.all_patterns(4, 3)
  mask = np.transpose(pats[rng.integers(0, len(pats), (cin, cout))], (2, 3, 0, 1)).astype(bool)
  mask &= (rng.random((cin, cout)) < 0.6)[None, None]  # unbalanced rows
  mask[..., 0] = False  # a fully pruned filter
  return mask


def test_pallas_backend_needs_the_transposed_layout():
  mask = np.zeros((3, 3, 2, 2), bool)
  mask[:2, :2] = True
  full = build_layout(mask)
  bare = PatternLayout(full.columns, full.valid, full.kernel_shape)
  x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 2))
  with pytest.raises(ValueError, match="transposed"):
    pattern_conv(x, w, bare, backend="pallas")
  # "auto" falls back to the reference, which needs no transpose.
  np.testing.assert_allclose(
    pattern_conv(x, w, bare, backend="auto"), pattern_conv(x, w, full), rtol=1e-6
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_cross_lower_for_cuda(dtype, export_cuda):
  values = jax.ShapeDtypeStruct((64, 72), dtype)
  columns = jax.ShapeDtypeStruct((64, 72), jnp.int32)
  xt = jax.ShapeDtypeStruct((576, 8 * 16 * 16), dtype)
  dyt = jax.ShapeDtypeStruct((64, 8 * 16 * 16), dtype)
  spmm = lambda v, c, x: kernels.spmm(v, c, x, interpret=False)
  grad = lambda d, x, c: kernels.kept_weight_grad(d, x, c, interpret=False)
  assert export_cuda(spmm, values, columns, xt) == 1
  assert export_cuda(grad, dyt, xt, columns) == 1


@pytest.mark.parametrize("backend", ["pallas", "auto"])
def test_pattern_conv_gradient_cross_lowers_for_cuda(backend, export_cuda):
  rng = np.random.default_rng(4)
  layout = build_layout(_pattern_mask(rng, 16, 32))

  def loss(x, w):
    y = pattern_conv(x, w, layout, strides=2, padding="SAME", backend=backend)
    return jnp.sum(y.astype(jnp.float32) ** 2)  # needs y: the forward kernel stays

  calls = export_cuda(
    jax.grad(loss, argnums=(0, 1)),
    jax.ShapeDtypeStruct((4, 16, 16, 16), jnp.bfloat16),
    jax.ShapeDtypeStruct((3, 3, 16, 32), jnp.bfloat16),
  )
  assert calls == 3  # forward SpMM, data-gradient SpMM, kept-position weight gradient


@pytest.mark.gpu_compile
@pytest.mark.parametrize("capability", [80, 90])
def test_triton_ir_compiles_to_cubin(capability, triton_modules, tmp_path, monkeypatch):
  # Opt-in: Triton's own passes (TTIR → TTGIR → LLVM → PTX → cubin with the ptxas it ships)
  # on CPU, for the kernels of jax.grad through pattern_conv in bf16 and fp32.
  monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
  triton = pytest.importorskip("triton")
  from triton.backends.compiler import GPUTarget

  layout = build_layout(_pattern_mask(np.random.default_rng(5), 16, 32))
  loss = lambda x, w: jnp.sum(pattern_conv(x, w, layout, backend="pallas").astype(jnp.float32) ** 2)
  compiled = set()
  for dtype in (jnp.bfloat16, jnp.float32):
    shapes = (
      jax.ShapeDtypeStruct((4, 8, 8, 16), dtype),
      jax.ShapeDtypeStruct((3, 3, 16, 32), dtype),
    )
    for i, (name, options, ttir) in enumerate(triton_modules(jax.grad(loss, (0, 1)), *shapes)):
      path = tmp_path / f"{name}_{i}.ttir"
      path.write_text(ttir)
      kernel = triton.compile(str(path), target=GPUTarget("cuda", capability, 32), options=options)
      assert f".entry {name}" in kernel.asm["ptx"] and len(kernel.asm["cubin"]) > 0
      compiled.add(name)
  assert compiled == {"clicktrain_pattern_spmm", "clicktrain_pattern_kept_weight_grad"}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_pattern_conv_and_gradient_match_the_reference(dtype):
  # The Triton kernels at their default tiles (forward SpMM, data-gradient SpMM, kept-position
  # weight gradient) against the reference backend, through jax.grad.
  rng = np.random.default_rng(6)
  mask = _pattern_mask(rng, 16, 32)
  layout = build_layout(mask)
  x = jnp.asarray(rng.normal(size=(4, 16, 16, 16)), dtype)
  w = jnp.asarray(rng.normal(size=(3, 3, 16, 32)) * 0.2, dtype)

  def loss(x, w, backend):
    y = pattern_conv(x, w, layout, strides=2, padding="SAME", backend=backend)
    return jnp.sum(y.astype(jnp.float32) ** 2), y

  grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  assert "triton" in grad.lower(x, w, "pallas").as_text()  # compiled, not interpreted
  with jax.default_matmul_precision("highest"):  # no TF32 in the reference's convs
    (dx, dw), y = grad(x, w, "pallas")
    (dx_ref, dw_ref), y_ref = grad(x, w, "reference")
  for got, ref in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-3)
    else:  # bf16 outputs of long sums: compare the error to the result's scale
      assert np.linalg.norm(got - ref) <= 2e-2 * np.linalg.norm(ref)
  assert np.all(np.asarray(dw, np.float32)[~mask] == 0)  # no gradient at pruned weights
