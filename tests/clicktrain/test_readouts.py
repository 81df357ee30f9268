"""ClickTrain read-outs find the ClickTrainState wherever it sits in an optimizer state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import prunetrain
from jaxprune.clicktrain import readouts
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


def _params():
  rng = np.random.default_rng(0)
  return {
    "stem": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 3, 6)), jnp.float32)},
    "conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 6, 8)), jnp.float32)},
  }


def _tx():
  return ct.clicktrain(
    optax.identity(),
    steps_per_epoch=1,
    hard_prune_epoch=1,
    mode="one_shot",
    one_shot_epoch=0,
    kernel_prune_ratio=0.5,
  )


@functools.cache
def _state():
  """A ClickTrain state with final one-shot masks (after one step)."""
  p = _params()
  tx = _tx()
  g = jax.tree.map(lambda x: x * 0.1 + 0.01, p)
  _, st = jax.jit(tx.update)(g, tx.init(p), p)
  return st


def _all_readouts(opt_state, params):
  return {
    "stage": readouts.stage_name(opt_state),
    "masks": readouts.masks(opt_state, params),
    "kernels": readouts.kernel_masks(opt_state),
    "ids": readouts.pattern_ids(opt_state),
    "usage": readouts.pattern_usage(opt_state),
    "compression": readouts.compression(opt_state, params),
    "planned_compression": readouts.planned_compression(opt_state, params),
    "penalty": readouts.group_lasso_penalty(params, opt_state),
  }


def _assert_same(a, b):
  assert a["stage"] == b["stage"] and a["compression"] == b["compression"]
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_readouts_on_the_bare_state_match_the_state_fields():
  st, p = _state(), _params()
  out = _all_readouts(st, p)
  assert out["stage"] == "pruned"  # one-step epochs: masks at step 0, pruned from step 1
  ls = st.layers["conv/kernel"]
  expect = np.asarray(ls.pattern_mask) * np.asarray(ls.kernel_keep)
  np.testing.assert_array_equal(out["masks"]["conv"]["kernel"], expect)
  assert out["masks"]["stem"]["kernel"] is None
  assert (~out["kernels"]["conv/kernel"]).sum() == 24  # half of 6 x 8
  # The masks plan 4 of 9 weights per kept kernel, half the kernels kept ...
  total = 3 * 3 * 3 * 6 + 9 * 48
  assert out["planned_compression"] == pytest.approx(total / (3 * 3 * 3 * 6 + 4 * 24))
  # ... while these weights (the unpruned ones) are all there.
  assert out["compression"] == 1.0


@pytest.mark.parametrize("where", ["chain", "nested_chain", "with_group_lasso"])
def test_readouts_find_the_state_inside_chains_and_wrappers(where):
  st, p = _state(), _params()
  if where == "chain":
    wrapped = (optax.EmptyState(), st, optax.ScaleByAdamState(jnp.zeros([], jnp.int32), {}, {}))
  elif where == "nested_chain":
    wrapped = ((optax.EmptyState(), (st,)), optax.EmptyState())
  else:  # PruneTrainState(group_lasso, inner, count) around clicktrain
    gl = prunetrain.with_group_lasso(_tx())
    wrapped = gl.init(p)
    assert type(wrapped).__name__ == "PruneTrainState"
    wrapped = wrapped._replace(inner=st)
  _assert_same(_all_readouts(wrapped, p), _all_readouts(st, p))


class _Net(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 6, (3, 3), use_bias=False, rngs=rngs)
    self.conv = nnx.Conv(6, 8, (3, 3), use_bias=False, rngs=rngs)

  def __call__(self, x):
    return self.conv(nnx.relu(self.stem(x))).mean()


def test_readouts_find_the_state_in_an_nnx_optimizer():
  model = _Net(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.chain(_tx(), optax.scale(1.0)), wrt=nnx.Param)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 5, 5, 3)), jnp.float32)

  @nnx.jit
  def step(model, optimizer, x):
    optimizer.update(model, nnx.grad(lambda m: m(x))(model))

  step(model, optimizer, x)
  params = nnx.state(model, nnx.Param)
  bare = nnx.as_pure(optimizer.opt_state)[0]  # the ClickTrainState, by hand
  assert isinstance(bare, ct_state.ClickTrainState)
  expect = _all_readouts(bare, nnx.as_pure(params))
  assert expect["stage"] == "pruned"
  _assert_same(_all_readouts(optimizer.opt_state, params), expect)  # NNX Variables
  _assert_same(_all_readouts(optimizer, params), expect)  # the optimizer itself


def test_readouts_raise_on_no_or_two_states():
  st, p = _state(), _params()
  with pytest.raises(ValueError, match="opt_state: no ClickTrainState"):
    readouts.masks(optax.sgd(0.1).init(p), p)
  with pytest.raises(ValueError, match="opt_state: no ClickTrainState"):
    readouts.stage_name(optax.EmptyState())
  with pytest.raises(ValueError, match="opt_state: 2 ClickTrainStates"):
    readouts.stage_name((st, st))
  with pytest.raises(ValueError, match="opt_state: 2 ClickTrainStates"):
    readouts.pattern_usage((st, (optax.EmptyState(), st)))


def test_stage_enum_and_module_names():
  assert list(ct_state.Stage) == [
    ct_state.WARMUP,
    ct_state.POOL,
    ct_state.FINALIZE,
    ct_state.REGULARIZE,
    ct_state.PRUNED,
  ]
  assert [int(s) for s in ct_state.Stage] == [0, 1, 2, 3, 4]
  assert (
    ct_state.STAGE_NAMES[ct_state.PRUNED] == "pruned"
    and ct_state.STAGE_NAMES[ct_state.Stage.POOL] == "pool"
  )
