"""ClickTrain's update called outside ``jit`` (``nnx.Optimizer(...).update`` in an eager loop).

Eagerly, every ``lax.cond`` / ``lax.switch`` of the stage machine traces fresh branch
closures whose constants are that step's params and gradients; JAX's eager dispatch compiles
one executable per distinct branch jaxpr and keeps it in its cache (up to 4096 entries, with
those constants inside), so each step paid seconds of compilation and memory grew with every
step. The update must compile once per shape, as it does under ``jit``.
"""

import jax
import jax.numpy as jnp
import optax

from jaxprune import clicktrain


def _backend_compiles(fn) -> int:
  """XLA compilations while ``fn()`` runs (JAX's own compile event)."""
  events = []

  def listener(event, duration_secs, **kwargs):
    del duration_secs, kwargs
    if event == "/jax/core/compile/backend_compile_duration":
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return len(events)


def test_eager_update_compiles_only_at_its_first_steps():
  params = {
    "conv": {"kernel": jax.random.normal(jax.random.key(0), (3, 3, 8, 8))},
    "head": {"kernel": jnp.ones((8, 4))},
  }
  # One step per epoch: the steps below cross pool generation, finalization, the group lasso
  # and the hard prune, so every branch of the stage machine runs eagerly.
  tx = clicktrain.clicktrain(
    optax.sgd(0.1, momentum=0.9),
    steps_per_epoch=1,
    hard_prune_epoch=6,
    pool_start_epoch=0,
    pool_epochs=2,
    finalize_epochs=2,
    kernel_prune_ratio=0.5,
  )
  state = tx.init(params)

  def steps(first, last):
    nonlocal params, state
    for i in range(first, last):
      grads = jax.tree.map(lambda p, i=i: jnp.full(p.shape, 0.01 * (i + 1)), params)
      updates, state = tx.update(grads, state, params, value=jnp.float32(1.0 / (i + 1)))
      params = optax.apply_updates(params, updates)
    jax.block_until_ready(params)

  assert _backend_compiles(lambda: steps(0, 2)) > 0  # the first steps compile (not vacuous)
  later = _backend_compiles(lambda: steps(2, 8))
  assert clicktrain.stage_name(state) == "pruned"
  assert later == 0
