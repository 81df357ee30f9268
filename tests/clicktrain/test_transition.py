"""The transition into the pruned structure, beyond the paper: the group lasso's ramp over the
regularize stage and the soft prune's window, against hand-computed schedules."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune import clicktrain as ct

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)

SPE, PICK, PRUNE = 2, 1, 5  # steps per epoch, one-shot pick epoch, hard prune epoch


def _params():
  w = jax.random.normal(jax.random.key(0), (3, 3, 8, 8))
  return {"conv": {"kernel": w}}


def _grads(scale=1.0):
  return {"conv": {"kernel": scale * jnp.ones((3, 3, 8, 8))}}


def _tx(inner, **kw):
  return ct.clicktrain(
    inner,
    steps_per_epoch=SPE,
    hard_prune_epoch=PRUNE,
    mode="one_shot",
    one_shot_epoch=PICK,
    kernel_prune_ratio=0.5,
    **kw,
  )


def _updates(tx, steps, params=None, apply=False):
  """The updates of ``steps`` steps on fixed gradients (params fixed unless ``apply``)."""
  params = _params() if params is None else params
  state, out, states = tx.init(params), [], []
  update = jax.jit(tx.update)
  for _ in range(steps):
    u, state = update(_grads(), state, params)
    out.append(u["conv"]["kernel"])
    states.append(state)
    if apply:
      params = optax.apply_updates(params, u)
  return out, states, params


@pytest.mark.parametrize("ramp", ["linear", "cubic"])
def test_group_lasso_ramp_scales_the_penalty_by_the_share_of_the_stage_done(ramp):
  """Identity inner optimizer and fixed params: the regularizing update is the gradient plus
  λ·ramp(t)·∂(group lasso); against the constant (paper) coefficient, the penalty part is
  scaled by ramp(t), t = (position − start) / (hard prune − start) after each step."""
  steps = PRUNE * SPE - 1  # up to the last regularized step
  held, _, _ = _updates(_tx(optax.identity()), steps)
  ramped, _, _ = _updates(_tx(optax.identity(), group_lasso_ramp=ramp), steps)
  g = np.ones((3, 3, 8, 8))
  for k in range(PICK * SPE, steps):  # the pick step and after: regularizing
    t = ((k + 1) / SPE - PICK) / (PRUNE - PICK)
    factor = t if ramp == "linear" else 1 - (1 - t) ** 3
    penalty_held = np.asarray(held[k]) - g
    np.testing.assert_allclose(np.asarray(ramped[k]) - g, factor * penalty_held, atol=1e-6)
    assert np.abs(penalty_held).max() > 0
  # Before the pick: no penalty either way.
  np.testing.assert_array_equal(held[0], ramped[0])


def test_soft_prune_decays_the_dropped_weights_linearly_to_zero_at_the_prune():
  """With a window of 2 epochs and a learning rate of 0, a dropped weight is its start value
  times max(0, min(1, (5 − epochs) / 2)) after each step, and exactly 0 from the prune on;
  kept weights do not move."""
  window = 2
  tx = _tx(optax.sgd(0.0), prune_window_epochs=window)
  w0 = np.asarray(_params()["conv"]["kernel"])
  params, state = _params(), None
  update = jax.jit(tx.update)
  state = tx.init(params)
  for k in range(PRUNE * SPE + 2):
    u, state = update(_grads(), state, params)
    params = optax.apply_updates(params, u)
    w = np.asarray(params["conv"]["kernel"])
    if k < PICK * SPE:
      np.testing.assert_array_equal(w, w0)
      continue
    mask = (
      np.asarray(ct.find_state(state).layers["conv/kernel"].pattern_mask)
      * np.asarray(ct.find_state(state).layers["conv/kernel"].kernel_keep)[None, None]
    )
    left = float(np.clip((PRUNE - (k + 1) / SPE) / window, 0, 1))
    np.testing.assert_array_equal(w[mask != 0], w0[mask != 0])
    np.testing.assert_allclose(w[mask == 0], left * w0[mask == 0], rtol=1e-5, atol=1e-6)
    if k + 1 >= PRUNE * SPE:
      assert np.all(w[mask == 0] == 0) and ct.stage_name(state) == "pruned"
    else:
      assert ct.stage_name(state) == "regularize"


def test_soft_prune_picks_the_masks_again_in_its_window():
  """A kernel made important by the gradients inside the window is kept by the next pick at a
  window epoch end, and stops decaying; the paper's one-step prune never picks again."""
  params = _params()
  tx = _tx(optax.sgd(0.0), prune_window_epochs=2)
  state, update = tx.init(params), jax.jit(tx.update)
  masks = []
  for k in range(PRUNE * SPE):
    g = _grads()
    if k >= (PRUNE - 2) * SPE:  # inside the window: input channel 0's kernels matter most
      g = {"conv": {"kernel": g["conv"]["kernel"].at[:, :, 0, :].set(1e3)}}
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
    masks.append(np.asarray(ct.find_state(state).layers["conv/kernel"].kernel_keep))
  picked, last = masks[PICK * SPE], masks[-1]
  assert not picked[0].all() and last[0].all()  # channel 0 was partly dropped, then kept
  w = np.asarray(params["conv"]["kernel"])
  assert np.all(w[:, :, 0, :].any(axis=(0, 1)))  # its kernels kept a non-zero weight
  # Without a window the masks stay those of the pick.
  held, states, _ = _updates(_tx(optax.sgd(0.0)), PRUNE * SPE)
  del held
  keep = [np.asarray(s.layers["conv/kernel"].kernel_keep) for s in map(ct.find_state, states)]
  assert all((k == keep[PICK * SPE]).all() for k in keep[PICK * SPE :])


def test_transition_options_are_checked_when_built():
  with pytest.raises(ValueError, match="group_lasso_ramp must be one of"):
    _tx(optax.sgd(0.1), group_lasso_ramp="quadratic")
  with pytest.raises(
    ValueError, match=r"prune_window_epochs \(5\) must fit between one_shot_epoch"
  ):
    _tx(optax.sgd(0.1), prune_window_epochs=5)
  with pytest.raises(ValueError, match="prune_window_epochs must be an int >= 0"):
    _tx(optax.sgd(0.1), prune_window_epochs=-1)
