"""ClickTrain placed first in an ``optax.chain``: the next transform rescales its masked updates,
the pruned weights come back, and the transform says so by name (ClickTrain §4.4's hard prune
keeps them at exactly zero only when it masks the final update)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxprune import clicktrain as ct


def _clicktrain(inner):
  return ct.clicktrain(
    inner,
    steps_per_epoch=2,
    hard_prune_epoch=1,
    mode="one_shot",
    one_shot_epoch=0,
    kernel_prune_ratio=0.5,
  )


def _train(tx, steps=6):
  rng = np.random.default_rng(0)
  params = {"conv": {"kernel": jnp.asarray(rng.normal(size=(3, 3, 8, 8)), jnp.float32)}}
  state = tx.init(params)
  update = jax.jit(tx.update)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(steps):
      grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
      updates, state = update(grads, state, params, value=jnp.float32(1.0))
      params = optax.apply_updates(params, updates)
    jax.effects_barrier()  # the check reports through a host callback
  mask = np.asarray(ct.masks(state, params)["conv"]["kernel"])  # found inside the chain
  kernel = np.asarray(params["conv"]["kernel"])
  refilled = int(np.sum((mask == 0) & (kernel != 0)))
  return refilled, [str(w.message) for w in caught if "hard prune" in str(w.message)]


def test_chained_first_the_refilled_weights_are_named_once():
  refilled, notes = _train(optax.chain(_clicktrain(optax.identity()), optax.adam(1e-2)))
  assert refilled > 0  # what the chain does: adam rescales the -w that would zero them
  assert len(notes) == 1
  assert "conv/kernel" in notes[0] and "wrap the optimizer instead" in notes[0]


def test_wrapping_the_optimizer_keeps_the_masks_exact_without_a_word():
  refilled, notes = _train(_clicktrain(optax.adam(1e-2)))
  assert refilled == 0 and notes == []
