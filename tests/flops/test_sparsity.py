"""Tests for jaxprune.flops.sparsity: compression ratio and conv sparsity."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxprune import flops


def _pattern_params(rng, cin=4, cout=6, kernel_prune=0.0):
  """Conv kernel with 4 of 9 weights kept per kernel, and a fraction of whole kernels zeroed."""
  w = rng.normal(size=(3, 3, cin, cout)) + 3.0  # no accidental zeros
  mask = np.zeros_like(w, dtype=bool)
  for c in range(cin):
    for f in range(cout):
      keep = rng.choice(9, size=4, replace=False)
      mask[:, :, c, f].flat[keep] = True
  n_pruned = int(round(kernel_prune * cin * cout))
  for flat in rng.choice(cin * cout, size=n_pruned, replace=False):
    mask[:, :, flat // cout, flat % cout] = False
  return {"conv": {"kernel": w}, "dense": {"kernel": np.ones((5, 3)), "bias": np.ones(3)}}, mask


def test_compression_ratio_pattern_and_kernel_pruning():
  rng = np.random.default_rng(0)
  params, mask = _pattern_params(rng)
  masks = {"conv": {"kernel": mask}}
  assert flops.compression_ratio(params, masks) == pytest.approx(9 / 4)
  assert flops.conv_sparsity(params, masks) == pytest.approx(5 / 9)
  # Zeroed in the params themselves (hard prune) instead of via masks: same ratio.
  hard = {"conv": {"kernel": params["conv"]["kernel"] * mask}, "dense": params["dense"]}
  assert flops.compression_ratio(hard) == pytest.approx(9 / 4)
  assert flops.compression_ratio(params) == 1.0  # dense
  # ClickTrain: 3x3 layer with kernel-prune ratio p → 9/4 · 1/(1 − p).
  params, mask = _pattern_params(rng, cin=4, cout=5, kernel_prune=0.5)
  assert flops.compression_ratio(params, {"conv": {"kernel": mask}}) == pytest.approx(
    9 / 4 / (1 - 0.5)
  )


def test_compression_ratio_edge_cases(conv_bn_linear):
  params = {"conv": {"kernel": np.ones((3, 3, 2, 2))}}
  assert flops.compression_ratio(params, {"conv": {"kernel": np.zeros((3, 3, 2, 2))}}) == math.inf
  assert flops.conv_sparsity({"conv": {"kernel": np.zeros((3, 3, 2, 2))}}) == 1.0
  with pytest.raises(ValueError, match="conv kernels"):
    flops.compression_ratio({"dense": np.ones((4, 4))})
  with pytest.raises(ValueError, match="masks"):
    flops.compression_ratio(params, {"conv": {"kernel": np.ones((3, 3, 2, 3))}})
  # NNX State works too (Variables flatten through `.value`).
  abstract_state = nnx.state(conv_bn_linear, nnx.Param)
  state = jax.tree.map(lambda a: np.full(a.shape, 0.5, np.float32), abstract_state)
  assert flops.compression_ratio(state) == 1.0
  with pytest.raises(ValueError, match="abstract"):
    flops.compression_ratio(nnx.state(conv_bn_linear, nnx.Param))
