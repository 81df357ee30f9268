"""ClickTrain first in an ``optax.chain`` (issue 61, item 4): the transform after it re-fills the
pruned weights, and ClickTrain says so at the next step; wrapping the optimizer keeps them zero."""

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain


def _one_shot(inner):
  # Masks from the first batch, hard prune at the end of epoch 1 (step 4 of 2-step epochs).
  return clicktrain.clicktrain(
    inner,
    steps_per_epoch=2,
    hard_prune_epoch=1,
    mode="one_shot",
    one_shot_epoch=0,
    kernel_prune_ratio=0.5,
  )


def _train(model, tx, steps=7):
  """A hand-written NNX loop (nnx.Optimizer, the loss passed as ``value``)."""
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  rng = np.random.default_rng(0)

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, value=loss)
    return loss

  for _ in range(steps):
    x = jnp.asarray(rng.normal(size=(8, 6, 6, 1)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 4, 8), jnp.int32)
    step(model, optimizer, x, y)
  params = nnx.state(model, nnx.Param)
  assert clicktrain.stage_name(optimizer.opt_state) == "pruned"
  masks = clicktrain.masks(optimizer.opt_state, params)
  return params, masks


def _pruned_nonzero(params, masks):
  kernel = np.asarray(params["conv1"]["kernel"])
  return int(np.count_nonzero(kernel[np.asarray(masks["conv1"]["kernel"]) == 0]))


def test_clicktrain_first_in_a_chain_warns_by_name(tiny_cnn):
  tx = optax.chain(_one_shot(optax.identity()), optax.adamw(1e-2, weight_decay=1e-2))
  with pytest.warns(RuntimeWarning, match=r"pruned weights are non-zero after the hard prune") as w:
    params, masks = _train(tiny_cnn(), tx)
  assert _pruned_nonzero(params, masks) > 0  # the warning is right
  message = str(next(x.message for x in w if "hard prune" in str(x.message)))
  assert "first in 'conv1/kernel'" in message  # the layer, named
  assert "clicktrain(optax.adamw(...))" in message and "masking.mask" in message  # the fixes
  assert sum("hard prune" in str(x.message) for x in w) == 1  # said once, not every step


def test_clicktrain_wrapping_the_optimizer_keeps_pruned_weights_zero_quietly(tiny_cnn):
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    params, masks = _train(tiny_cnn(), _one_shot(optax.adamw(1e-2, weight_decay=1e-2)))
  assert _pruned_nonzero(params, masks) == 0
  assert np.count_nonzero(np.asarray(masks["conv1"]["kernel"]) == 0) > 0  # something pruned


def test_clicktrain_last_in_a_chain_keeps_pruned_weights_zero_quietly(tiny_cnn):
  # The update of a ClickTrain placed last is the final one: exact, no warning.
  tx = optax.chain(optax.scale_by_adam(), _one_shot(optax.scale(-1e-2)))
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    params, masks = _train(tiny_cnn(), tx)
  assert _pruned_nonzero(params, masks) == 0
