"""Sparse all-reduce (ClickTrain §5.3) on 4 emulated CPU devices.

Runs in a subprocess: the device count must be set before JAX starts, and the
rest of the suite shares one process per worker.
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxprune import distributed

_SCRIPT = textwrap.dedent(
  r"""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxprune import distributed

    assert jax.device_count() == 4, jax.devices()
    rng = np.random.default_rng(0)
    masks = {
        "conv": (rng.random((3, 3, 4, 5)) < 0.4),
        "dense": None,
    }
    idx = distributed.mask_indices(masks)
    grads = {
        "conv": rng.normal(size=(4, 3, 3, 4, 5)).astype(np.float32),
        "dense": rng.normal(size=(4, 6, 2)).astype(np.float32),
    }
    # Independent reference: mask each device's gradient by hand, then NumPy mean.
    ref = {
        "conv": (grads["conv"] * masks["conv"]).mean(0),
        "dense": grads["dense"].mean(0),
    }

    tx = distributed.allreduce_gradients("batch", indices=idx, mean=True)
    state = tx.init(None)

    def step(g):
        return tx.update(g, state)[0]

    out_pmap = jax.pmap(step, axis_name="batch")(grads)
    for k in ref:
        got = np.asarray(out_pmap[k])
        for d in range(4):  # every device holds the same reduced gradient
            np.testing.assert_allclose(got[d], ref[k], rtol=1e-6, atol=1e-6)

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    sm = jax.shard_map(
        lambda g: jax.tree.map(lambda x: x[None], step(jax.tree.map(lambda x: x[0], g))),
        mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
    out_sm = jax.jit(sm)(grads)
    for k in ref:
        np.testing.assert_allclose(np.asarray(out_sm[k])[2], ref[k], rtol=1e-6, atol=1e-6)

    # psum variant and the dense (indices=None) baseline.
    summed = jax.pmap(lambda g: distributed.sparse_psum(g, idx, "batch"), axis_name="batch")(grads)
    np.testing.assert_allclose(np.asarray(summed["conv"])[0], (grads["conv"] * masks["conv"]).sum(0),
                               rtol=1e-5, atol=1e-5)
    dense = jax.pmap(lambda g: distributed.sparse_psum(g, None, "batch"), axis_name="batch")(grads)
    np.testing.assert_allclose(np.asarray(dense["conv"])[1], grads["conv"].sum(0), rtol=1e-5, atol=1e-5)

    # Only the kept entries travel: the compact vector in the HLO has nnz elements.
    hlo = jax.jit(sm).lower(grads).compile().as_text()
    nnz = int(masks["conv"].sum())
    reduce_lines = [l for l in hlo.splitlines() if "all-reduce(" in l]
    assert any(f"f32[{nnz}]" in l for l in reduce_lines), reduce_lines
    assert not any("f32[3,3,4,5]" in l or "f32[180]" in l for l in reduce_lines), reduce_lines
    print("OK")
    """
)


def test_sparse_allreduce_pmap_and_shard_map_match_masked_dense_mean(cpu_env):
  env = cpu_env()
  proc = subprocess.run(
    [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "OK" in proc.stdout


def test_mask_indices_are_sorted_flat_positions():
  mask = np.zeros((3, 3, 2, 2), bool)
  mask[0, 1, 1, 0] = mask[2, 2, 0, 1] = True
  idx = distributed.mask_indices({"w": mask, "b": None})
  assert idx["b"] is None
  np.testing.assert_array_equal(idx["w"], np.flatnonzero(mask.reshape(-1)))
  assert idx["w"].dtype == np.int32


def test_reduced_elements_counts_kept_entries():
  params = {"w": np.zeros((3, 3, 2, 2)), "b": np.zeros((7,))}
  mask = np.zeros((3, 3, 2, 2), bool)
  mask[:, :, 0, 0] = True
  idx = distributed.mask_indices({"w": mask, "b": None})
  assert distributed.reduced_elements(params, idx) == (9 + 7, 36 + 7)
  assert distributed.reduced_elements(params) == (43, 43)


def test_reduced_elements_accepts_nnx_state_and_pure_state():
  """Params and indices as ``nnx.state``, ``nnx.as_pure`` or plain dicts, in any pairing,
  count the same entries: the kept ones of the mask, every entry of an unmasked leaf."""
  from flax import nnx

  model = nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0))  # kernel 3*3*2*3 = 54 entries, bias 3
  state = nnx.state(model, nnx.Param)
  params_forms = (state, nnx.as_pure(state), nnx.to_pure_dict(nnx.as_pure(state)))
  kernel_mask = np.zeros((3, 3, 2, 3), bool)
  kernel_mask[:, :, 1, 2] = True  # one 3x3 kernel kept: 9 entries
  masks = {"kernel": kernel_mask, "bias": None}
  index_forms = (distributed.mask_indices(masks), distributed.mask_indices(nnx.State(masks)))
  for params in params_forms:
    assert distributed.reduced_elements(params) == (57, 57)
    for idx in index_forms:
      assert distributed.reduced_elements(params, idx) == (9 + 3, 54 + 3)
  with pytest.raises(ValueError, match=r"indices: .*missing \['bias'\]"):
    distributed.reduced_elements(state, {"kernel": index_forms[0]["kernel"]})


def test_sparse_psum_pairs_nnx_state_gradients_with_dict_indices():
  """Gradients as an NNX ``State`` and indices built from a plain dict of masks (or the other
  way round) reduce the same entries as the masked dense sum (one device: the sum is the
  gradient itself)."""
  import jax
  from flax import nnx

  model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
  grads = nnx.as_pure(nnx.state(model, nnx.Param))
  mask = np.random.default_rng(0).random((4, 3)) < 0.5
  expected = {"kernel": np.asarray(grads["kernel"]) * mask, "bias": np.asarray(grads["bias"])}
  for idx, g in (
    (distributed.mask_indices({"kernel": mask, "bias": None}), grads),
    (distributed.mask_indices(nnx.State({"kernel": mask, "bias": None})), nnx.to_pure_dict(grads)),
  ):
    out = jax.pmap(lambda g: distributed.sparse_psum(g, idx, "i"), axis_name="i")(
      jax.tree.map(lambda x: x[None], g)
    )
    for name in ("kernel", "bias"):
      np.testing.assert_array_equal(np.asarray(out[name])[0], expected[name])


def test_too_many_indices_is_rejected():
  import jax

  grads = {"w": np.zeros((2, 2), np.float32)}
  bad = {"w": np.arange(5, dtype=np.int32)}
  with pytest.raises(ValueError, match="indices"):
    jax.pmap(lambda g: distributed.sparse_psum(g, bad, "i"), axis_name="i")({"w": grads["w"][None]})


@pytest.mark.parametrize(
  "bad, why",
  [
    ([0, 4], "out of range (dropped by the scatter)"),
    ([-1, 2], "negative (wraps to the last entry)"),
    ([2, 1], "unsorted"),
    ([1, 1], "duplicate"),
    ([0.0, 1.0], "not integer"),
  ],
)
def test_invalid_host_indices_raise_instead_of_reducing_wrong_entries(bad, why):
  import jax

  g = np.arange(4, dtype=np.float32).reshape(1, 2, 2)
  idx = {"w": np.asarray(bad)}
  for op in (distributed.sparse_psum, distributed.sparse_pmean):
    with pytest.raises(ValueError, match="indices"):
      jax.pmap(lambda g, op=op: op(g, idx, "i"), axis_name="i")({"w": g})
