"""Tests of jaxprune.train.recompute_batch_stats against NumPy batch statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxprune.train as jt


class _ConvBNNet(nnx.Module):
  """3x3 conv (SAME, no bias) -> BatchNorm -> ReLU -> mean pool -> linear; dropout-free."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), padding="SAME", use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.bn(self.conv(x))).mean((1, 2)))


def _numpy_conv3x3_same(images, kernel):
  """[N, H, W, C] * [3, 3, C, F] cross-correlation with one zero pixel of padding."""
  padded = np.pad(images, ((0, 0), (1, 1), (1, 1), (0, 0)))
  n, h, w, _ = images.shape
  out = np.zeros((n, h, w, kernel.shape[-1]))
  for di in range(3):
    for dj in range(3):
      out += np.einsum("nhwc,cf->nhwf", padded[:, di : di + h, dj : dj + w], kernel[di, dj])
  return out


def _numpy_batch_stats(batches, kernel):
  """The average over batches of each batch's per-channel mean and biased variance."""
  outs = [_numpy_conv3x3_same(np.asarray(x, np.float64), kernel) for x, _ in batches]
  means = [o.mean((0, 1, 2)) for o in outs]
  variances = [o.var((0, 1, 2)) for o in outs]
  return np.mean(means, 0), np.mean(variances, 0)


def _batches(count, seed=0):
  rng = np.random.default_rng(seed)
  return [
    (rng.normal(1.0, 2.0, (8, 6, 6, 1)).astype(np.float32), np.zeros(8, np.int32))
    for _ in range(count)
  ]


def _shrunk_model(batches):
  """Running statistics accumulated with the initial weights, then the kernel shrunk 20x
  (as a strong group lasso does to a channel within a few steps)."""
  model = _ConvBNNet(rngs=nnx.Rngs(0))
  model.train()
  for images, _ in batches:
    model(jnp.asarray(images))
  model.conv.kernel[...] = model.conv.kernel[...] * 0.05
  model.eval()
  return model


def test_recompute_batch_stats_matches_numpy_batch_statistics_of_current_weights():
  batches = _batches(4)
  model = _shrunk_model(batches)
  kernel = np.asarray(model.conv.kernel[...], np.float64)
  mean, var = _numpy_batch_stats(batches, kernel)
  # Stale: what the shrunk kernel produces is far from the accumulated averages.
  assert not np.allclose(np.asarray(model.bn.var[...]), var, rtol=0.1)
  params = jax.tree.map(np.array, nnx.state(model, nnx.Param))

  used = jt.recompute_batch_stats(model, batches)

  assert used == 4
  np.testing.assert_allclose(np.asarray(model.bn.mean[...]), mean, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(model.bn.var[...]), var, rtol=1e-4, atol=1e-7)
  # Nothing else changes: parameters, and the model stays in eval mode.
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, nnx.Param), params)
  assert model.bn.use_running_average


def test_recompute_batch_stats_makes_eval_outputs_the_batch_statistics_outputs():
  batches = _batches(4)
  model = _shrunk_model(batches)
  images = jnp.asarray(batches[0][0])
  train_mode = nnx.clone(model)
  train_mode.train()
  with_batch_stats = np.asarray(train_mode(images))
  assert not np.allclose(np.asarray(model(images)), with_batch_stats, atol=1e-3)

  # One batch: the running statistics become exactly that batch's statistics.
  assert jt.recompute_batch_stats(model, iter(batches), num_batches=1) == 1
  np.testing.assert_allclose(np.asarray(model(images)), with_batch_stats, rtol=1e-4, atol=1e-5)
  mean, var = _numpy_batch_stats(batches[:2], np.asarray(model.conv.kernel[...], np.float64))
  jt.recompute_batch_stats(model, (x for x, _ in batches), num_batches=2)  # images alone
  np.testing.assert_allclose(np.asarray(model.bn.mean[...]), mean, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(np.asarray(model.bn.var[...]), var, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("num_batches", [0, -1, True, 1.5])
def test_recompute_batch_stats_bad_num_batches_raise(num_batches):
  with pytest.raises(ValueError, match="num_batches"):
    jt.recompute_batch_stats(_ConvBNNet(rngs=nnx.Rngs(0)), _batches(1), num_batches)


def test_recompute_batch_stats_without_batches_raises():
  with pytest.raises(ValueError, match="batches: yielded no batches"):
    jt.recompute_batch_stats(_ConvBNNet(rngs=nnx.Rngs(0)), [])
