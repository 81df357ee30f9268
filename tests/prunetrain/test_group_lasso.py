"""Channel group lasso (PruneTrain Eq. 2, 3) against plain-loop references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune.prunetrain import group_lasso as gl
from jaxprune import models, train
from jaxprune import prunetrain as pt
from jaxprune.paths import param_path

EPS = 1e-8


def _params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 8)
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  return {
    "stem": {
      "conv": {"kernel": normal(keys[0], (3, 3, 3, 4))},
      "bn": {"scale": normal(keys[1], (4,)), "bias": normal(keys[2], (4,))},
    },
    "block": {
      "conv": {"kernel": normal(keys[3], (3, 3, 4, 5))},
      "shortcut": {"kernel": normal(keys[4], (1, 1, 4, 5))},
    },
    "hidden": {"kernel": normal(keys[5], (5, 6)), "bias": normal(keys[6], (6,))},
    "out": {"kernel": normal(keys[7], (6, 3))},
  }


def _loop_penalty(p, xp=jnp):
  """Σ over groups of sqrt(Σw² + ε), written group by group (independent of the library).

  ``xp=np`` evaluates it in NumPy (float64); with ``jnp`` it can be differentiated.
  """
  total = 0.0

  def norm(group):
    return xp.sqrt(xp.sum(group**2) + EPS)

  stem = p["stem"]["conv"]["kernel"]
  for f in range(stem.shape[3]):
    total += norm(stem[:, :, :, f])  # stem: output groups only (input = the image)
  for kernel in (p["block"]["conv"]["kernel"], p["block"]["shortcut"]["kernel"]):
    for f in range(kernel.shape[3]):
      total += norm(kernel[:, :, :, f])
    for c in range(kernel.shape[2]):
      total += norm(kernel[:, :, c, :])
  hidden = p["hidden"]["kernel"]
  for i in range(hidden.shape[0]):
    total += norm(hidden[i, :])
  for j in range(hidden.shape[1]):
    total += norm(hidden[:, j])
  out = p["out"]["kernel"]
  for i in range(out.shape[0]):  # classifier: input columns only, never the logits
    total += norm(out[i, :])
  return total


def _is_stem(names, leaf, kernels):
  return "stem" in names


def test_penalty_matches_group_loop():
  params = _params()
  numpy_params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  np.testing.assert_allclose(
    gl.penalty(params, is_input_conv=_is_stem), _loop_penalty(numpy_params, np), rtol=1e-5
  )


def test_default_predicates_find_stem_and_classifier():
  params = _params()
  layout = gl.leaf_groups(params)
  assert layout["stem"]["conv"]["kernel"] == gl.LeafGroups(output_axis=3, input_axis=None)
  assert layout["block"]["conv"]["kernel"] == gl.LeafGroups(output_axis=3, input_axis=2)
  assert layout["hidden"]["kernel"] == gl.LeafGroups(output_axis=1, input_axis=0)
  assert layout["out"]["kernel"] == gl.LeafGroups(output_axis=None, input_axis=0)
  assert layout["stem"]["bn"]["scale"] is None and layout["hidden"]["bias"] is None
  numpy_params = jax.tree.map(np.asarray, params)
  np.testing.assert_allclose(gl.penalty(params), _loop_penalty(numpy_params, np), rtol=1e-5)


def test_predicate_override_changes_groups():
  params = _params()
  everything = gl.penalty(params, is_input_conv=lambda *a: False, is_classifier=lambda *a: False)
  stem = np.asarray(params["stem"]["conv"]["kernel"])
  out = np.asarray(params["out"]["kernel"])
  extra = sum(math.sqrt(np.sum(stem[:, :, c, :] ** 2) + EPS) for c in range(3))
  extra += sum(math.sqrt(np.sum(out[:, j] ** 2) + EPS) for j in range(3))
  numpy_params = jax.tree.map(np.asarray, params)
  np.testing.assert_allclose(everything, _loop_penalty(numpy_params, np) + extra, rtol=1e-5)


@pytest.mark.parametrize("family", ["resnet", "vgg"])
def test_model_layout(family):
  # (abstract: the layout needs only paths and shapes).
  if family == "resnet":
    model = nnx.eval_shape(
      lambda: models.create("prunetrain-resnet20", num_classes=10, rngs=nnx.Rngs(0))
    )
    stem_path, classifier_path = ("stem", "conv", "kernel"), ("head", "kernel")
  else:
    model = nnx.eval_shape(
      lambda: models.create("clicktrain-vgg11", num_classes=10, rngs=nnx.Rngs(0))
    )
    stem_path, classifier_path = ("features", 0, "conv", "kernel"), ("classifier", 2, "kernel")
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  flat = jax.tree_util.tree_flatten_with_path(gl.leaf_groups(params))[0]
  layout = {param_path(p): g for p, g in flat}
  for names, groups in layout.items():
    if names == stem_path:
      assert groups == gl.LeafGroups(3, None)
    elif names == classifier_path:
      assert groups == gl.LeafGroups(None, 0)
    elif names[-1] == "kernel":
      assert groups.output_axis is not None and groups.input_axis is not None, names
    else:
      assert groups is None, names


def test_group_lasso_adds_coefficient_times_gradient():
  params = _params(1)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
  tx = gl.add_group_lasso(0.3, is_input_conv=_is_stem)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  reference = jax.jit(jax.grad(_loop_penalty))(params)
  jax.tree.map(
    lambda u, g, r: np.testing.assert_allclose(u, g + 0.3 * r, rtol=1e-4, atol=1e-6),
    updates,
    grads,
    reference,
  )


def test_gradient_of_a_zero_group_is_zero():
  params = _params(2)
  params["block"]["conv"]["kernel"] = params["block"]["conv"]["kernel"].at[..., 1].set(0.0)
  params["block"]["conv"]["kernel"] = params["block"]["conv"]["kernel"].at[:, :, 2, :].set(0.0)
  for gradient in (jax.grad(gl.penalty), gl.penalty_gradient):
    grad = jax.jit(gradient)(params)["block"]["conv"]["kernel"]
    assert np.all(np.isfinite(grad))
    np.testing.assert_array_equal(grad[..., 1], 0.0)
    np.testing.assert_array_equal(grad[:, :, 2, :], 0.0)


@pytest.mark.parametrize("family", ["prunetrain-resnet32", "prunetrain-vgg11"])
def test_penalty_gradient_equals_autodiff_of_the_penalty(family):
  model = models.create(family, num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.25)
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  # a dead output group and a dead input group, as during training
  leaves, treedef = jax.tree.flatten(params)
  kernel = next(i for i, x in enumerate(leaves) if x.ndim == 4 and x.shape[2] > 3)
  leaves[kernel] = leaves[kernel].at[..., 0].set(0.0).at[:, :, 1, :].set(0.0)
  params = jax.tree.unflatten(treedef, leaves)
  written_out = jax.jit(gl.penalty_gradient)(params)
  autodiff = jax.jit(jax.grad(gl.penalty))(params)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), written_out, autodiff
  )


@pytest.mark.parametrize("ratio", [0.05, 0.2, 0.25, 0.9])
def test_coefficient_from_ratio_gives_the_ratio(ratio):
  loss, penalty = 2.302, 417.5
  lam = float(gl.coefficient_from_ratio(ratio, loss, penalty))
  assert lam * penalty / (loss + lam * penalty) == pytest.approx(ratio, rel=1e-6)


@pytest.mark.parametrize(
  "kwargs, name",
  [
    (dict(ratio=0.0, loss=1.0, penalty=1.0), "ratio"),
    (dict(ratio=1.0, loss=1.0, penalty=1.0), "ratio"),
    (dict(ratio=-0.2, loss=1.0, penalty=1.0), "ratio"),
    (dict(ratio=0.2, loss=1.0, penalty=0.0), "penalty"),
    (dict(ratio=0.2, loss=1.0, penalty=-3.0), "penalty"),
    (dict(ratio=0.2, loss=-1.0, penalty=3.0), "loss"),
    (dict(ratio=0.2, loss=float("nan"), penalty=3.0), "loss"),
  ],
)
def test_coefficient_from_ratio_rejects_bad_input(kwargs, name):
  with pytest.raises(ValueError, match=name):
    gl.coefficient_from_ratio(**kwargs)


def test_bad_transform_arguments():
  with pytest.raises(ValueError, match="coefficient"):
    gl.add_group_lasso(-1.0)
  for ratio in (0.0, 1.0, 1.5):
    with pytest.raises(ValueError, match="penalty_ratio"):
      gl.group_lasso_from_ratio(ratio)
    with pytest.raises(ValueError, match="penalty_ratio"):
      pt.with_group_lasso(optax.sgd(0.1), penalty_ratio=ratio)
  params = _params()
  with pytest.raises(ValueError, match="params"):
    gl.add_group_lasso(0.1).update(params, gl.GroupLassoState(), None)
  tx = gl.group_lasso_from_ratio(0.2)
  with pytest.raises(ValueError, match="value: .* the loss"):
    tx.update(params, tx.init(params), params)
  with pytest.raises(ValueError, match="params: "):
    tx.update(params, tx.init(params), None, value=1.0)
  # the proximal form sets λ the same way and names the same arguments
  proximal = pt.with_group_lasso(train.sgd(0.1), proximal=True)
  with pytest.raises(ValueError, match="value: .* the loss"):
    proximal.update(params, proximal.init(params), params)


def test_ratio_is_set_at_first_step_then_fixed():
  params = _params(3)
  grads = jax.tree.map(jnp.zeros_like, params)
  tx = gl.group_lasso_from_ratio(0.2)
  update = jax.jit(tx.update)
  updates, state = update(grads, tx.init(params), params, value=2.5)
  gl0 = float(jax.jit(gl.penalty)(params))
  lam = float(state.coefficient)
  assert lam * gl0 / (2.5 + lam * gl0) == pytest.approx(0.2, rel=1e-5)
  ref = jax.jit(jax.grad(gl.penalty))(params)
  jax.tree.map(
    lambda u, r: np.testing.assert_allclose(u, lam * r, rtol=1e-5, atol=1e-7), updates, ref
  )
  # Later steps: other loss, other params: λ unchanged.
  other = jax.tree.map(lambda x: 0.5 * x, params)
  _, state2 = update(grads, state, other, value=0.1)
  assert float(state2.coefficient) == lam
  # the same outside jit (the state is concrete there: no conditional is traced)
  _, eager = tx.update(grads, tx.init(params), params, value=2.5)
  assert float(eager.coefficient) == pytest.approx(lam, rel=1e-6)
  _, eager2 = tx.update(grads, eager, other, value=0.1)
  assert float(eager2.coefficient) == float(eager.coefficient)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("form", ["ratio", "with_group_lasso", "proximal"])
def test_ratio_is_set_from_the_first_finite_loss(form, bad):
  # A non-finite first loss must not fix λ = NaN for the run: λ stays unset (no penalty)
  # until the first finite loss, under jit as outside it.
  params = _params(3)
  grads = jax.tree.map(jnp.zeros_like, params)
  tx = {
    "ratio": lambda: gl.group_lasso_from_ratio(0.2),
    "with_group_lasso": lambda: pt.with_group_lasso(optax.sgd(1.0), penalty_ratio=0.2),
    "proximal": lambda: pt.with_group_lasso(
      optax.sgd(1.0), penalty_ratio=0.2, proximal=True, learning_rate=1.0
    ),
  }[form]()
  lasso = (lambda s: s) if form == "ratio" else (lambda s: s.group_lasso)
  gl0 = float(np.asarray(_loop_penalty(jax.tree.map(np.asarray, params), np), np.float64))
  expected = 0.2 * 2.5 / (0.8 * gl0)  # Eq. 3 with CE₀ = 2.5, the first finite loss
  for update in (jax.jit(tx.update), tx.update):
    state = tx.init(params)
    updates, state = update(grads, state, params, value=jnp.float32(bad))
    assert float(lasso(state).coefficient) == 0.0 and not bool(lasso(state).initialized)
    # no penalty yet: the zero gradient passes as zeros
    jax.tree.map(lambda u: np.testing.assert_array_equal(u, 0.0), updates)
    _, state = update(grads, state, params, value=jnp.float32(2.5))
    assert bool(lasso(state).initialized)
    assert float(lasso(state).coefficient) == pytest.approx(expected, rel=1e-5)
    _, state = update(grads, state, params, value=jnp.float32(bad))  # set: stays fixed
    assert float(lasso(state).coefficient) == pytest.approx(expected, rel=1e-5)


class _TinyNet(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 4, (3, 3), use_bias=False, rngs=rngs)
    self.conv = nnx.Conv(4, 4, (3, 3), use_bias=False, rngs=rngs)
    self.head = nnx.Linear(4, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(jax.nn.relu(self.conv(jax.nn.relu(self.stem(x)))).mean(axis=(1, 2)))


def test_with_group_lasso_in_nnx_optimizer():
  model = _TinyNet(nnx.Rngs(0))
  images = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  labels = jnp.arange(4) % 10

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()

  params0 = nnx.as_pure(nnx.state(model, nnx.Param))
  gl0 = float(jax.jit(gl.penalty)(params0))
  optimizer = nnx.Optimizer(
    model, pt.with_group_lasso(optax.sgd(0.1, momentum=0.9), penalty_ratio=0.25), wrt=nnx.Param
  )

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, value=loss)
    return loss, grads

  loss, grads = step(model, optimizer)
  lam = float(optimizer.opt_state.group_lasso.coefficient[...])
  assert lam * gl0 / (float(loss) + lam * gl0) == pytest.approx(0.25, rel=1e-5)
  # The momentum received grad + λ∇GL (SGD momentum's first trace is the update input).
  expected = jax.tree.map(
    lambda g, r: g + lam * r,
    nnx.as_pure(nnx.state(grads, nnx.Param)),
    jax.jit(jax.grad(gl.penalty))(params0),
  )
  trace = nnx.as_pure(optimizer.opt_state.inner[0].trace)
  jax.tree.map(lambda t, e: np.testing.assert_allclose(t, e, rtol=1e-4, atol=1e-6), trace, expected)


def _loop_shrink(p, threshold):
  """Group soft-thresholding, group by group in NumPy: output groups, then input groups."""
  layout = {
    ("stem", "conv"): (3, None),
    ("block", "conv"): (3, 2),
    ("block", "shortcut"): (3, 2),
    ("hidden",): (1, 0),
    ("out",): (None, 0),
  }
  out = jax.tree.map(lambda x: np.array(x, np.float64), p)
  for path, axes in layout.items():
    node = out
    for name in path:
      node = node[name]
    kernel = node["kernel"]
    for axis in axes:
      if axis is None:
        continue
      for c in range(kernel.shape[axis]):
        index = [slice(None)] * kernel.ndim
        index[axis] = c
        group = kernel[tuple(index)]
        norm = math.sqrt(float(np.sum(group**2)))
        kernel[tuple(index)] = group * (max(0.0, 1.0 - threshold / norm) if norm > 0 else 0.0)
  return out


def _group_norms(p):
  norms = []
  for path in [("block", "conv"), ("block", "shortcut"), ("hidden",)]:
    node = p
    for name in path:
      node = node[name]
    k = np.asarray(node["kernel"])
    norms.append(np.sqrt(np.sum(k**2, axis=tuple(range(k.ndim - 1)))))
  return np.concatenate(norms)


def test_group_shrink_matches_loop_reference():
  params = _params(5)
  # A threshold between the group norms: some groups die, the others shrink.
  threshold = float(np.median(_group_norms(params)))
  got = jax.jit(gl.group_shrink)(params, threshold)
  ref = _loop_shrink(params, threshold)
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6), got, ref)
  dead = (_group_norms(got) == 0.0).sum()
  assert 0 < dead < len(_group_norms(got))  # exact zeros, not just small
  # BatchNorm parameters and biases are untouched.
  np.testing.assert_array_equal(got["stem"]["bn"]["scale"], params["stem"]["bn"]["scale"])
  np.testing.assert_array_equal(got["hidden"]["bias"], params["hidden"]["bias"])
  # A zero group stays zero (no 0/0).
  again = gl.group_shrink(got, threshold)
  assert np.all(np.isfinite(again["block"]["conv"]["kernel"]))


def _sgd_first_step_then_shrink(params, grads, lr, lam):
  moved = jax.tree.map(lambda p, g: p - lr * g, params, grads)
  return _loop_shrink(moved, lr * lam)


def test_proximal_step_follows_the_inner_learning_rate():
  from jaxprune import train

  params = _params(6)
  grads = jax.tree.map(lambda x: 0.3 * jnp.cos(x), params)
  # Schedule 1.0 at step 0, 0.25 afterwards; the dynamic mini-batch's LR multiplier is 2.
  schedule = lambda step: jnp.where(step < 1, 1.0, 0.25)
  tx = pt.with_group_lasso(train.sgd(schedule, momentum=0.0), penalty_ratio=0.6, proximal=True)
  state = train.set_lr_scale(tx.init(params), 2.0)
  update = jax.jit(tx.update)
  updates, state = update(grads, state, params, value=1.7)
  lam = float(state.group_lasso.coefficient)
  gl0 = float(gl.penalty(params))
  assert lam * gl0 / (1.7 + lam * gl0) == pytest.approx(0.6, rel=1e-5)  # Eq. 3 unchanged
  new = optax.apply_updates(params, updates)
  ref = _sgd_first_step_then_shrink(params, grads, 2.0, lam)
  # Leaves without groups keep the inner update bit for bit.
  np.testing.assert_array_equal(updates["stem"]["bn"]["scale"], -2.0 * grads["stem"]["bn"]["scale"])
  np.testing.assert_array_equal(updates["hidden"]["bias"], -2.0 * grads["hidden"]["bias"])
  jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5), new, ref)
  # Second step: the schedule's 0.25 times the multiplier.
  updates2, state = update(grads, state, new, value=0.5)
  ref2 = _sgd_first_step_then_shrink(new, grads, 0.5, lam)
  jax.tree.map(
    lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5),
    optax.apply_updates(new, updates2),
    ref2,
  )
  # The same with an explicit learning_rate around a plain Optax SGD.
  tx = pt.with_group_lasso(optax.sgd(2.0), penalty_ratio=0.6, proximal=True, learning_rate=2.0)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params, value=1.7)
  jax.tree.map(
    lambda g, r: np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5),
    optax.apply_updates(params, updates),
    ref,
  )


def test_proximal_bad_arguments():
  params = _params()
  with pytest.raises(ValueError, match="learning_rate"):
    pt.with_group_lasso(optax.sgd(0.1), learning_rate=0.1)
  # Nothing to read the step size from: fails at init, naming the argument.
  with pytest.raises(ValueError, match="learning_rate"):
    pt.with_group_lasso(optax.sgd(0.1), proximal=True).init(params)


@pytest.mark.parametrize("coefficient", [float("inf"), float("nan"), True])
def test_add_group_lasso_rejects_non_finite_or_bool_coefficient(coefficient):
  with pytest.raises(ValueError, match="coefficient"):
    gl.add_group_lasso(coefficient)
