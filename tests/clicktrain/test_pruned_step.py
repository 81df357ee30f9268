"""The update specialised to the pruned stage (``specialize_pruned``): the general step's results
(to the last bit of a float's rounding), without the stage machine."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune import clicktrain
from jaxprune.clicktrain import transform as ct

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


def _inner():
  return optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.05, momentum=0.9))


def _pruned(kit, mode):
  """A transform and its state just after the hard prune, on the toy params (trained)."""
  if mode == "paper":
    tx = kit.pruning_tx(_inner())
  else:  # the aligned mode on the released rule
    tx = ct.clicktrain(
      _inner(),
      steps_per_epoch=1,
      hard_prune_epoch=2,
      mode="one_shot",
      one_shot_epoch=0,
      kernel_prune_ratio=0.5,
      filter_groups=2,
    )
  p = kit.params()
  st = tx.init(p)
  step = kit.train_step(tx)
  for i in range(20):
    p, st = step(p, st, *kit.batch(i))
    if clicktrain.stage_name(st) == "pruned":
      return tx, p, st
  raise AssertionError("no hard prune")


def _grads(kit, p, i, nan_at=None):
  g = jax.grad(kit.loss)(p, *kit.batch(50 + i))
  if nan_at is not None:  # a NaN at one position of conv1's gradient
    g["block"]["conv1"]["kernel"] = g["block"]["conv1"]["kernel"].at[nan_at].set(jnp.nan)
  return g


@pytest.mark.parametrize("mode", ["paper", "aligned"])
def test_specialised_update_is_the_general_update_without_the_stage_machine(kit, mode):
  tx, p, st = _pruned(kit, mode)
  marked = clicktrain.specialize_pruned(st)
  assert clicktrain.is_specialized(marked) and not clicktrain.is_specialized(st)
  # The same arrays (what a checkpoint stores); only the static mark differs.
  assert jax.tree_util.tree_structure(marked) != jax.tree_util.tree_structure(st)
  for a, b in zip(jax.tree.leaves(st), jax.tree.leaves(marked)):
    assert a is b

  mask = np.asarray(clicktrain.masks(st, p)["block"]["conv1"]["kernel"])
  pruned_at = tuple(int(i[0]) for i in np.nonzero(mask == 0))
  kept_at = tuple(int(i[0]) for i in np.nonzero(mask == 1))
  update = jax.jit(tx.update)
  general, special = (p, st), (p, marked)
  for i, nan_at in enumerate([None, pruned_at, None, kept_at]):
    outs = []
    for params, state in (general, special):
      u, state = update(_grads(kit, params, i, nan_at), state, params, value=jnp.float32(1.0))
      outs.append((u, optax.apply_updates(params, u), state))
    (u_g, p_g, s_g), (u_s, p_s, s_s) = outs
    # The same operations; XLA fuses the two programs apart, so a float may differ in its last
    # bit (an FMA here, not there). Zeros, NaNs, ints and the masks agree exactly.
    for a, b in zip(jax.tree.leaves((u_g, p_g, s_g)), jax.tree.leaves((u_s, p_s, s_s))):
      a, b = np.asarray(a), np.asarray(b)
      if np.issubdtype(a.dtype, np.floating):
        np.testing.assert_array_equal(a == 0, b == 0)
        scale = np.nanmax(np.abs(a), initial=0.0)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale)
      else:
        np.testing.assert_array_equal(a, b)
    assert clicktrain.is_specialized(s_s)  # the mark stays with the state
    general, special = (p_g, s_g), (p_s, s_s)
  # Pruned weights stay exactly zero through the specialised steps (the kept NaN aside).
  w = np.asarray(special[0]["block"]["conv1"]["kernel"])
  assert np.all(w[mask == 0] == 0.0)

  # The specialised trace holds no lax.cond / lax.switch: the stage machine is gone.
  def conds(state):
    g = _grads(kit, p, 0)
    return len(re.findall(r"\bcond\[", str(jax.make_jaxpr(tx.update)(g, state, p, value=1.0))))

  assert conds(st) > 0 and conds(marked) == 0


def test_specialize_pruned_refuses_a_state_before_the_prune_or_none(kit):
  tx = kit.paper_tx()
  st = tx.init(kit.params())
  with pytest.raises(ValueError, match="'pool', not 'pruned'"):
    clicktrain.specialize_pruned(st)
  with pytest.raises(ValueError, match="no ClickTrainState"):
    clicktrain.specialize_pruned(optax.sgd(0.1).init(kit.params()))
  assert not clicktrain.is_specialized(optax.sgd(0.1).init(kit.params()))


def test_an_nnx_optimizer_takes_the_specialised_state(one_shot_clicktrain):
  # The usual NNX loop: assign the marked state to the optimizer; the jitted step retraces,
  # keeps the mark and keeps the pruned weights at zero.
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
      self.c2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
      self.fc = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
      return self.fc(jax.nn.relu(self.c2(jax.nn.relu(self.c1(x)))).mean((1, 2)))

  model = Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, one_shot_clicktrain(), wrt=nnx.Param)
  x, y = jnp.ones((4, 6, 6, 3)), jnp.arange(4) % 3

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, value=loss)

  for _ in range(2):
    step(model, optimizer)
  assert clicktrain.stage_name(optimizer) == "pruned"
  optimizer.opt_state = clicktrain.specialize_pruned(optimizer.opt_state)
  before = np.asarray(model.c2.kernel[...])
  for _ in range(2):
    step(model, optimizer)
  assert clicktrain.is_specialized(optimizer.opt_state)
  after = np.asarray(model.c2.kernel[...])
  mask = np.asarray(clicktrain.masks(optimizer, nnx.state(model, nnx.Param))["c2"]["kernel"])
  assert np.all(after[mask == 0] == 0) and np.any(after[mask == 1] != before[mask == 1])
