"""SDGP nm_prune against plain-loop references: every method, ties, NaN, dtypes, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprune import sdgp
from jaxprune.sdgp.prune import draw_uniforms

KEY = jax.random.key(0)


# ----------------------------------------------------------------------------------------
# Plain python-loop references, written from the definitions (SDGP §III-B, Chmiel et al.)
# ----------------------------------------------------------------------------------------


def _loop_select(x, n, m, method, uniforms=None):
  x = np.asarray(x, np.float64)
  flat = x.reshape(-1, x.shape[-1])
  out = np.zeros_like(flat)
  u = None if uniforms is None else np.asarray(uniforms, np.float64).reshape(flat.shape[0], -1)
  for r in range(flat.shape[0]):
    for g in range(flat.shape[1] // m):
      group = flat[r, g * m : (g + 1) * m]
      if method == "mvue":
        k = m // n
        for s in range(n):
          block = group[s * k : (s + 1) * k]
          bad = [i for i in range(k) if not np.isfinite(block[i])]
          if bad:
            out[r, g * m + s * k + bad[0]] = block[bad[0]]
            continue
          total = np.abs(block).sum()
          if total == 0:
            continue
          t = u[r, g * n + s] * total
          acc = 0.0
          for i in range(k):
            acc += abs(block[i])
            if t < acc or i == k - 1:
              out[r, g * m + s * k + i] = math.copysign(total, block[i])
              break
        continue
      if method == "random":
        scores = [(u[r, g * m + j], 0) for j in range(m)]
      else:
        scores = [(np.inf if np.isnan(v) else abs(v), np.isnan(v)) for v in group]
      # larger score first; NaN above everything; ties to the lower index
      order = sorted(range(m), key=lambda j: (not scores[j][1], -scores[j][0], j))
      for j in order[:n]:
        out[r, g * m + j] = group[j]
  out = out.reshape(x.shape)
  if method == "rescaled_magnitude":
    for b in range(x.shape[0]):
      for c in range(x.shape[-1]):
        total = np.abs(x[b, ..., c]).sum()
        kept = np.abs(out[b, ..., c]).sum()
        out[b, ..., c] *= total / (kept + 1e-4)  # the default: the released formula
  return out


def _with_ties(shape, seed):
  """Values from a small integer set so ties are frequent, random signs."""
  rng = np.random.default_rng(seed)
  return (rng.integers(0, 4, size=shape) * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)


NM = [(1, 2), (2, 4), (3, 4), (4, 8), (8, 32), (4, 4)]


@pytest.mark.parametrize("n,m", NM)
@pytest.mark.parametrize("method", ["magnitude", "rescaled_magnitude"])
def test_magnitude_methods_match_loop(method, n, m):
  for seed, x in enumerate(
    [_with_ties((2, 2, 3, 2 * m), 1), np.random.default_rng(2).normal(size=(2, 3, 2, 2 * m))]
  ):
    x = x.astype(np.float32)
    got = sdgp.nm_prune(jnp.asarray(x), n, m, method, backend="reference")
    np.testing.assert_allclose(np.asarray(got), _loop_select(x, n, m, method), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (2, 8), (8, 32)])
@pytest.mark.parametrize("method", ["random", "mvue"])
def test_random_methods_match_loop_given_draws(method, n, m):
  x = np.random.default_rng(3).normal(size=(3, 4, 2 * m)).astype(np.float32)
  x[0, 0, :m] = 0.0  # an all-zero group
  x[1, 1, 1] = 0.0
  key = jax.random.key(7)
  got = sdgp.nm_prune(jnp.asarray(x), n, m, method, key=key, backend="reference")
  uniforms = draw_uniforms(key, x.shape, n, m, method)
  np.testing.assert_allclose(
    np.asarray(got), _loop_select(x, n, m, method, uniforms), rtol=1e-5, atol=1e-6
  )


def test_paper_example_and_ties_to_lower_index():
  # SDGP §III-B: [1, 7, -3, 2] with n=2 -> [0, 7, -3, 0]
  np.testing.assert_array_equal(
    sdgp.nm_prune(jnp.array([1.0, 7.0, -3.0, 2.0]), 2, 4, "magnitude"), [0, 7, -3, 0]
  )
  np.testing.assert_array_equal(
    sdgp.nm_prune(jnp.array([2.0, -2.0, 2.0, 2.0]), 2, 4, "magnitude"), [2, -2, 0, 0]
  )
  np.testing.assert_array_equal(
    sdgp.nm_prune(jnp.array([0.0, 0.0, -0.0, 0.0]), 1, 4, "magnitude"), [0, 0, 0, 0]
  )


@pytest.mark.parametrize(
  "method, n, m", [("magnitude", 1, 4), ("rescaled_magnitude", 2, 4), ("random", 3, 8)]
)
def test_exactly_n_nonzeros_per_group(method, n, m):
  x = jax.random.normal(KEY, (2, 3, 3, 4 * m)) + 10.0  # no zeros
  key = jax.random.key(1) if method == "random" else None
  out = sdgp.nm_prune(x, n, m, method, key=key)
  counts = (np.asarray(out).reshape(-1, m) != 0).sum(-1)
  assert (counts == n).all()


def test_mvue_nonzeros_per_group_and_sub_blocks():
  x = jax.random.normal(KEY, (4, 4, 32)) + 10.0
  out = np.asarray(sdgp.nm_prune(x, 4, 16, "mvue", key=jax.random.key(3)))
  # one nonzero in each sub-block of 16 // 4 = 4 entries, so n per group of 16
  assert ((out.reshape(-1, 4) != 0).sum(-1) == 1).all()
  # kept entries carry the sub-block's L1 with their own sign
  blocks = np.asarray(x).reshape(-1, 4)
  np.testing.assert_allclose(out.reshape(-1, 4).sum(-1), np.abs(blocks).sum(-1), rtol=1e-5)


def test_nan_policy():
  x = jnp.array([[1.0, jnp.nan, 5.0, 2.0, jnp.nan, jnp.nan, 3.0, -jnp.inf]])
  out = np.asarray(sdgp.nm_prune(x, 1, 4, "magnitude"))
  # NaN ranks above everything and propagates; two NaNs tie -> the lower index wins
  assert np.isnan(out[0, 1]) and (out[0, [0, 2, 3]] == 0).all()
  assert np.isnan(out[0, 4]) and (out[0, 5:] == 0).all()
  out2 = np.asarray(sdgp.nm_prune(x, 2, 4, "magnitude"))
  assert np.isnan(out2[0, 4]) and np.isnan(out2[0, 5]) and (out2[0, [6, 7]] == 0).all()
  # +-inf ranks above finite values but below NaN
  out3 = np.asarray(sdgp.nm_prune(jnp.array([[1.0, -jnp.inf, 5.0, jnp.nan]]), 2, 4, "magnitude"))
  assert np.isnan(out3[0, 3]) and out3[0, 1] == -np.inf and (out3[0, [0, 2]] == 0).all()
  # rescaled: the NaN's (sample, channel) is not rescaled (the NaN kept, the rest as magnitude
  # left it); other channels stay finite (tests/sdgp/test_rescale.py has the details)
  y = jnp.ones((1, 2, 2, 4)).at[0, 0, 0, 1].set(jnp.nan)
  r = np.asarray(sdgp.nm_prune(y, 2, 4, "rescaled_magnitude"))
  np.testing.assert_array_equal(r[..., 1], np.asarray(sdgp.nm_prune(y, 2, 4, "magnitude"))[..., 1])
  assert np.isnan(r[0, 0, 0, 1]) and np.isfinite(r[..., [0, 2, 3]]).all()
  # mvue keeps the first non-finite entry of a sub-block, zeros the rest
  z = jnp.array([[1.0, jnp.nan, 2.0, 3.0, jnp.inf, 1.0, 0.0, 0.0]])
  mv = np.asarray(sdgp.nm_prune(z, 1, 4, "mvue", key=KEY))
  assert np.isnan(mv[0, 1]) and (mv[0, [0, 2, 3]] == 0).all()
  assert mv[0, 4] == np.inf and (mv[0, 5:] == 0).all()


@pytest.mark.parametrize(
  "method, dtype",
  [
    ("magnitude", jnp.bfloat16),
    ("rescaled_magnitude", jnp.float16),
    ("rescaled_magnitude", jnp.bfloat16),
    ("mvue", jnp.bfloat16),
    ("random", jnp.float16),
  ],
)
def test_low_precision_dtypes(method, dtype):
  x32 = jax.random.normal(KEY, (2, 4, 4, 8))
  x = x32.astype(dtype)
  key = jax.random.key(2) if method in ("random", "mvue") else None
  out = sdgp.nm_prune(x, 2, 4, method, key=key)
  assert out.dtype == dtype
  expected = _loop_select(
    np.asarray(x.astype(jnp.float32)), 2, 4, method, draw_uniforms(key, x.shape, 2, 4, method)
  )
  np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=1e-2, atol=1e-2)


def test_jit_and_vmap():
  x = jax.random.normal(KEY, (3, 2, 4, 4, 8))
  f = jax.jit(lambda x: sdgp.nm_prune(x, 2, 4, "rescaled_magnitude"))
  per_example = jnp.stack([f(x[i]) for i in range(3)])
  np.testing.assert_allclose(jax.vmap(f)(x), per_example, rtol=1e-6)
  keys = jax.random.split(KEY, 3)
  g = lambda x, k: sdgp.nm_prune(x, 1, 4, "mvue", key=k)
  batched = jax.jit(jax.vmap(g))(x, keys)
  np.testing.assert_allclose(batched, jnp.stack([g(x[i], keys[i]) for i in range(3)]), rtol=1e-6)


def test_mvue_is_unbiased():
  # E[out] = x; out_i = sign(x_i) S w.p. |x_i|/S, so Var(out_i) = |x_i| S - x_i^2 (per sub-block).
  x = jnp.array([[0.5, -2.0, 0.1, 1.0, 3.0, 0.0, -0.2, 0.7]])
  draws = 20000
  keys = jax.random.split(jax.random.key(123), draws)
  outs = jax.vmap(lambda k: sdgp.nm_prune(x, 2, 8, "mvue", key=k))(keys)
  mean = np.asarray(outs.mean(0))[0]
  xs = np.asarray(x)[0]
  sums = np.repeat(np.abs(xs).reshape(2, 4).sum(-1), 4)
  std_of_mean = np.sqrt((np.abs(xs) * sums - xs**2) / draws)
  assert (np.abs(mean - xs) <= 5 * std_of_mean + 1e-6).all(), (mean, xs)
  # and magnitude pruning is not: it is biased towards zero on the same input
  assert not np.allclose(np.asarray(sdgp.nm_prune(x, 2, 8, "magnitude"))[0], xs)


def test_random_keeps_uniform_subsets():
  x = jnp.ones((1, 8))
  keys = jax.random.split(jax.random.key(5), 4000)
  kept = jax.vmap(lambda k: sdgp.nm_prune(x, 1, 4, "random", key=k))(keys) != 0
  freq = np.asarray(kept.mean(0))[0]
  # each position kept with probability n/m = 1/4; binomial std ~ 0.0068
  np.testing.assert_allclose(freq, 0.25, atol=0.035)


@pytest.mark.parametrize(
  "kwargs, match",
  [
    # Anchored at the start: the argument's name, then what is wrong with it.
    (dict(n=3, m=2), r"^n must be an int with 1 <= n <= m=2, got 3"),
    (dict(n=0, m=4), r"^n must be an int with 1 <= n <= m=4, got 0"),
    (dict(n=2, m=3), r"^x: last axis \(8\) must be divisible by m=3"),
    (dict(n=2, m=64), r"^m must be an int in \[1, 32\], got 64"),
    (dict(n=2, m=0), r"^m must be an int in \[1, 32\], got 0"),
    (dict(n=2, m=4, method="topk"), r"^method must be one of .*, got 'topk'"),
    (dict(n=2, m=4, method="random"), r"^key is required for method 'random'"),
    (dict(n=2, m=4, method="mvue"), r"^key is required for method 'mvue'"),
    (dict(n=3, m=4, method="mvue", key=KEY), r"^n: method 'mvue' needs m divisible by n"),
    (dict(n=2, m=4, backend="cuda"), r"^backend must be one of .*, got 'cuda'"),
  ],
)
def test_bad_arguments_raise(kwargs, match):
  args = dict(method="magnitude")
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    sdgp.nm_prune(jnp.ones((2, 8)), args.pop("n"), args.pop("m"), args.pop("method"), **args)
  with pytest.raises(ValueError, match=r"^x must have a floating dtype, got int32"):
    sdgp.nm_prune(jnp.ones((2, 8), jnp.int32), 2, 4, "magnitude")
  with pytest.raises(ValueError, match=r"^x: method 'rescaled_magnitude' needs at least 2 axes"):
    sdgp.nm_prune(jnp.ones((8,)), 2, 4, "rescaled_magnitude")
