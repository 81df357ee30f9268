"""ClickTrain's place in an ``optax.chain``: an identity inner placed before the optimizer is named
at ``init``, and the pruned weights it lets the next transform re-fill are what
``masking.RefillCheck`` (a hand-written loop's epoch-end check) counts."""

import warnings

import jax
import numpy as np
import optax
import pytest

from jaxprune import clicktrain, masking
from jaxprune.clicktrain.state import full_mask

_PASS_THROUGH = "inner transform returns its updates unchanged"


def _train_past_the_prune(kit, tx, steps=14):
  """``tx`` on the toy loss until two steps after the hard prune: ``(params, state)``."""
  p = kit.params()
  st = tx.init(p)
  step = kit.train_step(tx)
  pruned_steps = 0
  for i in range(steps):
    p, st = step(p, st, *kit.batch(i))
    pruned_steps += clicktrain.stage_name(st) == "pruned"
    if pruned_steps == 2:
      return p, st
  raise AssertionError("no hard prune")


def _pruned_nonzero(state, params):
  """Per pruned layer, the weights its masks prune that are nonzero in ``params``: counted in
  NumPy from the state's own per-layer masks (``P ⊙ K``), not through ``masking``."""
  counts = {}
  for name, layer in clicktrain.find_state(state).layers.items():
    weight = params
    for key in name.split("/"):
      weight = weight[key]
    keep = np.asarray(full_mask(layer)) != 0
    counts[name] = int(np.count_nonzero(np.asarray(weight)[~keep]))
  return counts


def test_an_identity_inner_chained_before_the_optimizer_is_named_at_init(kit):
  tx = optax.chain(kit.pruning_tx(optax.identity()), optax.adamw(1e-2))
  with pytest.warns(UserWarning, match=_PASS_THROUGH) as record:
    tx.init(kit.params())
  assert sum(_PASS_THROUGH in str(w.message) for w in record) == 1
  assert "clicktrain(optax.adamw(...), ...)" in str(record[0].message)


def test_the_named_chain_refills_the_pruned_weights_and_the_refill_check_counts_them(kit):
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=f".*{_PASS_THROUGH}")
    chained = optax.chain(kit.pruning_tx(optax.identity()), optax.adamw(1e-2))
    p, st = _train_past_the_prune(kit, chained)
  refilled = _pruned_nonzero(st, p)
  assert sum(refilled.values()) > 0  # the warning's claim: adamw re-filled them
  check = masking.RefillCheck()
  assert check(st, p) == 0  # armed at its first call (the masks may be announced then)
  with pytest.warns(RuntimeWarning, match="pruned weights are non-zero"):
    assert check(st, p) == sum(refilled.values())


def test_clicktrain_wrapping_the_optimizer_is_not_named_and_keeps_the_pruned_weights_zero(kit):
  tx = kit.pruning_tx(optax.adamw(1e-2))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    p, st = _train_past_the_prune(kit, tx)
  assert not [w for w in record if _PASS_THROUGH in str(w.message)]
  counts = _pruned_nonzero(st, p)
  assert counts and set(counts.values()) == {0}
  check = masking.RefillCheck()
  assert check(st, p) == 0 and check(st, p) == 0


def test_an_inner_that_transforms_its_updates_is_not_named_even_under_jit(kit):
  for inner in (optax.sgd(0.1), optax.scale(1.0), optax.chain(optax.identity(), optax.sgd(0.1))):
    with warnings.catch_warnings(record=True) as record:
      warnings.simplefilter("always")
      jax.jit(kit.pruning_tx(inner).init)(kit.params())
    assert not [w for w in record if _PASS_THROUGH in str(w.message)], inner
  # and an identity is named from inside jit too (the probe is abstract)
  with pytest.warns(UserWarning, match=_PASS_THROUGH):
    jax.jit(kit.pruning_tx(optax.chain(optax.identity())).init)(kit.params())
