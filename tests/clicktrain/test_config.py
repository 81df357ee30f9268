"""ClickTrain's settings as one value: a :class:`Config` built from its sub-configs (paper mode,
one-shot, aligned) runs the transform exactly as the same keywords do, is not mixed with them,
and each sub-config names its bad value by the keyword it stands for."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune import clicktrain as ct


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "a": {"kernel": jax.random.normal(k1, (3, 3, 8, 8))},
    "b": {"kernel": jax.random.normal(k2, (3, 3, 8, 8))},
  }


def _grads(step):
  rng = np.random.default_rng(step)
  return jax.tree.map(lambda w: jnp.asarray(rng.normal(size=w.shape), w.dtype), _params())


def _run(tx, steps=7):
  """The updates and last state of ``steps`` steps (fixed params, varying gradients, a loss
  that falls, then rises once so the loss margin decides a vote)."""
  params = _params()
  state, out = tx.init(params), []
  for k in range(steps):
    loss = jnp.float32(1.0 - 0.05 * k + (0.2 if k == 3 else 0.0))
    u, state = tx.update(_grads(k), state, params, value=loss)
    out.append(u)
  return out, state


_SCHEDULES = {
  "paper": ct.Schedule(
    steps_per_epoch=1, hard_prune_epoch=5, pool_start_epoch=0, pool_epochs=2, finalize_epochs=2
  ),
  "one_shot": ct.Schedule(steps_per_epoch=1, hard_prune_epoch=5, mode="one_shot", one_shot_epoch=1),
}

# (schedule, keywords, the same as sub-configs): each case sets every field of the sub-configs
# its mode reads away from the default.
_CASES = {
  "paper_aligned": (
    "paper",
    dict(
      kernel_prune_ratio=(0.25, 0.5),
      pool_size=8,
      loss_margin=0.9,
      margin_rule="literal",
      filter_groups=2,
      filter_grouping="clustered",
      group_lasso_coefficient=1e-2,
    ),
    dict(
      kernel_prune_ratio=(0.25, 0.5),
      paper=ct.PaperMode(pool_size=8, loss_margin=0.9, margin_rule="literal"),
      aligned=ct.Aligned(filter_groups=2, grouping="clustered"),
      group_lasso_coefficient=1e-2,
    ),
  ),
  "paper": (
    "paper",
    dict(pool_size=4, loss_margin=0.5, balanced_kernels=True, group_lasso_ramp="linear"),
    dict(
      paper=ct.PaperMode(pool_size=4, loss_margin=0.5),
      balanced_kernels=True,
      group_lasso_ramp="linear",
    ),
  ),
  "one_shot": (
    "one_shot",
    dict(one_shot_patterns=8, filter_groups=4, kernel_prune_ratio=0.75),
    dict(one_shot=ct.OneShot(patterns=8), aligned=ct.Aligned(4), kernel_prune_ratio=0.75),
  ),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_a_config_of_sub_configs_gives_the_updates_of_the_same_keywords(case):
  mode, keywords, parts = _CASES[case]
  schedule = _SCHEDULES[mode]
  by_keywords = ct.clicktrain(optax.sgd(0.1, momentum=0.9), schedule=schedule, **keywords)
  config = ct.Config(schedule, **parts)
  by_config = ct.clicktrain(optax.sgd(0.1, momentum=0.9), config=config)
  (u_kw, s_kw), (u_cfg, s_cfg) = _run(by_keywords), _run(by_config)
  assert jax.tree.structure(s_kw) == jax.tree.structure(s_cfg)
  for a, b in zip(jax.tree.leaves((u_kw, s_kw)), jax.tree.leaves((u_cfg, s_cfg))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert ct.stage_name(s_cfg) == "pruned"  # the run went through every stage
  if mode == "paper":  # the pool is the sub-config's size
    assert s_cfg.layers["a/kernel"].pool.shape == (config.paper.pool_size,)


def test_config_and_keywords_are_not_mixed():
  config = ct.Config(_SCHEDULES["paper"])
  for extra in (
    {"pool_size": 8},
    {"one_shot_patterns": 12},
    {"filter_groups": 2},
    {"kernel_prune_ratio": (0.5, 0.5)},
    {"steps_per_epoch": 2},
    {"schedule": _SCHEDULES["paper"]},
  ):
    with pytest.raises(
      ValueError, match=r"either as config= or as keywords, not both .*" + next(iter(extra))
    ):
      ct.clicktrain(optax.sgd(0.1), config=config, **extra)
  with pytest.raises(ValueError, match="config must be a clicktrain.Config"):
    ct.clicktrain(optax.sgd(0.1), config={"pool_size": 8})
  # A keyword left at its default is no second source.
  ct.clicktrain(optax.sgd(0.1), config=config, pool_size=12, margin_rule="relative")


@pytest.mark.parametrize(
  "build, message",
  [
    (lambda: ct.PaperMode(pool_size=0), r"^pool_size must be an int >= 1"),
    (lambda: ct.PaperMode(pool_size=127), r"^pool_size must be <= 126"),
    (lambda: ct.PaperMode(pool_size=True), r"^pool_size must be an int"),
    (lambda: ct.PaperMode(loss_margin=-0.1), r"^loss_margin must be a finite number >= 0"),
    (lambda: ct.PaperMode(loss_margin=float("nan")), r"^loss_margin must be a finite"),
    (lambda: ct.PaperMode(margin_rule="absolute"), r"^margin_rule must be 'relative' or"),
    (lambda: ct.OneShot(patterns=5), r"^one_shot_patterns must be one of \(4, 8, 12\)"),
    (lambda: ct.OneShot(patterns=True), r"^one_shot_patterns must be one of"),
    (lambda: ct.Aligned(filter_groups=0), r"^filter_groups must be an int >= 1"),
    (lambda: ct.Aligned(filter_groups=None), r"^filter_groups must be an int >= 1"),
    (lambda: ct.Aligned(filter_groups=True), r"^filter_groups must be an int >= 1"),
    (lambda: ct.Aligned(2, grouping="random"), r"^filter_grouping must be one of"),
    (lambda: ct.Aligned(None, grouping="clustered"), r"clustered.*needs filter_groups"),
    (lambda: ct.Config(_SCHEDULES["paper"], paper={"pool_size": 8}), r"^paper must be a"),
    (lambda: ct.Config(_SCHEDULES["paper"], one_shot=4), r"^one_shot must be a clicktrain"),
    (lambda: ct.Config(_SCHEDULES["paper"], aligned=2), r"^aligned must be a clicktrain"),
    (lambda: ct.Config(schedule=None), r"^schedule must be a clicktrain.Schedule"),
    (lambda: ct.Config(_SCHEDULES["paper"], eps=-1.0), r"^eps must be a finite number"),
  ],
)
def test_each_bad_value_is_named_where_its_config_is_built(build, message):
  with pytest.raises(ValueError, match=message):
    build()


@pytest.mark.parametrize(
  "keywords, message",
  [
    ({"pool_size": 0}, r"^pool_size must be an int >= 1"),
    ({"loss_margin": -1.0}, r"^loss_margin must be a finite"),
    ({"one_shot_patterns": 6}, r"^one_shot_patterns must be one of"),
    ({"filter_groups": 0}, r"^filter_groups must be an int >= 1"),
    ({"filter_grouping": "random"}, r"^filter_grouping must be one of"),
    ({"filter_grouping": "clustered"}, r"clustered.*needs filter_groups"),
  ],
)
def test_the_keywords_give_the_sub_configs_messages(keywords, message):
  with pytest.raises(ValueError, match=message):
    ct.clicktrain(optax.sgd(0.1), schedule=_SCHEDULES["paper"], **keywords)


def test_the_keywords_build_the_sub_configs():
  cfg = ct.Config.from_keywords(
    _SCHEDULES["paper"], pool_size=8, one_shot_patterns=12, filter_groups=2, eps=1e-6
  )
  assert cfg.paper == ct.PaperMode(pool_size=8)
  assert cfg.one_shot == ct.OneShot(patterns=12)
  assert cfg.aligned == ct.Aligned(filter_groups=2, grouping="consecutive")
  assert cfg.eps == 1e-6
  assert ct.Config.from_keywords(_SCHEDULES["paper"]).aligned is None  # off by default
