"""Shared helpers of the kernel tests: CUDA cross-lowering without a GPU."""

import jax
import pytest

# The custom call every Pallas Triton kernel lowers to.
TRITON_CALL = "__gpu$xla.gpu.triton"


def _triton_calls_in_cuda_export(f, *shapes) -> int:
  """Exports ``jit(f)`` for CUDA on this (CPU) machine; returns its number of Triton calls.

  Lowering runs Pallas → Triton IR for every kernel (not Triton's own compiler passes).
  """
  exported = jax.export.export(
    jax.jit(f),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
  )(*shapes)
  return exported.mlir_module().count(TRITON_CALL)


@pytest.fixture
def export_cuda():
  """``export_cuda(f, *shapes)`` → number of Triton kernel calls in ``f`` lowered for CUDA."""
  return _triton_calls_in_cuda_export
