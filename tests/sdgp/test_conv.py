"""SDGP: sdgp_conv VJPs against jax.vjp of the dense conv, SDGPConv and convert_model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprune import sdgp

KEY = jax.random.key(0)


# ----------------------------------------------------------------------------------------
# sdgp_conv
# ----------------------------------------------------------------------------------------

CONV_CASES = [
  dict(strides=(1, 1), padding="SAME"),
  dict(strides=(2, 2), padding="VALID"),
  dict(strides=(1, 2), padding=((2, 1), (0, 1)), rhs_dilation=(2, 1)),
  dict(strides=(1, 1), padding="SAME", feature_group_count=2),
  dict(strides=(1, 1), padding=1, lhs_dilation=(2, 2)),
]


@pytest.mark.parametrize(
  "case, method",
  list(
    zip(CONV_CASES, ["magnitude", "rescaled_magnitude", "mvue", "random", "rescaled_magnitude"])
  ),
)
def test_sdgp_conv_vjp_matches_hand_pruned(case, method):
  kx, kw, kg = jax.random.split(jax.random.key(11), 3)
  groups = case.get("feature_group_count", 1)
  x = jax.random.normal(kx, (2, 7, 6, 4))
  w = jax.random.normal(kw, (3, 3, 4 // groups, 8))
  key = jax.random.key(4) if method in ("mvue", "random") else None

  def dense(x, w):
    padding = [(1, 1), (1, 1)] if case["padding"] == 1 else case["padding"]
    return jax.lax.conv_general_dilated(
      x,
      w,
      case["strides"],
      padding,
      lhs_dilation=case.get("lhs_dilation"),
      rhs_dilation=case.get("rhs_dilation"),
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=groups,
    )

  @jax.jit
  def both(x, w):
    y, vjp = jax.vjp(
      lambda x, w: sdgp.sdgp_conv(x, w, n=2, m=4, method=method, key=key, **case), x, w
    )
    y_ref, vjp_ref = jax.vjp(dense, x, w)
    g = jax.random.normal(kg, y.shape)
    g_pruned = sdgp.nm_prune(g, 2, 4, method, key=key)  # pruned by hand
    dx_ref, _ = vjp_ref(g_pruned)
    dx_dense, dw_ref = vjp_ref(g)  # weight gradient from the dense cotangent
    return (y, *vjp(g)), (y_ref, dx_ref, dw_ref), dx_dense

  (y, dx, dw), (y_ref, dx_ref, dw_ref), dx_dense = both(x, w)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, dx_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dw, dw_ref, rtol=1e-4, atol=1e-4)
  assert not np.allclose(dx, dx_dense, atol=1e-3)  # pruning did change dX


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sdgp_conv_low_precision_under_jit_and_vmap(dtype):
  x = jax.random.normal(KEY, (3, 2, 5, 5, 4)).astype(dtype)
  w = (0.3 * jax.random.normal(jax.random.key(1), (3, 3, 4, 8))).astype(dtype)
  loss = lambda x, w: (
    sdgp.sdgp_conv(x, w, n=2, m=4, method="rescaled_magnitude").astype(jnp.float32).sum()
  )
  dx, dw = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(x, w)
  assert (
    dx.dtype == dtype and dw.dtype == dtype and dx.shape == x.shape and dw.shape == (3, 3, 3, 4, 8)
  )
  dx0, dw0 = jax.grad(loss, argnums=(0, 1))(x[0], w)
  np.testing.assert_allclose(
    dx[0].astype(jnp.float32), dx0.astype(jnp.float32), rtol=2e-2, atol=2e-2
  )
  np.testing.assert_allclose(
    dw[0].astype(jnp.float32), dw0.astype(jnp.float32), rtol=2e-2, atol=2e-2
  )


def test_sdgp_conv_bad_arguments():
  x, w = jnp.ones((1, 4, 4, 4)), jnp.ones((3, 3, 4, 6))
  with pytest.raises(ValueError, match=r"^kernel: 6 output channels are not divisible by m=4"):
    sdgp.sdgp_conv(x, w, n=2, m=4, method="magnitude")
  with pytest.raises(ValueError, match=r"^key is required for method 'random'"):
    sdgp.sdgp_conv(x, jnp.ones((3, 3, 4, 8)), n=2, m=4, method="random")
  with pytest.raises(ValueError, match=r"^x must be NHWC \(4-D\), got shape \(4, 4, 4\)"):
    sdgp.sdgp_conv(jnp.ones((4, 4, 4)), jnp.ones((3, 3, 4, 8)), n=2, m=4, method="magnitude")


# ----------------------------------------------------------------------------------------
# SDGPConv and convert_model
# ----------------------------------------------------------------------------------------


class _TinyNet(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
    self.blocks = nnx.List(
      [nnx.Conv(8, 8, (3, 3), rngs=rngs), nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs)]
    )
    self.head = nnx.Linear(16, 5, rngs=rngs)

  def __call__(self, x):
    x = jax.nn.relu(self.stem(x))
    for conv in self.blocks:
      x = jax.nn.relu(conv(x))
    return self.head(x.mean((1, 2)))


@nnx.jit
def _grads(model, x):
  return nnx.grad(lambda mdl: (mdl(x) ** 2).sum())(model)


def test_convert_model_shares_weights_and_skips_stem_and_dense():
  model = _TinyNet(nnx.Rngs(0))
  old = [model.stem, model.blocks[0], model.blocks[1], model.head]
  params_before = nnx.state(model, nnx.Param)
  x = jax.random.normal(KEY, (2, 8, 8, 3))
  grads_dense = _grads(model, x)
  y_dense = nnx.jit(lambda mdl, x: mdl(x))(model, x)
  converted = sdgp.convert_model(model, n=2, m=4, method="magnitude")
  assert converted is model
  assert model.stem is old[0] and type(model.stem) is nnx.Conv
  assert model.head is old[3]
  for i in range(2):
    assert isinstance(model.blocks[i], sdgp.SDGPConv)
    assert model.blocks[i].kernel is old[i + 1].kernel and model.blocks[i].bias is old[i + 1].bias
  params_after = nnx.state(model, nnx.Param)
  assert jax.tree.structure(params_before) == jax.tree.structure(params_after)
  jax.tree.map(np.testing.assert_array_equal, params_before, params_after)
  np.testing.assert_allclose(
    nnx.jit(lambda mdl, x: mdl(x))(model, x), y_dense, rtol=1e-6
  )  # forward unchanged
  grads_sdgp = _grads(model, x)
  # the top conv's dW and the head see the dense cotangent; the stem gets a pruned one
  np.testing.assert_allclose(
    grads_sdgp["head"]["kernel"][...], grads_dense["head"]["kernel"][...], rtol=1e-5
  )
  np.testing.assert_allclose(
    grads_sdgp["blocks"][1]["kernel"][...], grads_dense["blocks"][1]["kernel"][...], rtol=1e-5
  )
  assert not np.allclose(grads_sdgp["stem"]["kernel"][...], grads_dense["stem"]["kernel"][...])


class _StemOnly(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.head = nnx.Linear(8, 5, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.stem(x)).mean((1, 2)))


def test_convert_model_refuses_a_model_with_nothing_to_convert():
  # Before, the model came back unchanged: a dense run under SDGP's name.
  with pytest.raises(
    ValueError, match=r"min_in_channels=4 .* 1 nnx\.Conv, all with fewer: stem \(3 in\)"
  ):
    sdgp.convert_model(_StemOnly(nnx.Rngs(0)), n=2, m=4, method="magnitude")
  with pytest.raises(ValueError, match=r"no nnx\.Conv in Linear"):
    sdgp.method().convert(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
  # lowering min_in_channels is the way to convert the stem on purpose
  model = sdgp.convert_model(
    _StemOnly(nnx.Rngs(0)), n=2, m=4, method="magnitude", min_in_channels=3
  )
  assert isinstance(model.stem, sdgp.SDGPConv)


def test_convert_model_identity_when_n_equals_m():
  model = _TinyNet(nnx.Rngs(1))
  x = jax.random.normal(KEY, (2, 8, 8, 3))
  dense = _grads(model, x)
  sdgp.convert_model(model, n=4, m=4, method="magnitude")
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), _grads(model, x), dense
  )


def test_random_method_keys_advance_in_jitted_step():
  model = sdgp.convert_model(_TinyNet(nnx.Rngs(2)), n=1, m=4, method="mvue", seed=3)
  k0 = [jax.random.key_data(model.blocks[i].sdgp_key[...]) for i in range(2)]
  assert not np.array_equal(k0[0], k0[1])  # per-layer keys
  x = jax.random.normal(KEY, (2, 8, 8, 3))
  step = _grads
  g1 = step(model, x)
  k1 = jax.random.key_data(model.blocks[0].sdgp_key[...])
  g2 = step(model, x)
  assert not np.array_equal(k0[0], k1)
  # fresh masks per step: the stem's gradient (below two pruned convs) changes
  assert not np.allclose(g1["stem"]["kernel"][...], g2["stem"]["kernel"][...])


def test_convert_model_bad_arguments():
  with pytest.raises(
    ValueError, match=r"^model: conv at blocks/0 has 8 output channels, not divisible by m=16"
  ):
    sdgp.convert_model(_TinyNet(nnx.Rngs(0)), n=2, m=16, method="magnitude")
  with pytest.raises(ValueError, match=r"^method must be one of .*, got 'bogus'"):
    sdgp.convert_model(_TinyNet(nnx.Rngs(0)), n=2, m=4, method="bogus")
  with pytest.raises(
    ValueError, match=r"^out_features: 6 output channels are not divisible by m=4"
  ):
    sdgp.SDGPConv(8, 6, (3, 3), n=2, m=4, method="magnitude", rngs=nnx.Rngs(0))


def test_convert_model_twice_raises_instead_of_keeping_first_setting():
  model = _TinyNet(nnx.Rngs(0))
  sdgp.convert_model(model, n=2, m=4, method="rescaled_magnitude")
  with pytest.raises(ValueError, match="model: already converted.*n=2, m=4"):
    sdgp.convert_model(model, n=1, m=4, method="rescaled_magnitude")
  # The first setting is intact (every SDGPConv still n=2).
  convs = [c for _, c in nnx.iter_modules(model) if isinstance(c, sdgp.SDGPConv)]
  assert convs and all(c.n == 2 for c in convs)


# ----------------------------------------------------------------------------------------
# SDGPSettings: one frozen object from the preset to the backward pass
# ----------------------------------------------------------------------------------------


KEY_X = jax.random.normal(KEY, (2, 8, 8, 3))


def test_settings_are_checked_once_and_passed_down_as_they_are(monkeypatch):
  from pallas_kernels import nm_math

  calls = []
  check = nm_math.validate_settings
  monkeypatch.setattr(nm_math, "validate_settings", lambda *a: (calls.append(a), check(*a)))
  method = sdgp.method(n=1, m=4, method="mvue", seed=3)
  model = method.convert(_TinyNet(nnx.Rngs(0)))
  settings = method.convert.settings
  assert all(model.blocks[i].settings is settings for i in range(2))
  # Forward and backward, traced afresh (a function of its own: no cached trace).
  nnx.jit(lambda mdl, x: nnx.grad(lambda mdl: (mdl(x) ** 2).sum())(mdl))(model, KEY_X)
  assert calls == [(1, 4, "mvue")]


def test_settings_bad_arguments_and_frozen():
  with pytest.raises(ValueError, match=r"^n must be an int with 1 <= n <= m=2, got 3"):
    sdgp.SDGPSettings(n=3, m=2, method="magnitude")
  with pytest.raises(ValueError, match=r"^n: method 'mvue' needs m divisible by n"):
    sdgp.SDGPSettings(n=3, m=4, method="mvue")
  with pytest.raises(ValueError, match=r"^backend must be one of .*, got 'cuda'"):
    sdgp.SDGPSettings(n=2, m=4, method="magnitude", backend="cuda")
  with pytest.raises(ValueError, match=r"^backend must be one of .*, got 'cuda'"):
    sdgp.method(backend="cuda")  # before any model is seen
  settings = sdgp.SDGPSettings(n=2, m=4, method="random")
  assert settings.uses_key and not sdgp.SDGPSettings(2, 4, "magnitude").uses_key
  assert hash(settings) == hash(sdgp.SDGPSettings(2, 4, "random", "auto"))
  with pytest.raises(AttributeError):
    settings.n = 1
  with pytest.raises(ValueError, match="^settings: give either settings or n, m and method"):
    sdgp.SDGPConv(8, 8, (3, 3), n=2, settings=settings, rngs=nnx.Rngs(0))
