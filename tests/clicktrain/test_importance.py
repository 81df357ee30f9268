"""ClickTrain Eq. 1 / Eq. 2 against plain loops over kernels and patterns."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune.clicktrain import importance, patterns


def _loop_pattern_scores(w, g, pats):
  kh, kw, cin, cout = w.shape
  out = np.zeros((cin, cout, len(pats)))
  for c, f, i in itertools.product(range(cin), range(cout), range(len(pats))):
    t = g[:, :, c, f] * w[:, :, c, f] * pats[i]
    out[c, f, i] = np.sum(t**2)
  return out


def _loop_kernel_scores(w, g):
  kh, kw, cin, cout = w.shape
  out = np.zeros((cin, cout))
  for c, f in itertools.product(range(cin), range(cout)):
    out[c, f] = sum((g[h, s, c, f] * w[h, s, c, f]) ** 2 for h in range(kh) for s in range(kw))
  return out


@pytest.mark.parametrize("shape", [(3, 3, 4, 5), (5, 5, 2, 3), (1, 1, 3, 2)])
def test_scores_match_loops(shape):
  rng = np.random.default_rng(0)
  w = rng.normal(size=shape).astype(np.float32)
  g = rng.normal(size=shape).astype(np.float32)
  k = shape[0]
  pats = rng.integers(0, 2, size=(7, k, k)).astype(np.float32)
  np.testing.assert_allclose(
    importance.pattern_scores(w, g, pats), _loop_pattern_scores(w, g, pats), rtol=1e-5, atol=1e-6
  )
  np.testing.assert_allclose(
    importance.kernel_scores(w, g), _loop_kernel_scores(w, g), rtol=1e-5, atol=1e-6
  )


def test_weight_importance_is_squared_product():
  w = jnp.array([1.0, -2.0, 3.0])
  g = jnp.array([0.5, 0.5, -1.0])
  np.testing.assert_allclose(importance.weight_importance(w, g), [0.25, 1.0, 9.0])


def test_all_pattern_scores_sum_of_kept_positions():
  # With the full pattern table, every score is the sum over that pattern's 4 kept
  # positions of the per-weight importance.
  rng = np.random.default_rng(1)
  w = rng.normal(size=(3, 3, 2, 2)).astype(np.float32)
  g = rng.normal(size=(3, 3, 2, 2)).astype(np.float32)
  s = np.asarray(importance.pattern_scores(w, g, patterns.all_patterns()))
  imp = (w * g) ** 2
  for i, combo in enumerate(itertools.combinations(range(9), 4)):
    r, c = np.divmod(np.array(combo), 3)
    np.testing.assert_allclose(s[:, :, i], imp[r, c].sum(0), rtol=1e-5)


def test_jit():
  w = jnp.ones((3, 3, 2, 2))
  f = jax.jit(importance.pattern_scores)
  assert f(w, w, jnp.asarray(patterns.library_patterns())).shape == (2, 2, 12)


def test_bad_shapes_raise():
  w = jnp.ones((3, 3, 2, 2))
  with pytest.raises(ValueError, match="w must"):
    importance.kernel_scores(jnp.ones((3, 3, 2)), jnp.ones((3, 3, 2)))
  with pytest.raises(ValueError, match="g must"):
    importance.kernel_scores(w, jnp.ones((3, 3, 2, 3)))
  with pytest.raises(ValueError, match="patterns"):
    importance.pattern_scores(w, w, jnp.ones((4, 2, 2)))
  with pytest.raises(ValueError, match="patterns"):
    importance.pattern_scores(w, w, jnp.ones((3, 3)))
  with pytest.raises(ValueError, match="g must"):
    importance.weight_importance(jnp.ones(3), jnp.ones(4))
