"""Tests for jaxprune.flops.communication: the ring all-reduce volume."""

from __future__ import annotations

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune import flops


def test_allreduce_bytes_ring_model():
  params = {"conv": np.ones((3, 3, 4, 8), np.float32), "bias": np.ones(8, np.float32)}
  grad_bytes = (3 * 3 * 4 * 8 + 8) * 4
  assert flops.allreduce_bytes(params, 4) == pytest.approx(2 * 3 / 4 * grad_bytes)
  assert flops.allreduce_bytes(params, 1) == 0.0
  mask = np.zeros((3, 3, 4, 8), bool)
  mask[1, 1] = True  # keep 4·8 entries
  masked = flops.allreduce_bytes(params, 8, masks={"conv": mask})
  assert masked == pytest.approx(2 * 7 / 8 * (4 * 8 + 8) * 4)
  half = {"conv": np.ones((3, 3, 4, 8), jnp.bfloat16)}
  assert flops.allreduce_bytes(half, 2) == pytest.approx(3 * 3 * 4 * 8 * 2)
  with pytest.raises(ValueError, match="num_devices"):
    flops.allreduce_bytes(params, 0)
  with pytest.raises(ValueError, match="num_devices"):
    flops.allreduce_bytes(params, 2.5)


_COMPILED_STEP = textwrap.dedent(
  r"""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxprune import distributed, flops

    rng = np.random.default_rng(0)
    params = {
      "conv": {"kernel": rng.normal(size=(3, 3, 4, 5)).astype(np.float32)},
      "head": {"kernel": rng.normal(size=(6, 2)).astype(np.float32),
               "bias": np.zeros((2,), np.float32)},
    }
    masks = {"conv": {"kernel": rng.random((3, 3, 4, 5)) < 0.4},
             "head": {"kernel": None, "bias": None}}
    nnz = int(masks["conv"]["kernel"].sum())
    mesh = Mesh(np.array(jax.devices()), ("batch",))

    def loss(p, x):
      h = x @ p["head"]["kernel"] + p["head"]["bias"]
      # Not a product of a parameter term and a data term, so XLA cannot move the
      # reduction onto a scalar.
      return (h ** 2).mean() + jnp.tanh(p["conv"]["kernel"] * x.mean()).sum()

    def compiled(indices, check_vma):
      tx = distributed.allreduce_gradients("batch", indices=indices)
      def step(p, x):
        g, _ = tx.update(jax.grad(loss)(p, x), tx.init(p))
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
      mapped = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P(),
                             check_vma=check_vma)
      return jax.jit(mapped).lower(params, np.ones((8, 6), np.float32)).compile()

    # Hand count: f32 gradients, 4 bytes an entry; the sparse step sends the conv's kept ones.
    want_dense = {"conv/kernel": 180 * 4, "head/kernel": 12 * 4, "head/bias": 2 * 4}
    want_sparse = {**want_dense, "conv/kernel": nnz * 4}
    for indices, want in ((None, want_dense), (distributed.mask_indices(masks), want_sparse)):
      got = flops.compiled_allreduces(compiled(indices, check_vma=False))
      assert got.by_path == want, (got.by_path, want)
      assert got.total_bytes == sum(want.values())
      assert all(op.group_size == 4 for op in got.ops), got.ops
      # The ring model of the cost model, on the same masks, is 2 (p - 1) / p of the payload.
      model = flops.allreduce_bytes(params, 4, masks=None if indices is None else masks)
      assert abs(model - got.ring_bytes_per_device) < 1e-6, (model, got.ring_bytes_per_device)
      assert abs(model - 1.5 * got.total_bytes) < 1e-6

    # With shard_map's varying-value checks on, the gradient of a replicated parameter is
    # already summed by the transpose (a dense all-reduce no scope names) before the sparse one.
    checked = flops.compiled_allreduces(compiled(distributed.mask_indices(masks), check_vma=True))
    assert checked.by_path[None] >= sum(want_dense.values()), checked.by_path
    assert checked.by_path["conv/kernel"] == nnz * 4
    print("OK", nnz)
    """
)


def test_compiled_allreduce_bytes_match_a_hand_count_and_the_ring_model(run_python):
  proc = run_python(_COMPILED_STEP)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert proc.stdout.startswith("OK")


def test_compiled_allreduces_parses_combined_async_and_unnamed_reductions():
  hlo = textwrap.dedent(
    """
    ENTRY %main {
      %all-reduce = (f32[63]{0}, bf16[6,2]{1,0}) all-reduce(%a, %b), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add, metadata={op_name="x"}
      %gte.1 = f32[63]{0} get-tuple-element(%all-reduce), index=0, metadata={op_name="jit(step)/allreduce[conv/kernel]/psum"}
      %gte.2 = bf16[6,2]{1,0} get-tuple-element(%all-reduce), index=1, metadata={op_name="jit(step)/allreduce[head/kernel]/psum"}
      %ars = f32[5]{0} all-reduce-start(%c), replica_groups=[1,8]<=[8], to_apply=%add, metadata={op_name="jit(step)/psum"}
      %ard = f32[5]{0} all-reduce-done(%ars)
      ROOT %t = (f32[63]{0}) tuple(%gte.1)
    }
    """
  )
  got = flops.compiled_allreduces(hlo)
  assert [op.name for op in got.ops] == ["all-reduce", "ars"]
  assert got.ops[0].operand_bytes == (63 * 4, 12 * 2) and got.ops[0].group_size == 2
  assert got.ops[1].group_size == 8
  assert got.by_path == {"conv/kernel": 252, "head/kernel": 24, None: 20}
  assert got.total_bytes == 296
  assert got.ring_bytes_per_device == pytest.approx(276 * 2 * 1 / 2 + 20 * 2 * 7 / 8)
  with pytest.raises(ValueError, match="unknown size"):
    flops.compiled_allreduces("%x = f7[3]{0} all-reduce(%a), replica_groups={{0,1}}")
  with pytest.raises(ValueError, match="compiled"):
    flops.compiled_allreduces(3)
