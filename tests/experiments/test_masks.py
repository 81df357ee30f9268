"""experiments.common.masks: the pruned states every bench times, against hand counts."""

import math

import numpy as np
import pytest
from flax import nnx

from experiments.common import masks
from jaxprune import clicktrain, models
from jaxprune import prunetrain as pt
from jaxprune.clicktrain import patterns

_LIBRARY = {p.tobytes() for p in patterns.library_patterns().astype(np.float32)}


def test_fine_grained_masks_match_the_ratio_and_the_library():
  rng = np.random.default_rng(0)
  for balanced in (False, True):
    mask = masks.clicktrain_like_mask((3, 3, 12, 10), 0.65, rng, balanced=balanced)
    kept = mask.sum((0, 1)) > 0  # (Cin, Cout)
    if balanced:
      assert (kept.sum(0) == 12 - math.ceil(0.65 * 12)).all()
    else:
      assert kept.sum() == 120 - math.ceil(0.65 * 120)
    for c, f in zip(*np.nonzero(kept)):
      assert mask[:, :, c, f].tobytes() in _LIBRARY
  one_by_one = masks.clicktrain_like_mask((1, 1, 8, 8), 0.5, rng)
  assert one_by_one.sum() == 32


@pytest.mark.parametrize("contiguous", [False, True])
def test_aligned_masks_share_channels_and_patterns_within_each_filter_group(contiguous):
  rng = np.random.default_rng(1)
  mask = masks.clicktrain_like_mask((3, 3, 10, 8), 0.6, rng, groups=2, contiguous=contiguous)
  kept_channels = 10 - math.ceil(0.6 * 10)
  for group in (mask[..., :4], mask[..., 4:]):
    # every filter of the group: the same kernel at every input channel
    assert (group == group[..., :1]).all()
    kernels = group[..., 0]  # (3, 3, Cin)
    kept = np.nonzero(kernels.sum((0, 1)))[0]
    assert len(kept) == kept_channels
    if contiguous:
      assert list(kept) == list(range(kept_channels))
    for c in kept:
      assert kernels[:, :, c].tobytes() in _LIBRARY


def test_mask_options_that_do_not_apply_are_refused():
  rng = np.random.default_rng(0)
  with pytest.raises(ValueError, match="balanced"):
    masks.clicktrain_like_mask((3, 3, 4, 4), 0.5, rng, groups=2, balanced=True)
  with pytest.raises(ValueError, match="contiguous"):
    masks.clicktrain_like_mask((3, 3, 4, 4), 0.5, rng, contiguous=True)
  with pytest.raises(ValueError, match="mode"):
    masks.clicktrain_to_hard_prune("clicktrain-vgg11", mode="oneshot")


def test_pruned_layers_are_the_convs_the_transform_prunes():
  model = models.create(
    "clicktrain-vgg11", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.125
  )
  layers = masks.pruned_layers(model, 32, 1)
  # every conv but the stem (features/0)
  assert [tuple(layer.param_path) for layer in layers] == [
    ("features", i, "conv", "kernel") for i in range(1, 8)
  ]
  assert [tuple(layer.param_shape[:2]) for layer in layers] == [(3, 3)] * 7


@pytest.mark.parametrize("mode", ["paper", "one_shot"])
def test_the_transform_reaches_its_hard_prune_inside_the_run(mode):
  import jax.numpy as jnp
  import optax

  params = {"stages": {"0": {"conv": {"kernel": jnp.ones((3, 3, 8, 8))}}}}
  method, run = masks.clicktrain_to_hard_prune("clicktrain-resnet32", mode=mode)
  tx = method.make_tx(optax.sgd(0.0), run)
  state = tx.init(params)
  grads = {"stages": {"0": {"conv": {"kernel": jnp.linspace(-1, 1, 576).reshape(3, 3, 8, 8)}}}}
  first = state
  stages, states = [], [state]
  for _ in range(run.epochs):
    _, state = tx.update(grads, state, params, value=jnp.float32(1.0))
    stages.append(clicktrain.stage_name(state))
    states.append(state)
  assert "pruned" in stages and stages.index("pruned") < run.epochs - 1
  # step_until_pruned stops at the first pruned state and returns it ...
  calls = iter(states[1:])
  reached = masks.step_until_pruned(lambda: next(calls), run)
  assert reached is states[1 + stages.index("pruned")]
  # ... and names the stage of a run that never gets there.
  with pytest.raises(RuntimeError, match=r"did not reach its hard prune in \d+ steps \(stage"):
    masks.step_until_pruned(lambda: first, run)


def test_dead_channels_are_what_reconfigure_removes(tiny_resnet):
  model = tiny_resnet()
  graph = pt.channel_graph(model)
  masks.kill_channels(model, 0.5)
  _, _, report = pt.reconfigure(model, None, count_flops=False)
  # Each group's writers (the convs producing it on their HWIO kernel's last axis, named by
  # their ConvBN) lose the same count.
  want = {
    "/".join(map(str, use.path[:-2])): group.width - max(1, round(0.5 * group.width))
    for group in graph.prunable
    for use in group.kernels
    if use.axis == 3
  }
  assert {name: report.channels_removed[name] for name in want} == want
  assert min(want.values()) > 0
