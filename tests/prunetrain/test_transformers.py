"""PruneTrain's reconfiguration on transformers: whole heads (multi-head, grouped-query, Flax's
``nnx.MultiHeadAttention``), MLP units (plain and SwiGLU), head_dim kept; the optimizer's state
sliced with them.

The references: the model before the surgery with the dead heads and units zeroed (the same
function), and a model built at the smaller width with the state sliced by hand in NumPy.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import prunetrain
from jaxprune.models.transformer import DecoderLM, ViT
from jaxprune.paths import param_path

_SHAPE = (1, 32, 32, 3)
_HD = 4


def _vit(**kw):
  base = dict(dim=16, depth=2, num_heads=4, head_dim=_HD, mlp_hidden=16, rngs=nnx.Rngs(0))
  return ViT(**{**base, **kw})


def _kill_query_heads(attn, heads):
  for h in heads:
    cols = slice(h * _HD, (h + 1) * _HD)
    attn.q.kernel[...] = attn.q.kernel[...].at[:, cols].set(0.0)
    attn.o.kernel[...] = attn.o.kernel[...].at[cols, :].set(0.0)


def _kill_kv_head(attn, h):
  cols = slice(h * _HD, (h + 1) * _HD)
  for lin in (attn.k, attn.v):
    lin.kernel[...] = lin.kernel[...].at[:, cols].set(0.0)


def _kill_units(mlp, units):
  for lin in (mlp.gate, mlp.up):
    if lin is not None:
      lin.kernel[...] = lin.kernel[...].at[:, units].set(0.0)
  mlp.down.kernel[...] = mlp.down.kernel[...].at[units, :].set(0.0)


def _relative(a, b):
  return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def _reconfigure_and_compare(model):
  x = jax.random.normal(jax.random.key(1), (3, 32, 32, 3))
  want = model(x)
  new, _, report = prunetrain.reconfigure(model, None, input_shape=_SHAPE)
  # the model has no dropout or BatchNorm: one mode
  assert _relative(new(x), want) <= 1e-5
  return new, report


def test_head_dim_is_kept_and_heads_and_units_are_the_groups():
  graph = prunetrain.channel_graph(_vit(num_kv_heads=2, gated=True), _SHAPE)
  kept = [
    g for g in graph.blocked if any(r.startswith("kept: a head's head_dim") for r in g.blocked)
  ]
  assert {(g.name, g.width) for g in kept} >= {
    ("blocks/0/attention/branch/k/kernel[1]", _HD),  # q and k's head_dim (contracted by q·kᵀ)
    ("blocks/0/attention/branch/o/kernel[0]", _HD),  # v's head_dim (carried to o)
  }
  prunable = {(g.name, g.width) for g in graph.prunable}
  assert (
    "blocks/0/attention/branch/k/kernel[1]",
    2,
  ) in prunable  # the kv heads: q, k, v and o together
  assert (
    "blocks/0/attention/branch/o/kernel[0]",
    2,
  ) in prunable  # the query heads of a group: q and o
  assert (
    "blocks/0/feed_forward/branch/down/kernel[0]",
    16,
  ) in prunable  # SwiGLU units: gate, up and down


def test_a_dead_head_and_dead_units_are_removed_exactly():
  model = _vit()
  attn = model.blocks[0].attn
  _kill_query_heads(attn, [1])
  _kill_kv_head(attn, 1)
  _kill_units(model.blocks[1].mlp, np.arange(4))
  new, report = _reconfigure_and_compare(model)
  a = new.blocks[0].attn
  assert a.q.kernel.shape == (16, 3 * _HD) and a.k.kernel.shape == (16, 3 * _HD)
  assert a.o.kernel.shape == (3 * _HD, 16)
  assert new.blocks[1].mlp.up.kernel.shape == (16, 12)
  assert new.blocks[1].attn.q.kernel.shape == (16, 4 * _HD)  # nothing dead there


def test_a_partly_dead_head_is_not_regrouped():
  model = _vit()
  _kill_query_heads(model.blocks[0].attn, [1])  # q and o dead, k and v of the head alive
  new, report = _reconfigure_and_compare(model)
  assert new.blocks[0].attn.q.kernel.shape == (16, 4 * _HD)


def test_a_dead_kv_head_goes_with_its_query_heads_and_swiglu_units():
  model = _vit(num_kv_heads=2, gated=True)
  attn = model.blocks[0].attn
  _kill_kv_head(attn, 1)
  _kill_query_heads(attn, [2, 3])  # kv head 1 serves query heads 2 and 3
  _kill_units(model.blocks[0].mlp, np.arange(5))
  new, _ = _reconfigure_and_compare(model)
  a, mlp = new.blocks[0].attn, new.blocks[0].mlp
  assert a.k.kernel.shape == (16, _HD) and a.q.kernel.shape == (16, 2 * _HD)
  assert mlp.gate.kernel.shape == mlp.up.kernel.shape == (16, 11)


def _lm(**kw):
  base = dict(context=12, dim=16, depth=2, num_heads=4, head_dim=_HD, mlp_hidden=16)
  return DecoderLM(**{**base, **kw}, rngs=nnx.Rngs(0))


def test_a_language_model_traced_from_token_ids_loses_its_dead_kv_head_and_units():
  # Before: the graph traced float inputs only, and the embedding's gather was unfollowed.
  model = _lm(num_kv_heads=2)
  graph = prunetrain.channel_graph(model, (1, 12), input_dtype=jnp.int32)
  assert graph.unfollowed() == {}  # the gather is followed
  stream = [g for g in graph.groups if any(u.name == "embed/embedding" for u in g.uses)]
  assert len(stream) == 1 and stream[0].blocked  # the residual stream, under RMSNorm
  assert any(r.startswith("normalized") for r in stream[0].blocked)
  attn, mlp = model.blocks[1].attn, model.blocks[1].mlp
  _kill_kv_head(attn, 0)
  _kill_query_heads(attn, [0, 1])
  _kill_units(mlp, np.arange(3, 9))
  tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, 256)
  want = model(tokens)
  new, _, report = prunetrain.reconfigure(model, None, input_shape=(1, 12), input_dtype=jnp.int32)
  assert _relative(new(tokens), want) <= 1e-5
  a = new.blocks[1].attn
  assert a.k.kernel.shape == a.v.kernel.shape == (16, _HD)
  assert a.q.kernel.shape == (16, 2 * _HD) and a.o.kernel.shape == (2 * _HD, 16)
  assert new.blocks[1].mlp.up.kernel.shape == (16, 10)
  # q and o lose two query heads, k and v one kv head, gate, up and down six units
  removed = 2 * (16 * 2 * _HD) + 2 * (16 * _HD) + 3 * (16 * 6)
  assert report.params_after == report.params_before - removed
  assert report.flops_after < report.flops_before


def test_a_float_trace_of_a_language_model_is_refused_by_name():
  with pytest.raises(ValueError, match="input_shape"):
    prunetrain.channel_graph(_lm(), (1, 12))
  with pytest.raises(ValueError, match="input_dtype"):
    prunetrain.channel_graph(_lm(), (1, 12), input_dtype="not a dtype")
  with pytest.raises(ValueError, match="input_dtype"):
    prunetrain.channel_graph(_lm(), (1, 12), input_dtype=bool)


def test_the_penalised_axes_of_a_language_model_are_its_heads_and_units():
  penalised = prunetrain.penalised_axes(_lm(), (1, 12), input_dtype=jnp.int32)
  paths = {"/".join(map(str, p)) for p in penalised.kernels}
  assert "blocks/0/attention/branch/q/kernel" in paths
  assert "blocks/1/feed_forward/branch/gate/kernel" in paths
  assert not any(p.startswith("embed") or p.startswith("head") for p in paths)


class _FlaxMHA(nnx.Module):
  """Patches, a pre-norm ``nnx.MultiHeadAttention`` (LinearGeneral kernels with a heads axis),
  mean-pooled logits."""

  def __init__(self, num_kv_heads=None, rngs=None):
    self.embed = nnx.Linear(48, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    kw = {} if num_kv_heads is None else {"num_kv_heads": num_kv_heads}
    self.attn = nnx.MultiHeadAttention(
      num_heads=4, in_features=16, qkv_features=16, decode=False, rngs=rngs, **kw
    )
    self.fc = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    n = x.shape[0]
    t = x.reshape(n, 8, 4, 8, 4, 3).transpose(0, 1, 3, 2, 4, 5).reshape(n, 64, 48)
    t = self.embed(t)
    return self.fc((t + self.attn(self.norm(t))).mean(1))


def test_flax_multi_head_attention_loses_a_dead_head():
  # Before: refused, "the sliced variables belong to LinearGeneral ...".
  model = _FlaxMHA(rngs=nnx.Rngs(0))
  attn = model.attn
  for lin in (attn.query, attn.key, attn.value):
    lin.kernel[...] = lin.kernel[...].at[:, 1].set(0.0)
    lin.bias[...] = lin.bias[...].at[1].set(0.0)
  attn.out.kernel[...] = attn.out.kernel[...].at[1].set(0.0)
  new, report = _reconfigure_and_compare(model)
  assert new.attn.query.kernel.shape == (16, 3, 4) and new.attn.out.kernel.shape == (3, 4, 16)
  assert new.attn.query.bias.shape == (3, 4)
  assert (new.attn.num_heads, new.attn.qkv_features, new.attn.head_dim) == (3, 12, 4)
  assert report.channels_removed["attn/query"] == 4  # one head of four positions


def test_flax_grouped_query_attention_loses_a_kv_head_with_its_queries():
  model = _FlaxMHA(num_kv_heads=2, rngs=nnx.Rngs(0))
  attn = model.attn
  for lin in (attn.key, attn.value):
    lin.kernel[...] = lin.kernel[...].at[:, 1].set(0.0)
    lin.bias[...] = lin.bias[...].at[1].set(0.0)
  # Flax groups the query heads as (kv head, group): kv head 1 serves query heads 2 and 3
  attn.query.kernel[...] = attn.query.kernel[...].at[:, 2:].set(0.0)
  attn.query.bias[...] = attn.query.bias[...].at[2:].set(0.0)
  attn.out.kernel[...] = attn.out.kernel[...].at[2:].set(0.0)
  new, _ = _reconfigure_and_compare(model)
  assert new.attn.key.kernel.shape == (16, 1, 4) and new.attn.query.kernel.shape == (16, 2, 4)
  assert (new.attn.num_heads, new.attn.num_kv_heads) == (2, 1)


def _loss(model, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def _step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(_loss)(model, x, y)
  optimizer.update(model, grads, value=loss)
  return loss


def test_adamw_state_is_sliced_with_the_heads_and_the_next_step_is_the_small_models():
  # Group lasso over heads and units (by structure) with AdamW: after a head and two units
  # die and are removed, the next step equals that of a ViT built at the smaller width whose
  # params and AdamW moments are the old ones sliced by hand.
  x = jax.random.normal(jax.random.key(2), (4, 32, 32, 3))
  y = jnp.arange(4) % 10
  model = _vit(depth=1)
  penalised = prunetrain.penalised_axes(model, _SHAPE)
  tx = prunetrain.with_group_lasso(optax.adamw(1e-2), penalty_ratio=0.2, penalised=penalised)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for _ in range(2):
    _step(model, optimizer, x, y)
  attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
  _kill_query_heads(attn, [2])
  _kill_kv_head(attn, 2)
  _kill_units(mlp, np.array([3, 7]))
  new_model, new_opt, _ = prunetrain.reconfigure(model, optimizer, input_shape=_SHAPE)
  penalised.bind(new_model)
  moments = jax.tree.map(np.asarray, (new_opt.opt_state.inner[0].mu, new_opt.opt_state.inner[0].nu))
  loss = _step(new_model, new_opt, x, y)

  # The reference: sliced by hand.
  heads = np.r_[0 : 2 * _HD, 3 * _HD : 4 * _HD]
  units = np.setdiff1d(np.arange(16), [3, 7])
  index = {
    ("blocks", 0, "attention", "branch", n, "kernel"): (slice(None), heads) for n in "qkv"
  } | {
    ("blocks", 0, "attention", "branch", "o", "kernel"): (heads, slice(None)),
    ("blocks", 0, "feed_forward", "branch", "up", "kernel"): (slice(None), units),
    ("blocks", 0, "feed_forward", "branch", "down", "kernel"): (units, slice(None)),
  }

  def cut(tree):
    def one(path, leaf):
      names = param_path(path)
      return leaf[index[names]] if names in index else leaf

    return jax.tree_util.tree_map_with_path(one, tree)

  small = _vit(depth=1, num_heads=3, mlp_hidden=14)
  old_params = nnx.state(model, nnx.Param)
  nnx.update(small, cut(old_params))
  small_penalised = prunetrain.penalised_axes(small, _SHAPE)
  small_tx = prunetrain.with_group_lasso(
    optax.adamw(1e-2), penalty_ratio=0.2, penalised=small_penalised
  )
  small_opt = nnx.Optimizer(small, small_tx, wrt=nnx.Param)
  old_state = optimizer.opt_state
  inner = old_state.inner
  adam = inner[0]
  small_state = small_opt.opt_state
  small_adam = small_state.inner[0]._replace(count=adam.count, mu=cut(adam.mu), nu=cut(adam.nu))
  small_opt.opt_state = small_state._replace(
    group_lasso=old_state.group_lasso, inner=(small_adam, *small_state.inner[1:])
  )
  # the reconfigured optimizer's moments are the hand-sliced ones
  for got, want in zip(moments, (small_adam.mu, small_adam.nu)):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  loss_s = _step(small, small_opt, x, y)
  np.testing.assert_allclose(float(loss), float(loss_s), rtol=1e-6)
  for a, b in zip(
    jax.tree.leaves(nnx.state(new_model, nnx.Param)), jax.tree.leaves(nnx.state(small, nnx.Param))
  ):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("heads, kv", [(3, 2)])
def test_heads_that_the_kv_heads_do_not_divide_are_refused_by_name(heads, kv):
  with pytest.raises(ValueError, match=r"num_kv_heads \(2\) must divide num_heads \(3\)"):
    _vit(num_heads=heads, num_kv_heads=kv)


def test_a_block_whose_heads_and_units_all_died_loses_both_branches():
  model = _vit()
  _kill_query_heads(model.blocks[0].attn, range(4))
  for h in range(4):
    _kill_kv_head(model.blocks[0].attn, h)
  _kill_units(model.blocks[0].mlp, np.arange(16))
  new, report = _reconfigure_and_compare(model)
  assert report.removed_branches == ["blocks/0/attention", "blocks/0/feed_forward"]
  assert new.blocks[0].attn is None and new.blocks[0].mlp is None
  assert new.blocks[1].attn.q.kernel.shape == (16, 4 * _HD)  # the other block untouched


_RESUME_RUN = '''
import sys
import numpy as np
from flax import nnx
from jaxprune import data, methods, train
from jaxprune.models.transformer import DecoderLM, ViT

def dead_head_vit():
  model = ViT(dim=16, depth=1, num_heads=4, head_dim=4, mlp_hidden=16, patch=4, image_size=8,
              in_channels=1, num_classes=4, rngs=nnx.Rngs(0))
  attn, mlp = model.blocks[0].attn, model.blocks[0].mlp
  for lin in (attn.q, attn.k, attn.v):  # head 1 dead everywhere: it stays dead under SGD
    lin.kernel[...] = lin.kernel[...].at[:, 4:8].set(0.0)
  attn.o.kernel[...] = attn.o.kernel[...].at[4:8, :].set(0.0)
  mlp.up.kernel[...] = mlp.up.kernel[...].at[:, :4].set(0.0)
  mlp.down.kernel[...] = mlp.down.kernel[...].at[:4, :].set(0.0)
  return model

def run(directory, epochs):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (32, 8, 8, 1), dtype=np.uint8)
  labels = rng.integers(0, 4, 32).astype(np.int32)
  loader = data.Loader(data.Dataset.from_arrays(images, labels, num_classes=4), 16, shuffle=True,
                       seed=0, drop_last=True)
  method = methods.compose(
    methods.get("sdgp", n=2, m=4, method="magnitude", layers=("conv", "linear")),
    methods.get("prunetrain", every_epochs=1, dynamic_batch=False),
  )
  run = methods.Run.from_loader(loader, epochs=2)
  model = method.convert(dead_head_vit())
  trainer = train.Trainer(model, method.make_tx(train.sgd(0.05, momentum=0.9), run),
                          callbacks=method.callbacks(run), progress=False, checkpoint_dir=directory)
  history = trainer.fit(loader, None, epochs=epochs)
  trainer.close()
  return trainer, history

if __name__ == "__main__":
  trainer, _ = run(sys.argv[1], 2)
  leaves = [np.asarray(v) for _, v in sorted(nnx.to_flat_state(nnx.state(trainer.model, nnx.Param)))]
  np.savez(sys.argv[2], *leaves)
'''


def test_a_head_removal_resumes_bit_exact_in_a_new_process_under_sdgp(tmp_path, cpu_env):
  # SDGP (its Linear layers) composed with PruneTrain on a ViT: epoch 1 removes the dead head
  # and units; a new process resumes the checkpoint after it and ends where the whole run ends.
  import importlib.util
  import subprocess
  import sys

  script = tmp_path / "resume_run.py"
  script.write_text(_RESUME_RUN)
  spec = importlib.util.spec_from_file_location("resume_run", script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  whole, history = module.run(tmp_path / "whole", 2)
  assert history[0]["pt_reconfigured"] and history[0]["pt_channels_removed"] > 0
  attn = whole.model.blocks[0].attn
  assert attn.q.kernel.shape == (16, 12) and type(attn.q).__name__ == "SDGPLinear"
  part, _ = module.run(tmp_path / "part", 1)
  out = tmp_path / "resumed.npz"
  proc = subprocess.run(
    [sys.executable, str(script), str(tmp_path / "part"), str(out)],
    capture_output=True,
    text=True,
    env=cpu_env(),
    timeout=300,
    check=False,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  resumed = np.load(out)
  want = [np.asarray(v) for _, v in sorted(nnx.to_flat_state(nnx.state(whole.model, nnx.Param)))]
  assert len(resumed.files) == len(want)
  for i, w in enumerate(want):
    np.testing.assert_array_equal(resumed[f"arr_{i}"], w)


def test_the_callback_traces_token_ids_and_refuses_the_float_batch_probe():
  from jaxprune.prunetrain.callback import _check_reconfigurable

  with pytest.raises(ValueError, match="dynamic_batch"):
    prunetrain.PruneTrainCallback(image_shape=(12,), input_dtype=jnp.int32)
  callback = prunetrain.PruneTrainCallback(
    image_shape=(12,), input_dtype=jnp.int32, dynamic_batch=False
  )
  model = _lm()
  graph = _check_reconfigurable(model, (12,), True, callback.input_dtype)
  assert graph.input_dtype == jnp.int32
  costs = prunetrain.model_costs(model, (12,), input_dtype=jnp.int32)
  assert costs["params"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  # the head alone: 12 tokens x 16 features x 256 outputs, one multiply-add each
  assert costs["inference_flops"] > 2 * 12 * 16 * 256
