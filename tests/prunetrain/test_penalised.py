"""The group lasso's penalised leaves decided by structure (the traced graph), not by shape.

The references are NumPy sums over the groups written out by hand for each model, and the shape
rule itself on the papers' CNNs, where it is right.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import methods, models, prunetrain, train
from jaxprune.models.transformer import ViT
from jaxprune.paths import flatten_with_paths

EPS = prunetrain.EPSILON
_IMAGE = (1, 32, 32, 3)


def _params(model):
  return nnx.state(model, nnx.Param)


def _np(tree):
  return {path: np.asarray(v, np.float64) for path, v in flatten_with_paths(tree)}


def _group_norms(w, axis):
  other = tuple(a for a in range(w.ndim) if a != axis)
  return np.sqrt(np.sum(w**2, axis=other) + EPS)


@pytest.mark.parametrize(
  "name, width", [("prunetrain-resnet20", 0.25), ("prunetrain-vgg11", 0.125)]
)
def test_on_the_papers_cnns_the_structure_is_the_shape_rule(name, width):
  # PruneTrain's own networks: the shape rule holds there, so the graph must agree exactly.
  model = models.create(name, num_classes=10, width_multiplier=width, rngs=nnx.Rngs(0))
  params = _params(model)
  penalised = prunetrain.penalised_axes(model)

  @jax.jit
  def both(p):  # compiled once: the layouts are static, read when traced
    return [
      (fn(p), fn(p, penalised=penalised))
      for fn in (
        prunetrain.penalty,
        prunetrain.penalty_gradient,
        lambda q, **kw: prunetrain.group_shrink(q, 0.05, **kw),
      )
    ]

  (value, value_graph), *pairs = both(params)
  assert value == value_graph
  for by_shape, by_graph in pairs:
    for a, b in zip(jax.tree.leaves(by_shape), jax.tree.leaves(by_graph)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resnet9_stem_is_found_by_structure_where_the_names_miss_it():
  # SDGP's ResNet-9 calls its stem `prep`; the name rule falls back to the first conv in
  # flatten order, `layer1`, and so penalises the image's channels and not layer1's inputs.
  model = models.create("sdgp-resnet9", num_classes=10, width_multiplier=0.125, rngs=nnx.Rngs(0))
  params = _params(model)
  by_shape = prunetrain.leaf_groups(params)
  assert by_shape["layer1"]["conv"]["kernel"].input_axis is None
  penalised = prunetrain.penalised_axes(model)
  w = _np(params)
  expected = 0.0
  for path, value in w.items():
    if value.ndim == 4:
      expected += _group_norms(value, 3).sum()
      if path[0] != "prep":
        expected += _group_norms(value, 2).sum()
    elif value.ndim == 2:  # the head: input columns only, never the logits
      expected += _group_norms(value, 0).sum()
  got = float(prunetrain.penalty(params, penalised=penalised))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert [f.axis for f in penalised.of(("prep", "conv", "kernel")).families] == [3]


def _vit(**kw):
  return ViT(dim=16, depth=1, num_heads=2, head_dim=4, mlp_hidden=8, rngs=nnx.Rngs(0), **kw)


def test_vit_default_rule_is_refused_by_name():
  model = _vit()
  tx = prunetrain.with_group_lasso(optax.adamw(1e-3))
  with pytest.raises(ValueError, match=r"penalised: .*pos_embedding \(not a kernel\)"):
    tx.init(_params(model))


def test_vit_penalises_heads_and_units_never_head_dim_the_stream_logits_or_embeddings():
  model = _vit()
  params = _params(model)
  penalised = prunetrain.penalised_axes(model, _IMAGE)
  attn, mlp = ("blocks", 0, "attention", "branch"), ("blocks", 0, "feed_forward", "branch")
  kernels = {path for path in penalised.kernels}
  assert kernels == {attn + (n, "kernel") for n in "qkvo"} | {
    mlp + (n, "kernel") for n in ("up", "down")
  }
  # The residual stream meets LayerNorm: blocked, so the patch embedding and the classifier
  # (input: the stream; output: the logits) carry no penalised group.
  w = _np(params)
  heads, hd = 2, 4
  q, k, v, o = (w[attn + (n, "kernel")] for n in "qkvo")
  expected = 0.0
  for h in range(heads):  # a head: its head_dim columns of q, k, v and rows of o
    cols = slice(h * hd, (h + 1) * hd)
    for m in (q, k, v):
      expected += np.sqrt(np.sum(m[:, cols] ** 2) + EPS)
    expected += np.sqrt(np.sum(o[cols, :] ** 2) + EPS)
  # head_dim is kept whole (RoPE pairs, the softmax scale): no group of its own
  expected += _group_norms(w[mlp + ("up", "kernel")], 1).sum()
  expected += _group_norms(w[mlp + ("down", "kernel")], 0).sum()
  got = float(prunetrain.penalty(params, penalised=penalised))
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  # the written-out gradient is the penalty's autodiff, flattened families included
  auto = jax.grad(lambda p: prunetrain.penalty(p, penalised=penalised))(params)
  for a, b in zip(
    jax.tree.leaves(auto), jax.tree.leaves(prunetrain.penalty_gradient(params, penalised=penalised))
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_vit_shrink_zeroes_a_weak_head_whole_and_leaves_unpenalised_leaves_alone():
  model = _vit()
  q = model.blocks[0].attn.q.kernel
  q[...] = q[...].at[:, 4:].multiply(1e-3)  # head 1 of q, tiny
  params = _params(model)
  penalised = prunetrain.penalised_axes(model, _IMAGE)
  shrunk = prunetrain.group_shrink(params, 0.01, penalised=penalised)
  q_new = np.asarray(shrunk["blocks"][0]["attention"]["branch"]["q"]["kernel"])
  assert np.all(q_new[:, 4:] == 0.0) and np.all(q_new[:, :4] != 0.0)
  for key in ("pos_embedding",):
    np.testing.assert_array_equal(np.asarray(shrunk[key]), np.asarray(params[key]))
  np.testing.assert_array_equal(
    np.asarray(shrunk["head"]["kernel"]), np.asarray(params["head"]["kernel"])
  )


def test_unbound_and_stale_layouts_are_refused_by_name():
  model = _vit()
  params = _params(model)
  # unbound (a loop without the callback): the shape rule, as without it
  cnn = models.create("prunetrain-vgg11", num_classes=10, width_multiplier=0.125, rngs=nnx.Rngs(0))
  assert prunetrain.penalty(_params(cnn), penalised=prunetrain.PenalisedAxes()) == (
    prunetrain.penalty(_params(cnn))
  )
  penalised = prunetrain.penalised_axes(model, _IMAGE)
  narrower = ViT(dim=16, depth=1, num_heads=1, head_dim=4, mlp_hidden=8, rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError, match=r"penalised: blocks/0/attention/branch/./kernel has 4 positions .* had 8; bind it again"
  ):
    prunetrain.penalty(_params(narrower), penalised=penalised)
  with pytest.raises(ValueError, match="either penalised or"):
    prunetrain.leaf_groups(params, penalised=penalised, is_classifier=lambda *a: False)


def test_prunetrain_method_binds_the_graph_layout_for_the_trainer(digits_loader):
  # The registry's PruneTrain takes the layout by structure: a ViT trains under the Trainer
  # (the shape rule would have refused it at init), and λ comes from the graph's penalty.
  model = ViT(
    dim=8,
    depth=1,
    num_heads=2,
    head_dim=2,
    mlp_hidden=8,
    patch=4,
    image_size=8,
    in_channels=1,
    num_classes=4,
    rngs=nnx.Rngs(0),
  )
  loader = digits_loader(n=32, batch_size=16)
  method = methods.get("prunetrain", every_epochs=1, dynamic_batch=False)
  run = methods.Run.from_loader(loader, epochs=1)
  trainer = train.Trainer(
    model, method.make_tx(train.sgd(0.05), run), callbacks=method.callbacks(run), progress=False
  )
  (images, labels) = next(iter(loader))
  loss0 = float(train.cross_entropy(model(jnp.asarray(images)), jnp.asarray(labels)))
  penalty0 = float(
    prunetrain.penalty(_params(model), penalised=prunetrain.penalised_axes(model, (1, 8, 8, 1)))
  )
  trainer.fit(loader, None, epochs=1)
  state = next(
    s
    for s in jax.tree.leaves(
      trainer.opt_state, is_leaf=lambda s: isinstance(s, prunetrain.PruneTrainState)
    )
    if isinstance(s, prunetrain.PruneTrainState)
  )
  expected = 0.2 * loss0 / (0.8 * penalty0)
  np.testing.assert_allclose(float(state.group_lasso.coefficient), expected, rtol=1e-4)
