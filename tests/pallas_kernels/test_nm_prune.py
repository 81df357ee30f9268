"""Pallas N:M kernel: interpret-mode (and compiled, on a GPU) equality with the reference, CUDA
cross-lowering, dispatch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip(
  "jax.experimental.pallas.triton",
  reason="this JAX has no Pallas Triton backend: the kernels are unavailable (the reference runs)",
)

from jaxprune import sdgp
from pallas_kernels import nm_prune as kernel

KEY = jax.random.key(0)


def _key_for(method):
  return jax.random.key(9) if method in ("random", "mvue") else None


@pytest.mark.parametrize(
  "method, n, m, shape, dtype",
  [
    ("magnitude", 2, 4, (2, 4, 4, 32), jnp.float32),
    ("magnitude", 3, 8, (3, 5, 24), jnp.bfloat16),  # odd row count, 3 channel tiles
    ("rescaled_magnitude", 2, 4, (2, 8, 8, 16), jnp.float32),
    ("rescaled_magnitude", 4, 16, (2, 4, 4, 32), jnp.float16),
    ("random", 1, 4, (2, 4, 4, 16), jnp.float32),
    ("mvue", 2, 8, (2, 3, 16), jnp.bfloat16),
  ],
)
def test_interpret_matches_reference(method, n, m, shape, dtype):
  _check_pallas_against_reference(method, n, m, shape, dtype)  # interpreted on CPU


def _check_pallas_against_reference(method, n, m, shape, dtype, f32_tol=1e-6):
  """``backend="pallas"`` equals ``backend="reference"``: same kept positions, same values."""
  x = jax.random.normal(KEY, shape).astype(dtype)
  x = x.at[..., 1].set(x[..., 0])  # ties
  key = _key_for(method)
  ref = sdgp.nm_prune(x, n, m, method, key=key, backend="reference")
  got = sdgp.nm_prune(x, n, m, method, key=key, backend="pallas")
  assert got.dtype == dtype and got.shape == x.shape
  np.testing.assert_array_equal(np.asarray(got) != 0, np.asarray(ref) != 0)
  tol = f32_tol if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(
    np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32)), rtol=tol, atol=tol
  )
  return x, key


@pytest.mark.gpu
@pytest.mark.parametrize(
  "method, n, m, shape, dtype",
  [
    ("magnitude", 2, 4, (8, 16, 16, 128), jnp.float32),  # many row and channel blocks
    ("magnitude", 4, 32, (4, 8, 8, 512), jnp.bfloat16),
    ("rescaled_magnitude", 2, 4, (8, 16, 16, 64), jnp.float32),
    ("rescaled_magnitude", 2, 8, (4, 32, 32, 32), jnp.bfloat16),  # the doubled-warp blocks
    ("random", 1, 4, (8, 16, 16, 64), jnp.float16),
    ("mvue", 2, 4, (8, 16, 16, 128), jnp.float32),
    ("mvue", 4, 32, (4, 8, 8, 256), jnp.bfloat16),
  ],
)
def test_compiled_kernel_matches_reference(method, n, m, shape, dtype):
  # The Triton kernel, compiled on the GPU (float32: block sums may reorder, hence 1e-5).
  x, key = _check_pallas_against_reference(method, n, m, shape, dtype, f32_tol=1e-5)
  f = jax.jit(lambda x: sdgp.nm_prune(x, n, m, method, key=key, backend="pallas"))
  assert "triton" in f.lower(x).as_text()  # compiled, not interpreted


def test_interpret_nan_policy_matches_reference():
  x = jax.random.normal(KEY, (2, 4, 8)).at[0, 0, 2].set(jnp.nan).at[1, 2, 5].set(-jnp.inf)
  for method in ("magnitude", "mvue"):
    ref = sdgp.nm_prune(x, 1, 4, method, key=KEY, backend="reference")
    got = sdgp.nm_prune(x, 1, 4, method, key=KEY, backend="pallas")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    assert np.isnan(np.asarray(got)[0, 0, 2])


def test_interpret_under_vmap():
  x = jax.random.normal(KEY, (3, 2, 4, 16))
  keys = jax.random.split(KEY, 3)
  f = lambda backend: jax.vmap(lambda x, k: sdgp.nm_prune(x, 2, 4, "mvue", key=k, backend=backend))
  np.testing.assert_array_equal(f("pallas")(x, keys), f("reference")(x, keys))


@pytest.mark.parametrize(
  "method, n, m, dtype",
  [
    ("magnitude", 2, 4, jnp.float32),
    ("rescaled_magnitude", 2, 4, jnp.bfloat16),
    ("random", 2, 4, jnp.float16),
    ("mvue", 2, 4, jnp.float32),
    ("magnitude", 4, 32, jnp.bfloat16),
    ("mvue", 4, 32, jnp.float32),
  ],
)
def test_cross_lowers_for_cuda(method, n, m, dtype, export_cuda):
  key = _key_for(method)
  calls = export_cuda(
    lambda x: sdgp.nm_prune(x, n, m, method, key=key, backend="pallas"),
    jax.ShapeDtypeStruct((8, 32, 32, 128), dtype),
  )
  assert calls >= 1


@pytest.mark.parametrize(
  "backend, table, expected",
  [
    ("pallas", "reference", 1),  # explicit: the kernel whatever the table says
    ("auto", "reference", 0),  # the measured table (the reference won on an H100)
    ("auto", "pallas", 1),  # a table where the kernel won
  ],
)
def test_sdgp_conv_gradient_cross_lowers_for_cuda(
  backend, table, expected, export_cuda, monkeypatch
):
  monkeypatch.setitem(sdgp.MEASURED_FASTER, "cuda", table)

  def loss(x, w):
    y = sdgp.sdgp_conv(x, w, n=2, m=4, method="rescaled_magnitude", backend=backend)
    return y.astype(jnp.float32).sum()

  calls = export_cuda(
    jax.grad(loss, argnums=(0, 1)),
    jax.ShapeDtypeStruct((4, 16, 16, 64), jnp.bfloat16),
    jax.ShapeDtypeStruct((3, 3, 64, 128), jnp.bfloat16),
  )
  assert min(calls, 1) == expected


@pytest.mark.parametrize("method", ["magnitude", "mvue"])
def test_auto_follows_the_measured_table_on_cuda(method, export_cuda, monkeypatch):
  # Lowered for CUDA (forced on this machine), "auto" runs what MEASURED_FASTER says there:
  # no Triton call while the table says "reference", the kernel once it says "pallas". The
  # table is read when a function is traced, so each lowering gets a fresh function.
  key = _key_for(method)
  shape = jax.ShapeDtypeStruct((8, 16, 16, 64), jnp.float32)

  def auto():
    return lambda x: sdgp.nm_prune(x, 2, 4, method, key=key)

  assert sdgp.MEASURED_FASTER["cuda"] == "reference" == sdgp.auto_backend("cuda")
  assert export_cuda(auto(), shape) == 0
  monkeypatch.setitem(sdgp.MEASURED_FASTER, "cuda", "pallas")
  assert sdgp.auto_backend("cuda") == "pallas"
  assert export_cuda(auto(), shape) >= 1
  # the table names platforms: lowered for CPU, auto keeps the reference
  assert "triton" not in jax.jit(auto()).lower(shape).as_text()
  x = jax.random.normal(KEY, shape.shape)
  reference = sdgp.nm_prune(x, 2, 4, method, key=key, backend="reference")
  np.testing.assert_array_equal(auto()(x), reference)


def test_auto_uses_reference_off_gpu_and_for_unsupported_shapes(export_cuda, monkeypatch):
  monkeypatch.setitem(sdgp.MEASURED_FASTER, "cuda", "pallas")  # where auto would use the kernel
  f = jax.jit(lambda x: sdgp.nm_prune(x, 2, 4, "magnitude"))
  cpu_text = f.lower(jax.ShapeDtypeStruct((2, 4, 4, 8), jnp.float32)).as_text()
  assert "triton" not in cpu_text and "mosaic" not in cpu_text
  # rescaled needs all of H*W in one block; 7x7 is not a power of two -> reference on GPU too
  odd = jax.ShapeDtypeStruct((2, 7, 7, 8), jnp.float32)
  assert not kernel.supports(odd.shape, 2, 4, "rescaled_magnitude")
  assert export_cuda(lambda x: sdgp.nm_prune(x, 2, 4, "rescaled_magnitude"), odd) == 0
  with pytest.raises(ValueError, match="x"):
    sdgp.nm_prune(jnp.ones(odd.shape), 2, 4, "rescaled_magnitude", backend="pallas")
