"""The released one-shot configs (``clicktrain.released_method``): VGG-16 picks from 12 patterns.

What ``one_shot_patterns=12`` does to the masks is tested against a NumPy re-implementation of
the released rule in test_transform_one_shot.py; here, that the preset passes the released config
on.
"""

import functools

import jax
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain, methods, models
from jaxprune.clicktrain import preset
from jaxprune.clicktrain import transform as ct
from jaxprune.clicktrain.config import default_layer_filter
from jaxprune.paths import path_string


@pytest.fixture
def captured(monkeypatch):
  """The keywords ``preset`` passes to ``clicktrain`` (the transform is built as usual)."""
  calls = []

  @functools.wraps(ct.clicktrain)  # the preset checks its keys against this signature
  def spy(inner, **kwargs):
    calls.append(kwargs)
    return ct.clicktrain(inner, **kwargs)

  monkeypatch.setattr(preset, "clicktrain", spy)
  return calls


def _pruned_layers(name):
  model = nnx.eval_shape(lambda: models.create(name, num_classes=10, rngs=nnx.Rngs(0)))
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [p for p, leaf in leaves if default_layer_filter(path_string(p), leaf.shape)]


@pytest.mark.parametrize("arch, pool", [("vgg16", 12), ("vgg11", 4)])
def test_released_preset_passes_the_pool_size_and_one_ratio_per_pruned_layer(captured, arch, pool):
  tx = clicktrain.released_method(arch).make_tx(
    optax.sgd(0.1), methods.Run(steps_per_epoch=5, epochs=19)
  )
  (kwargs,) = captured
  schedule = kwargs["schedule"]  # the epoch settings, as one value
  assert schedule.mode == "one_shot" and kwargs["one_shot_patterns"] == pool
  assert len(kwargs["kernel_prune_ratio"]) == len(_pruned_layers(f"clicktrain-{arch}"))
  released = clicktrain.RELEASED_CIFAR10[arch]
  # the released epochs (of 190) at the same fractions of this 19-epoch run
  assert schedule.one_shot_epoch == round(released["one_shot_epoch"] / 10)
  assert schedule.hard_prune_epoch == round(released["hard_prune_epoch"] / 10)
  assert schedule.steps_per_epoch == 5
  assert isinstance(tx, optax.GradientTransformationExtraArgs)


def test_released_preset_overrides_and_short_runs(captured):
  clicktrain.released_method("vgg16", one_shot_patterns=8, one_shot_epoch=0).make_tx(
    optax.sgd(0.1), methods.Run(steps_per_epoch=1, epochs=1)
  )
  (kwargs,) = captured
  assert kwargs["one_shot_patterns"] == 8 and kwargs["schedule"].one_shot_epoch == 0
  assert kwargs["schedule"].hard_prune_epoch == 1  # kept after the pick in a run this short
  with pytest.raises(ValueError, match="^arch must be one of"):
    clicktrain.released_method("resnet9")
  with pytest.raises(ValueError, match="^one_shot_patterns must be one of"):
    clicktrain.released_method("vgg16", one_shot_patterns=3).make_tx(
      optax.sgd(0.1), methods.Run(steps_per_epoch=1, epochs=10)
    )
