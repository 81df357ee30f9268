"""Tests for jaxprune.flops.communication: the ring all-reduce volume."""

from __future__ import annotations

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
