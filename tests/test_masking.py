"""jaxprune.masking: the mask transform, apply / save / load, the mask-source registry."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune import masking
from jaxprune.clicktrain import readouts


def _params(seed=0):
  rng = np.random.default_rng(seed)

  def n(*shape, scale=0.3):
    return jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)

  return {
    "stem": {"kernel": n(3, 3, 3, 6)},
    "block": {"conv1": {"kernel": n(3, 3, 6, 8, scale=0.2)}},
    "head": {"kernel": n(8, 3), "bias": jnp.zeros(3)},
  }


def _masks(p, seed=1):
  rng = np.random.default_rng(seed)
  return {
    "stem": {"kernel": None},
    "block": {
      "conv1": {"kernel": jnp.asarray(rng.random(p["block"]["conv1"]["kernel"].shape) > 0.5)}
    },
    "head": {"kernel": jnp.asarray(rng.random((8, 3)) > 0.3, jnp.float32), "bias": None},
  }


def _grads(p, i):
  rng = np.random.default_rng(100 + i)
  return jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), p)


def _keep(m, p):
  """NumPy bool keep-mask per leaf (True where not masked)."""
  return jax.tree.map(
    lambda mm, pp: np.ones(pp.shape, bool) if mm is None else np.asarray(mm) != 0,
    m,
    p,
    is_leaf=lambda x: x is None,
  )


# ------------------------------------------------------------------ mask before an optimizer
def _adamw_numpy(p, grads_seq, keep, lr, wd_outer, wd, b1=0.9, b2=0.999, eps=1e-8):
  """Plain NumPy: decayed weights, then the mask (g where kept, -p elsewhere), then AdamW."""
  p = {k: np.asarray(v, np.float64) for k, v in p.items()}
  mu = {k: np.zeros_like(v) for k, v in p.items()}
  nu = {k: np.zeros_like(v) for k, v in p.items()}
  for t, g in enumerate(grads_seq, start=1):
    for k in p:
      gk = np.asarray(g[k], np.float64) + wd_outer * p[k]
      gk = np.where(keep[k], gk, -p[k])
      mu[k] = b1 * mu[k] + (1 - b1) * gk
      nu[k] = b2 * nu[k] + (1 - b2) * gk**2
      mhat, vhat = mu[k] / (1 - b1**t), nu[k] / (1 - b2**t)
      p[k] = p[k] - lr * (mhat / (np.sqrt(vhat) + eps) + wd * p[k])
  return p, mu, nu


def test_mask_before_adamw_keeps_zeros_and_moments_zero():
  p0 = _params()
  m = _masks(p0)

  def flat_p(t):
    return {"conv1": t["block"]["conv1"]["kernel"], "head": t["head"]["kernel"]}

  steps, lr, wd_outer, wd = 40, 0.05, 1e-3, 1e-2

  def run(tx):
    p = masking.apply_masks(p0, m)
    st = tx.init(p)
    upd = jax.jit(tx.update)
    for i in range(steps):
      u, st = upd(_grads(p0, i), st, p)
      p = optax.apply_updates(p, u)
    return p, st

  # Without the mask, AdamW and the decay re-fill the zeroed entries: the check below can fail.
  p_plain, _ = run(
    optax.chain(optax.add_decayed_weights(wd_outer), optax.adamw(lr, weight_decay=wd))
  )
  keep = _keep(m, p0)
  assert (
    np.count_nonzero(
      np.asarray(p_plain["block"]["conv1"]["kernel"])[~keep["block"]["conv1"]["kernel"]]
    )
    > 0
  )

  tx = optax.chain(
    optax.add_decayed_weights(wd_outer), masking.mask(m), optax.adamw(lr, weight_decay=wd)
  )
  p, st = run(tx)
  for leaf_keep, w in zip(jax.tree.leaves(keep), jax.tree.leaves(p)):
    assert np.all(np.asarray(w)[~leaf_keep] == 0.0)
  adam = st[2][0]  # chain(add_decayed_weights, mask, adamw) -> adamw = chain(scale_by_adam, ...)
  for leaf_keep, mu, nu in zip(
    jax.tree.leaves(keep), jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)
  ):
    assert np.all(np.asarray(mu)[~leaf_keep] == 0.0) and np.all(np.asarray(nu)[~leaf_keep] == 0.0)

  start = {k: v for k, v in flat_p(masking.apply_masks(p0, m)).items()}
  ref, _, _ = _adamw_numpy(
    start,
    [flat_p(_grads(p0, i)) for i in range(steps)],
    flat_p(keep),
    lr,
    wd_outer,
    wd,
  )
  for k, v in flat_p(p).items():
    np.testing.assert_allclose(np.asarray(v), ref[k], rtol=1e-3, atol=2e-5)
    assert np.all(ref[k][~flat_p(keep)[k]] == 0.0)


def test_mask_passes_kept_updates_bit_for_bit_and_callable_masks():
  p = _params()
  u = _grads(p, 0)

  def fn(params):
    return jax.tree.map(lambda x: jnp.abs(x) > 0.2, params)

  tx = masking.mask(fn)
  out, st = jax.jit(tx.update)(u, tx.init(p), p)
  for w, du, o in zip(jax.tree.leaves(p), jax.tree.leaves(u), jax.tree.leaves(out)):
    w, du, o = np.asarray(w), np.asarray(du), np.asarray(o)
    keep = np.abs(w) > 0.2
    np.testing.assert_array_equal(o[keep], du[keep])  # exact, not (p + u) - p
    np.testing.assert_array_equal(o[~keep], -w[~keep])
    assert np.all((w + o)[~keep] == 0.0)
  # the state holds the masks in force (what masking.find_masks reads)
  found = masking.find_masks((optax.EmptyState(), st), p)
  np.testing.assert_array_equal(
    found["head"]["kernel"], np.abs(np.asarray(p["head"]["kernel"])) > 0.2
  )


# ------------------------------------------------------------ adamw chained outside ClickTrain
def _conv(x, w):
  return jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _loss(p, x, y):
  h = jax.nn.relu(_conv(x, p["stem"]["kernel"]))
  h = jax.nn.relu(_conv(h, p["block"]["conv1"]["kernel"]))
  return optax.softmax_cross_entropy_with_integer_labels(
    h.mean((1, 2)) @ p["head"]["kernel"] + p["head"]["bias"], y
  ).mean()


def _batch(i):
  rng = np.random.default_rng(200 + i)
  return jnp.asarray(rng.normal(size=(8, 6, 6, 3)), jnp.float32), jnp.arange(8) % 3


def _train(step, p, st, steps, start=0, check=None):
  for i in range(start, start + steps):
    p, st = step(p, st, *_batch(i))
    if check is not None:
      check(p)
  return p, st


def test_mask_after_adamw_chained_outside_clicktrain(one_shot_clicktrain, optax_train_step):
  adamw = optax.adamw(1e-2, weight_decay=1e-2)
  tx = optax.chain(one_shot_clicktrain(), adamw)
  step = optax_train_step(_loss, tx)
  p = _params()
  p, st = _train(step, p, tx.init(p), 2)  # masks chosen, stage -> PRUNED at the epoch end
  assert readouts.stage_name(st) == "pruned"
  m = readouts.masks(st, p)
  keep = _keep(m, p)["block"]["conv1"]["kernel"]
  assert 0 < keep.sum() < keep.size

  # Without the mask: ClickTrain emits m*(p+u)-p, but AdamW chained after it rescales that,
  # so the pruned positions never reach zero (the bug this transform fixes).
  p_bad, st_bad = _train(step, p, st, 5, start=2)
  assert readouts.stage_name(st_bad) == "pruned"
  assert np.count_nonzero(np.asarray(p_bad["block"]["conv1"]["kernel"])[~keep]) > 0

  # The same run with mask(clicktrain masks) last: exactly zero after every step; the kept
  # entries move (training goes on).
  tx_m = optax.chain(one_shot_clicktrain(), adamw, masking.mask(m))
  st_m = (*st, masking.mask(m).init(p))

  def zero_where_pruned(q):
    assert np.all(np.asarray(q["block"]["conv1"]["kernel"])[~keep] == 0.0)

  p_ok, st_ok = _train(optax_train_step(_loss, tx_m), p, st_m, 5, start=2, check=zero_where_pruned)
  assert readouts.stage_name(st_ok) == "pruned"
  w0, w1 = (np.asarray(q["block"]["conv1"]["kernel"])[keep] for q in (p, p_ok))
  assert np.all(w0 != w1)
  np.testing.assert_array_equal(
    readouts.masks(st_ok, p_ok)["block"]["conv1"]["kernel"], m["block"]["conv1"]["kernel"]
  )


# ------------------------------------------------------------------ apply / save / load
def test_apply_masks_zeroes_only_masked_entries():
  p = _params()
  m = _masks(p)
  out = masking.apply_masks(p, m)
  for w, k, o in zip(jax.tree.leaves(p), jax.tree.leaves(_keep(m, p)), jax.tree.leaves(out)):
    np.testing.assert_array_equal(np.asarray(o), np.where(k, np.asarray(w), 0.0))


def test_save_load_round_trip(tmp_path):
  p = _params()
  m = _masks(p)
  path = tmp_path / "masks.npz"
  masking.save_masks(path, m)
  back = masking.load_masks(path, p)
  assert jax.tree.structure(back, is_leaf=lambda x: x is None) == jax.tree.structure(
    m, is_leaf=lambda x: x is None
  )
  for a, b in zip(jax.tree.leaves(m), jax.tree.leaves(back)):
    assert np.asarray(a).dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), b)
  assert back["stem"]["kernel"] is None and back["head"]["bias"] is None
  flat = masking.load_masks(path)  # no template: {path_string: array or None}
  assert set(flat) == {"stem/kernel", "block/conv1/kernel", "head/kernel", "head/bias"}
  assert flat["stem/kernel"] is None
  # ClickTrain's masks (float 0/1 from the state) round-trip too
  with pytest.raises(ValueError, match="params"):
    masking.load_masks(path, {"stem": p["stem"]})
  with pytest.raises(ValueError, match="params"):
    masking.load_masks(
      path, {**p, "head": {"kernel": jnp.zeros((4, 3)), "bias": p["head"]["bias"]}}
    )


def test_bad_masks():
  p = _params()
  m = _masks(p)
  half = jax.tree.map(lambda x: x * 0.5, m)
  with pytest.raises(ValueError, match="masks.*0 and 1"):
    masking.mask(half)
  nan = {**m, "head": {"kernel": jnp.full((8, 3), jnp.nan), "bias": None}}
  with pytest.raises(ValueError, match="masks.*non-finite"):
    masking.mask(nan)
  with pytest.raises(ValueError, match="masks.*structure"):
    masking.mask({"stem": {"kernel": None}}).init(p)
  wrong = {**m, "head": {"kernel": jnp.ones((3, 8), bool), "bias": None}}
  with pytest.raises(ValueError, match="masks.*shape"):
    masking.mask(wrong).init(p)
  with pytest.raises(ValueError, match=r"masks\(params\)"):
    masking.mask(lambda q: jax.tree.map(lambda x: x * 2.0, q)).init(p)
  tx = masking.mask(m)
  with pytest.raises(ValueError, match="params"):
    tx.update(p, tx.init(p))
  with pytest.raises(ValueError, match="masks"):
    masking.apply_masks(p, half)
  with pytest.raises(ValueError, match="masks"):
    masking.save_masks("unused.npz", half)


def test_find_masks_combines_sources_and_skips_unpruned_clicktrain(
  one_shot_clicktrain, optax_train_step
):
  p = _params()
  m = _masks(p)
  tx = optax.chain(one_shot_clicktrain(), masking.mask(m))
  st = tx.init(p)
  # ClickTrain not pruned yet: only the mask transform's masks
  found = masking.find_masks(st, p)
  np.testing.assert_array_equal(
    found["block"]["conv1"]["kernel"], np.asarray(m["block"]["conv1"]["kernel"])
  )
  assert found["stem"]["kernel"] is None
  p2, st2 = _train(optax_train_step(_loss, tx), p, st, 2)
  assert readouts.stage_name(st2) == "pruned"
  both = masking.find_masks(st2, p2)
  ct_keep = np.asarray(readouts.masks(st2, p2)["block"]["conv1"]["kernel"]) != 0
  np.testing.assert_array_equal(
    both["block"]["conv1"]["kernel"], ct_keep & np.asarray(m["block"]["conv1"]["kernel"])
  )
  assert masking.find_masks(optax.sgd(0.1).init(p), p) is None
  n, first = masking.count_refilled(found, jax.tree.map(jnp.ones_like, p))
  assert first == "block/conv1/kernel"
  assert n == int((~np.asarray(m["block"]["conv1"]["kernel"])).sum()) + int(
    (np.asarray(m["head"]["kernel"]) == 0).sum()
  )


def test_mask_last_in_an_nnx_optimizer():
  from flax import nnx

  model = nnx.Linear(6, 4, rngs=nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  m = jax.tree.map(lambda x: jnp.abs(x) > 0.3, params)
  m["bias"] = None
  nnx.update(model, masking.apply_masks(params, m))
  optimizer = nnx.Optimizer(model, optax.chain(optax.adamw(0.1), masking.mask(m)), wrt=nnx.Param)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 6)), jnp.float32)

  @nnx.jit
  def step(model, optimizer):
    optimizer.update(model, nnx.grad(lambda mdl: (mdl(x) ** 2).mean())(model))

  for _ in range(5):
    step(model, optimizer)
  keep = np.asarray(m["kernel"])
  w = np.asarray(model.kernel[...])
  assert np.all(w[~keep] == 0.0) and np.all(w[keep] != 0.0)
  assert masking.find_masks(optimizer, nnx.state(model, nnx.Param))["bias"] is None
