"""SDGP's backend choice: ``auto`` follows the measured table, a JAX without the Pallas Triton
backend runs the reference (an explicit ``"pallas"`` says why it cannot), and
``time_backends`` times both backends."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxprune import sdgp

KEY = jax.random.key(0)
TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call every Pallas Triton kernel lowers to


def _cuda_text(f, *shapes):
  """``jit(f)`` lowered for CUDA on this machine. The export refuses custom calls it does not
  know, so a Triton kernel call would fail it; the text is checked as well."""
  return jax.export.export(jax.jit(f), platforms=["cuda"])(*shapes).mlir_module()


def test_auto_backend_reads_the_measured_table(monkeypatch):
  monkeypatch.setattr(pallas_kernels, "triton_available", lambda: True)
  # The H100 step benchmark: the reference beat the Pallas kernel on CUDA.
  assert sdgp.MEASURED_FASTER == {"cuda": "reference"}
  assert [sdgp.auto_backend(p) for p in ("cuda", "cpu", "tpu")] == ["reference"] * 3
  monkeypatch.setitem(sdgp.MEASURED_FASTER, "cuda", "pallas")
  assert sdgp.auto_backend("cuda") == "pallas"
  assert sdgp.auto_backend("cpu") == "reference"  # a platform without an entry
  monkeypatch.setitem(sdgp.MEASURED_FASTER, "cuda", "cudnn")
  with pytest.raises(ValueError, match=r"^MEASURED_FASTER\['cuda'\] must be"):
    sdgp.auto_backend("cuda")


def test_without_the_triton_backend_auto_runs_the_reference_and_pallas_raises(monkeypatch):
  # What a JAX that dropped jax.experimental.pallas.triton does, even where the table would
  # pick the kernel.
  monkeypatch.setattr(pallas_kernels, "triton_available", lambda: False)
  monkeypatch.setitem(sdgp.MEASURED_FASTER, "cuda", "pallas")
  assert sdgp.auto_backend("cuda") == "reference"
  x = jax.random.normal(KEY, (2, 4, 4, 16))
  for method in ("magnitude", "mvue"):
    key = KEY if method == "mvue" else None
    np.testing.assert_array_equal(
      sdgp.nm_prune(x, 2, 4, method, key=key),
      sdgp.nm_prune(x, 2, 4, method, key=key, backend="reference"),
    )
    text = _cuda_text(
      lambda x, method=method, key=key: sdgp.nm_prune(x, 2, 4, method, key=key),
      jax.ShapeDtypeStruct(x.shape, jnp.float32),
    )
    assert TRITON_CALL not in text

  def loss(x, w):
    return sdgp.sdgp_conv(x, w, n=2, m=4, method="rescaled_magnitude").sum()

  text = _cuda_text(
    jax.grad(loss, argnums=(0, 1)),
    jax.ShapeDtypeStruct((2, 8, 8, 8), jnp.float32),
    jax.ShapeDtypeStruct((3, 3, 8, 8), jnp.float32),
  )
  assert TRITON_CALL not in text
  unavailable = r"^backend='pallas': the Pallas Triton backend .* unavailable .*'reference'"
  with pytest.raises(ValueError, match=unavailable):
    sdgp.nm_prune(x, 2, 4, "magnitude", backend="pallas")
  with pytest.raises(ValueError, match=unavailable):
    sdgp.SDGPSettings(2, 4, "magnitude", backend="pallas")
  with pytest.raises(ValueError, match=unavailable):
    sdgp.method(backend="pallas")


@pytest.mark.parametrize("method", ["magnitude", "mvue"])
def test_time_backends_reports_each_backend(method, monkeypatch):
  # Structure only: times are never asserted (on CPU the kernel runs in the interpreter).
  times = sdgp.time_backends((2, 4, 4, 8), 2, 4, method, repeats=2)
  expected = {"reference", "pallas"} if pallas_kernels.triton_available() else {"reference"}
  assert set(times) == expected
  assert all(isinstance(ms, float) and math.isfinite(ms) and ms > 0 for ms in times.values())
  monkeypatch.setattr(pallas_kernels, "triton_available", lambda: False)
  assert set(sdgp.time_backends((2, 8), 2, 4, method, repeats=1)) == {"reference"}


def test_time_backends_rejects_bad_arguments():
  with pytest.raises(ValueError, match="^repeats"):
    sdgp.time_backends((2, 8), 2, 4, "magnitude", repeats=0)
  with pytest.raises(ValueError, match=r"^x: last axis \(6\) must be divisible by m=4"):
    sdgp.time_backends((2, 6), 2, 4, "magnitude")
  with pytest.raises(ValueError, match="^x must have a floating dtype"):
    sdgp.time_backends((2, 8), 2, 4, "magnitude", dtype=jnp.int32)
