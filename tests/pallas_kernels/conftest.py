"""Shared helpers of the kernel tests: CUDA cross-lowering (and Triton compilation) without a GPU."""

import jax
import pytest

# The custom call every Pallas Triton kernel lowers to.
TRITON_CALL = "__gpu$xla.gpu.triton"


def pytest_configure(config):
  config.addinivalue_line(
    "markers",
    "gpu_compile: compiles the kernels' Triton IR to PTX/cubin on CPU (needs the `triton` package)",
  )


def _cuda_module(f, *shapes):
  """``jit(f)`` exported for CUDA on this (CPU) machine: Pallas → Triton IR for every kernel."""
  exported = jax.export.export(
    jax.jit(f),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
  )(*shapes)
  return exported.mlir_module()


@pytest.fixture
def export_cuda():
  """``export_cuda(f, *shapes)`` → number of Triton kernel calls in ``f`` lowered for CUDA.

  Lowering runs Pallas → Triton IR, not Triton's own compiler passes (see ``triton_modules``).
  """
  return lambda f, *shapes: _cuda_module(f, *shapes).count(TRITON_CALL)


def _triton_modules(f, *shapes):
  """``[(name, options, ttir_text)]`` of every Triton kernel call in ``f`` lowered for CUDA.

  The kernels travel as MLIR bytecode in the custom call's backend config; they are parsed
  with jaxlib's own Triton dialect (a private JAX module) and printed as text, the portable
  form that a separately installed ``triton`` compiler reads.
  """
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  text = _cuda_module(f, *shapes)
  kernels = []
  with mlir.make_ir_context() as ctx:
    tt_dialect.register_dialect(ctx)

    def visit(op):
      for region in op.regions:
        for block in region.blocks:
          for inner in block.operations:
            if inner.name == "stablehlo.custom_call" and TRITON_CALL in str(
              inner.attributes["call_target_name"]
            ):
              config = ir.DictAttr(inner.attributes["mhlo.backend_config"])
              options = {
                key: int(ir.IntegerAttr(config[key]).value) for key in ("num_warps", "num_stages")
              }
              module = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
              kernels.append((ir.StringAttr(config["name"]).value, options, str(module)))
            visit(inner)

    visit(ir.Module.parse(text).operation)
  return kernels


@pytest.fixture
def triton_modules():
  """``triton_modules(f, *shapes)`` → ``[(name, options, ttir_text)]`` of ``f``'s kernels."""
  return _triton_modules
