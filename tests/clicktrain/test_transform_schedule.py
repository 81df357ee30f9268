"""The ClickTrain transform's schedule and arguments: layer choice, stage transitions, the
loss-derivative trigger, schedule checks, per-layer ratios, bad arguments."""

import dataclasses
import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune.clicktrain import _plan as ct_plan
from jaxprune.clicktrain import state as ct_state
from jaxprune.clicktrain import transform as ct
from jaxprune.clicktrain.config import SUB_CONFIG_KEYWORDS, Aligned, Config

# These tests read the masked updates themselves through an identity inner, which init names
# (tests/clicktrain/test_chain_position.py tests that warning).
pytestmark = pytest.mark.filterwarnings(
  "ignore:clicktrain's inner transform returns its updates unchanged:UserWarning"
)


def test_default_layer_filter(kit):
  st = ct.clicktrain(optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3).init(kit.params())
  assert set(st.layers) == {kit.CONV1, kit.CONV2}  # no stem, no 1x1 shortcut, no dense
  assert st.layers[kit.CONV1].votes.shape == (6, 8, 12)
  assert st.layers[kit.CONV2].votes is None  # 1x1: kernel pruning only


def test_init_refuses_params_with_no_layer_to_prune_and_lists_the_kernels_it_saw(kit):
  # Only the layers the default filter leaves dense (the 3-channel stem, the 1x1 shortcut, the
  # head): before, init accepted it and the run trained dense until a read-out failed.
  p = kit.params()
  left_dense = {"stem": p["stem"], "shortcut": p["block"]["shortcut"], "head": p["head"]}
  tx = ct.clicktrain(optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3)
  with pytest.raises(ValueError, match="layer_filter") as error:
    tx.init(left_dense)
  message = str(error.value)
  assert "2 4-D kernel(s), none chosen" in message
  assert "stem/kernel (3, 3, 3, 6)" in message and "shortcut/kernel (1, 1, 6, 8)" in message
  with pytest.raises(ValueError, match="no 4-D kernel among its 2 param leaves"):
    tx.init({"head": p["head"]})
  # a filter that chooses nothing is refused the same way, even on a tree with convs
  nothing = ct.clicktrain(
    optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, layer_filter=lambda path, shape: None
  )
  with pytest.raises(ValueError, match="4 4-D kernel"):
    nothing.init(p)


def test_stage_schedule_fixed_epochs(kit):
  spe = 3
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=spe,
    hard_prune_epoch=6,
    pool_start_epoch=2,
    pool_epochs=1,
    finalize_epochs=2,
  )
  p = kit.params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  stages = []
  for i in range(8 * spe):
    stages.append(int(st.stage))
    _, st = update(kit.fake_grads(p, i), st, p, value=jnp.float32(1.0))
  per_epoch = [stages[e * spe : (e + 1) * spe] for e in range(8)]
  assert all(len(set(s)) == 1 for s in per_epoch)  # transitions only at epoch ends
  assert [s[0] for s in per_epoch] == [
    ct_state.WARMUP,
    ct_state.WARMUP,
    ct_state.POOL,
    ct_state.FINALIZE,
    ct_state.FINALIZE,
    ct_state.REGULARIZE,
    ct_state.PRUNED,
    ct_state.PRUNED,
  ]


def test_loss_derivative_trigger(kit):
  spe = 2
  tx = ct.clicktrain(optax.sgd(0.0), steps_per_epoch=spe, hard_prune_epoch=50)
  p = kit.params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  # epoch means: 3.0, 2.0 (Δ=1.0), 1.6 (Δ=0.4), 1.4 (Δ=0.2 < 0.27 -> pool from epoch 4)
  losses = [3.1, 2.9, 2.2, 1.8, 1.5, 1.7, 1.2, 1.6, 1.0, 1.0]
  stages = []
  for i, l in enumerate(losses):
    _, st = update(kit.fake_grads(p, i), st, p, value=jnp.float32(l))
    stages.append(int(st.stage))
  assert stages[:7] == [ct_state.WARMUP] * 7
  assert stages[7] == ct_state.POOL and int(st.stage_start_epoch) == 4


def test_run_still_in_warmup_at_the_hard_prune_epoch_warns_once(kit):
  # The epoch mean loss rises by 1 every epoch: the loss-derivative trigger never fires and
  # the run would stay dense past hard_prune_epoch without a word.
  tx = ct.clicktrain(optax.sgd(0.0), steps_per_epoch=1, hard_prune_epoch=3)
  p = kit.params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(6):
      _, st = update(kit.fake_grads(p, i), st, p, value=jnp.float32(i))
      jax.effects_barrier()
      if i == 1:
        assert not caught  # not before the end of epoch hard_prune_epoch - 1
  messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
  assert len(messages) == 1, messages
  assert messages[0].startswith("clicktrain: still in warmup after 3 epochs (hard_prune_epoch=3)")
  assert int(st.stage) == ct_state.WARMUP


def test_importance_every_longer_than_a_stage_raises():
  # A 2-epoch finalization of 3 steps each (6 steps) with importance_every=7 may score no
  # batch at all (all-zero scores: masks by index); 6 scores at least one whatever the phase.
  kwargs = dict(steps_per_epoch=3, hard_prune_epoch=20, pool_epochs=4, finalize_epochs=2)
  ct.clicktrain(optax.sgd(0.1), importance_every=6, **kwargs)
  with pytest.raises(
    ValueError,
    match=r"importance_every \(7\) must be <= the shortest importance stage, "
    r"finalize_epochs \* steps_per_epoch = 6 steps",
  ):
    ct.clicktrain(optax.sgd(0.1), importance_every=7, **kwargs)
  # one_shot mode has no per-batch importance work: no limit.
  ct.clicktrain(optax.sgd(0.1), mode="one_shot", one_shot_epoch=1, importance_every=7, **kwargs)


def test_fixed_schedule_that_misses_the_hard_prune_epoch_raises():
  # Masks final at pool_start + pool + finalize, one epoch of regularization before the hard
  # prune: hard_prune_epoch = 5 needs pool_start_epoch <= 2 (the boundary schedule prunes at
  # exactly hard_prune_epoch: test_stage_schedule_fixed_epochs).
  kwargs = dict(steps_per_epoch=1, hard_prune_epoch=5, pool_epochs=1, finalize_epochs=1)
  ct.clicktrain(optax.sgd(0.1), pool_start_epoch=2, **kwargs)
  for start in (3, 7):  # 7: still in warmup at the hard prune epoch
    with pytest.raises(
      ValueError,
      match=rf"hard_prune_epoch \(5\) must be > pool_start_epoch \+ pool_epochs \+ "
      rf"finalize_epochs \({start} \+ 1 \+ 1 = {start + 2}\)",
    ):
      ct.clicktrain(optax.sgd(0.1), pool_start_epoch=start, **kwargs)


@pytest.mark.parametrize("mode", ["paper", "one_shot"])
def test_per_layer_ratio_callable_and_errors(mode, kit):
  # The callable is asked once per pruned layer with its path and shape, and each layer then
  # prunes ceil(ratio(path, shape) · Cin · Cout) kernels.
  table = {kit.CONV1: 0.3, kit.CONV2: 0.7}
  calls = set()

  def ratio(path, shape):
    calls.add((path, tuple(shape)))
    return table[path]

  schedule = (
    dict(pool_start_epoch=0, pool_epochs=1, finalize_epochs=1, pool_size=5)
    if mode == "paper"
    else dict(one_shot_epoch=0)
  )
  tx = ct.clicktrain(
    optax.identity(),
    steps_per_epoch=1,
    hard_prune_epoch=5,
    mode=mode,
    kernel_prune_ratio=ratio,
    **schedule,
  )
  p = kit.params()
  st = tx.init(p)
  assert set(st.layers) == {kit.CONV1, kit.CONV2}
  assert calls == {(kit.CONV1, (3, 3, 6, 8)), (kit.CONV2, (1, 1, 8, 8))}
  for i in range(2 if mode == "paper" else 1):
    _, st = tx.update(kit.fake_grads(p, i), st, p, value=jnp.float32(1.0))
  assert int(st.stage) == ct_state.REGULARIZE
  for name, (cin, cout) in ((kit.CONV1, (6, 8)), (kit.CONV2, (8, 8))):
    pruned = int((~np.asarray(st.layers[name].kernel_keep)).sum())
    assert pruned == math.ceil(table[name] * cin * cout) == {kit.CONV1: 15, kit.CONV2: 45}[name]
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(
      optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=[0.5]
    ).init(kit.params())
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(
      optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=[0.5, 1.5]
    ).init(kit.params())


def _pruned_kernels(tx, kit):
  """Kernels each layer prunes once ``tx``'s one-shot masks are picked (step 1)."""
  p = kit.params()
  _, st = tx.update(kit.fake_grads(p, 0), tx.init(p), p, value=jnp.float32(1.0))
  return {n: int((~np.asarray(layer.kernel_keep)).sum()) for n, layer in st.layers.items()}


def test_per_layer_ratios_by_path_or_by_position_are_pure_and_checked(kit):
  # By hand: ceil(0.3 · 6 · 8) = 15 kernels of CONV1, ceil(0.7 · 8 · 8) = 45 of CONV2.
  def tx(ratio):
    return kit.one_shot_tx(None, kernel_prune_ratio=ratio)

  by_hand = {kit.CONV1: 15, kit.CONV2: 45}
  by_name = ct_plan.ratios_by_name(kit.params(), [0.3, 0.7])
  assert by_name == {kit.CONV1: 0.3, kit.CONV2: 0.7}
  assert _pruned_kernels(tx([0.3, 0.7]), kit) == by_hand
  assert _pruned_kernels(tx(by_name), kit) == by_hand
  # A path that is not a pruned layer (one a reconfiguration removed) is not needed.
  assert _pruned_kernels(tx({**by_name, "gone/kernel": 0.9}), kit) == by_hand
  with pytest.raises(ValueError, match=rf"no ratio for the pruned layer\(s\) \['{kit.CONV2}'\]"):
    tx({kit.CONV1: 0.3}).init(kit.params())
  with pytest.raises(ValueError, match=f"kernel_prune_ratio for '{kit.CONV1}' must be in"):
    tx({kit.CONV1: 1.5, kit.CONV2: 0.7})
  with pytest.raises(ValueError, match="ratios has 1 entries for 2 pruned layers"):
    ct_plan.ratios_by_name(kit.params(), [0.3])
  # init is a pure function of the params: a sequence matched on one tree is not remembered
  # for another (before, the first init kept it by name in a closure every later init read).
  sequence = tx([0.3, 0.7])
  sequence.init(kit.params())
  fewer = kit.params()
  del fewer["block"]["conv2"]
  with pytest.raises(ValueError, match="give the ratios by path"):
    sequence.init(fewer)
  # The mapping is held read-only and hashable, as the rest of the frozen Config.
  schedule = ct.Schedule(steps_per_epoch=1, hard_prune_epoch=2, mode="one_shot", one_shot_epoch=0)
  a, b = Config(schedule, by_name), Config(schedule, dict(by_name))
  assert a == b and hash(a) == hash(b)


def test_bad_arguments(kit):
  sgd = optax.sgd(0.1)
  with pytest.raises(ValueError, match="mode"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, mode="admm")
  with pytest.raises(ValueError, match="steps_per_epoch"):
    ct.clicktrain(sgd, steps_per_epoch=0, hard_prune_epoch=3)
  with pytest.raises(ValueError, match="one_shot_epoch"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, mode="one_shot")
  for bad in (0, 6, 16, True, 4.5):
    with pytest.raises(ValueError, match=r"^one_shot_patterns must be one of \(4, 8, 12\)"):
      ct.clicktrain(
        sgd,
        steps_per_epoch=1,
        hard_prune_epoch=3,
        mode="one_shot",
        one_shot_epoch=1,
        one_shot_patterns=bad,
      )
  with pytest.raises(ValueError, match="hard_prune_epoch"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=2, mode="one_shot", one_shot_epoch=2)
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=-0.1)
  with pytest.raises(ValueError, match="group_lasso"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, group_lasso_coefficient=-1.0)
  with pytest.raises(ValueError, match="margin_rule"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, margin_rule="x")
  with pytest.raises(ValueError, match="pool_size"):
    ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3, pool_size=0)
  with pytest.raises(ValueError, match="layer_filter"):
    ct.clicktrain(
      sgd, steps_per_epoch=1, hard_prune_epoch=3, layer_filter=lambda path, shape: "yes"
    ).init(kit.params())
  tx = ct.clicktrain(sgd, steps_per_epoch=1, hard_prune_epoch=3)
  p = kit.params()
  with pytest.raises(ValueError, match="loss"):
    tx.update(p, tx.init(p), p)
  with pytest.raises(ValueError, match="params"):
    tx.update(p, tx.init(p), value=1.0)


@pytest.mark.parametrize(
  "ratio",
  [True, [True, 0.5], lambda path, shape: True],
  ids=["scalar", "sequence", "callable"],
)
def test_bool_kernel_prune_ratio_is_rejected_not_pruning_every_kernel(ratio, kit):
  with pytest.raises(ValueError, match="kernel_prune_ratio"):
    ct.clicktrain(
      optax.sgd(0.1), steps_per_epoch=1, hard_prune_epoch=3, kernel_prune_ratio=ratio
    ).init(kit.params())


def test_every_keyword_lands_in_the_validated_config():
  # clicktrain() hands its keywords to Config by name, the epoch settings to its Schedule, a
  # mode's settings to its sub-config: a keyword without a field (or a field without a keyword)
  # would be a setting that is never validated or never settable.
  defaults = {k: p.default for k, p in inspect.signature(ct.clicktrain).parameters.items()}
  del defaults["inner"], defaults["config"]
  schedule_fields = {f.name for f in dataclasses.fields(ct.Schedule)}
  config_fields = {f.name for f in dataclasses.fields(Config)} - {"paper", "one_shot", "aligned"}
  assert set(defaults) == config_fields | schedule_fields | set(SUB_CONFIG_KEYWORDS)
  options = {k: v for k, v in defaults.items() if k not in schedule_fields and k != "schedule"}
  schedule = ct.Schedule(steps_per_epoch=2, hard_prune_epoch=3)
  cfg = Config.from_keywords(schedule, **options)
  assert cfg == Config(schedule)  # the keywords' defaults are the config's
  for keyword, (part, field) in SUB_CONFIG_KEYWORDS.items():
    sub = getattr(Config(schedule), part) or Aligned(filter_groups=1)
    want = None if keyword == "filter_groups" else getattr(sub, field)
    assert defaults[keyword] == want, keyword
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.importance_every = 2
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.paper.pool_size = 8
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.schedule.hard_prune_epoch = 8


def _five_epochs_of_flat_loss(kit, hard_prune_epoch):
  """Five one-step epochs of a constant loss (Δ = 0: the trigger fires at its earliest, the
  end of epoch 2) with one pool and one finalization epoch; returns the stage after each
  epoch and the ``RuntimeWarning`` messages."""
  tx = ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=1,
    hard_prune_epoch=hard_prune_epoch,
    pool_epochs=1,
    finalize_epochs=1,
  )
  p = kit.params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  stages = []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(5):
      _, st = update(kit.fake_grads(p, i), st, p, value=jnp.float32(1.0))
      jax.effects_barrier()
      stages.append(int(st.stage))
  return stages, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_trigger_that_fires_too_late_warns_and_moves_the_hard_prune(kit):
  # hard_prune_epoch=3 leaves no room: the trigger fires at the end of epoch 2 at the earliest
  # and pool + finalization + one regularized epoch take 3 more. The stages run in full and
  # the hard prune moves to the end of epoch 5, said when the trigger fires.
  stages, messages = _five_epochs_of_flat_loss(kit, hard_prune_epoch=3)
  assert stages == [
    ct_state.WARMUP,
    ct_state.POOL,
    ct_state.FINALIZE,
    ct_state.REGULARIZE,
    ct_state.PRUNED,
  ]
  assert messages == [
    (
      "clicktrain: the loss-derivative trigger fired after 2 epochs, too late for pool_epochs "
      "+ finalize_epochs + 1 = 3 epochs before hard_prune_epoch=3: the stages run in full and "
      "the hard prune moves to the end of epoch 5, if the run lasts that long (otherwise it "
      "ends dense)"
    )
  ]


def test_trigger_in_time_does_not_warn(kit):
  stages, messages = _five_epochs_of_flat_loss(kit, hard_prune_epoch=5)
  assert not messages
  assert stages[-1] == ct_state.PRUNED


def test_a_schedule_that_cannot_prune_inside_the_run_warns_when_built():
  from jaxprune import methods

  # The run: hard_prune_epoch=3 in a 4-epoch fit, default 5 + 5 stages after the
  # trigger: the earliest hard prune is after 2 + 5 + 5 + 1 = 13 epochs.
  with pytest.warns(
    RuntimeWarning,
    match=r"clicktrain: the run of total_epochs=4 ends before its hard prune, which comes "
    r"after 13 epochs at the earliest \(hard_prune_epoch=3; the loss-derivative trigger fires "
    r"at the end of epoch 2 at the earliest, then pool_epochs \+ finalize_epochs = 5 \+ 5",
  ):
    ct.clicktrain(optax.sgd(0.1), steps_per_epoch=2, hard_prune_epoch=3, total_epochs=4)
  with pytest.warns(RuntimeWarning, match=r"after 5 epochs at the earliest \(hard_prune_epoch=5\)"):
    ct.clicktrain(
      optax.sgd(0.1),
      steps_per_epoch=2,
      mode="one_shot",
      one_shot_epoch=1,
      hard_prune_epoch=5,
      total_epochs=4,
    )
  with pytest.warns(RuntimeWarning, match="after 13 epochs at the earliest"):  # via the preset
    methods.get("clicktrain", hard_prune_epoch=3).make_tx(
      optax.sgd(0.1), methods.Run(steps_per_epoch=2, epochs=4)
    )
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ct.clicktrain(optax.sgd(0.1), steps_per_epoch=2, hard_prune_epoch=3, total_epochs=13)
    ct.clicktrain(optax.sgd(0.1), steps_per_epoch=2, hard_prune_epoch=3)  # length unknown
    ct.clicktrain(  # a fixed schedule that prunes at the run's last epoch end
      optax.sgd(0.1),
      steps_per_epoch=2,
      hard_prune_epoch=8,
      pool_start_epoch=1,
      pool_epochs=3,
      finalize_epochs=3,
      total_epochs=8,
    )
  with pytest.raises(ValueError, match="total_epochs must be an int >= 1"):
    ct.clicktrain(optax.sgd(0.1), steps_per_epoch=2, hard_prune_epoch=3, total_epochs=0)
