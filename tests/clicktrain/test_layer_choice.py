"""ClickTrain's layer choice by structure: which 1x1 convs are projection shortcuts, whatever
their names, and the preset's fit-start check that the name-based default agrees."""

import warnings

import numpy as np
import optax
import pytest
from flax import nnx

from jaxprune import clicktrain as ct
from jaxprune import data, flops, methods, models, train
from jaxprune.clicktrain.config import name_chosen_projections

_SHAPE = (1, 8, 8, 4)


class _Block(nnx.Module):
  """A residual block with a 1x1 projection shortcut called ``proj``, and a 1x1 conv on the
  residual branch (``expand``, which joins the add but is not on the skip path)."""

  def __init__(self, cin, cout, rngs, *, shortcut_name="proj", projection=True):
    self.a = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)
    self.a_bn = nnx.BatchNorm(cout, rngs=rngs)
    self.expand = nnx.Conv(cout, cout, (1, 1), use_bias=False, rngs=rngs)
    self.shortcut_name = shortcut_name
    self.projection = projection
    if projection:
      setattr(self, shortcut_name, nnx.Conv(cin, cout, (1, 1), use_bias=False, rngs=rngs))

  def __call__(self, x):
    y = self.expand(nnx.relu(self.a_bn(self.a(x))))
    skip = getattr(self, self.shortcut_name)(x) if self.projection else x
    return nnx.relu(y + skip)


class _Net(nnx.Module):
  def __init__(self, rngs, shortcut_name="proj"):
    self.stem = nnx.Conv(4, 8, (3, 3), rngs=rngs)  # 4 channels: pruned like any conv
    self.b1 = _Block(8, 16, rngs, shortcut_name=shortcut_name)
    self.b2 = _Block(16, 16, rngs, projection=False)  # identity shortcut: expand joins the add
    self.side = nnx.Conv(16, 16, (1, 1), rngs=rngs)  # a plain 1x1 conv, no residual
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    x = self.b2(self.b1(nnx.relu(self.stem(x))))
    return self.head(nnx.relu(self.side(x)).mean((1, 2)))


@pytest.mark.parametrize("name", ["proj", "shortcut", "downsample", "b2_skip"])
def test_projection_shortcuts_are_found_by_structure_whatever_their_name(name):
  model = _Net(nnx.Rngs(0), shortcut_name=name)
  assert flops.projection_shortcuts(model, _SHAPE) == {f"b1/{name}/kernel"}


@pytest.mark.parametrize(
  ("zoo", "expected"),
  [
    ("prunetrain-resnet20", {"stages/1/0/shortcut/conv/kernel", "stages/2/0/shortcut/conv/kernel"}),
    ("clicktrain-vgg11", set()),
    ("sdgp-resnet9", set()),  # identity shortcuts only
  ],
)
def test_zoo_shortcuts_are_the_convs_named_shortcut(zoo, expected):
  model = nnx.eval_shape(lambda: models.create(zoo, num_classes=10, rngs=nnx.Rngs(0)))
  assert flops.projection_shortcuts(model, (1, 32, 32, 3)) == expected
  # So the name-based default and the structure agree on every zoo network.
  assert ct.layer_choice_differences(model, (1, 32, 32, 3)) == {}


def test_layer_filter_for_leaves_exactly_the_projection_dense():
  model = _Net(nnx.Rngs(0))
  choose = ct.layer_filter_for(model, _SHAPE)
  kinds = {
    path: choose(path, shape)
    for path, shape in [
      ("b1/proj/kernel", (1, 1, 8, 16)),
      ("b1/expand/kernel", (1, 1, 16, 16)),
      ("b2/expand/kernel", (1, 1, 16, 16)),
      ("side/kernel", (1, 1, 16, 16)),
      ("b1/a/kernel", (3, 3, 8, 16)),
      ("head/kernel", (16, 4)),
    ]
  }
  assert kinds == {
    "b1/proj/kernel": None,
    "b1/expand/kernel": "kernel",
    "b2/expand/kernel": "kernel",
    "side/kernel": "kernel",
    "b1/a/kernel": "pattern",
    "head/kernel": None,
  }
  # The name-based default prunes the projection called "proj" (the difference named).
  assert ct.default_layer_filter("b1/proj/kernel", (1, 1, 8, 16)) == "kernel"
  assert list(ct.layer_choice_differences(model, _SHAPE)) == ["b1/proj/kernel"]


def _loader():
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (16, 8, 8, 4), dtype=np.uint8)
  labels = rng.integers(0, 4, 16).astype(np.int32)
  return data.Loader(data.Dataset.from_arrays(images, labels, num_classes=4), 8, shuffle=False)


def _fit(model, **config):
  loader = _loader()
  method = methods.get("clicktrain", mode="one_shot", hard_prune_epoch=2, **config)
  run = methods.Run.from_loader(loader, epochs=2)
  trainer = train.Trainer(
    model, method.make_tx(optax.sgd(0.05), run), callbacks=method.callbacks(run), progress=False
  )
  trainer.fit(loader, epochs=2)
  return trainer


def test_preset_refuses_a_name_based_choice_the_structure_contradicts_before_any_step():
  # Before: the projection named "proj" was kernel-pruned, "shortcut" left dense.
  model = _Net(nnx.Rngs(0))
  with pytest.raises(
    ValueError, match=r"b1/proj/kernel: a 1x1 projection shortcut.*layer_filter_for"
  ):
    _fit(model)
  # With the structural filter the run trains, and the projection stays dense.
  trainer = _fit(_Net(nnx.Rngs(0)), layer_filter=ct.layer_filter_for(model, _SHAPE))
  pruned = ct.find_state(trainer.opt_state).layers
  assert "b1/proj/kernel" not in pruned and "b1/expand/kernel" in pruned
  assert np.all(np.asarray(trainer.model.b1.proj.kernel[...]) != 0)


def test_preset_trains_a_model_whose_shortcut_name_the_default_knows():
  trainer = _fit(_Net(nnx.Rngs(0), shortcut_name="shortcut"))
  assert set(ct.find_state(trainer.opt_state).layers) == {
    "stem/kernel",
    "b1/a/kernel",
    "b1/expand/kernel",
    "b2/a/kernel",
    "b2/expand/kernel",
    "side/kernel",
  }


class _OddKernels(nnx.Module):
  """3x3, 5x5, 3x1 and 1x1 convs (past a 4-channel stem) and a projection named ``proj``."""

  def __init__(self, rngs):
    self.stem = nnx.Conv(4, 8, (3, 3), rngs=rngs)
    self.wide = nnx.Conv(8, 8, (5, 5), rngs=rngs)
    self.tall = nnx.Conv(8, 8, (3, 1), rngs=rngs)
    self.proj = nnx.Conv(8, 8, (1, 1), rngs=rngs)
    self.head = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    x = x + self.proj(nnx.relu(self.tall(nnx.relu(self.wide(x)))))
    return self.head(x.mean((1, 2)))


def _raw(**kw):
  return ct.clicktrain(
    optax.sgd(0.1),
    steps_per_epoch=2,
    hard_prune_epoch=1,
    mode="one_shot",
    one_shot_epoch=0,
    kernel_prune_ratio=0.5,
    **kw,
  )


def _notes(tx, params) -> list[str]:
  """The warnings of ``tx.init(params)``, as text."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tx.init(params)
  return [str(w.message) for w in caught]


def test_other_kernel_sizes_stay_dense_and_are_named_once():
  # ClickTrain's patterns are 4 of a 3x3 kernel's 9 weights (§4.1): a 5x5 conv is no longer
  # cut to 4 of 25, nor a 3x1 pruned, without a word.
  params = nnx.state(_OddKernels(nnx.Rngs(0)), nnx.Param)
  assert ct.default_layer_filter("wide/kernel", (5, 5, 8, 8)) is None
  assert ct.default_layer_filter("tall/kernel", (3, 1, 8, 8)) is None
  assert ct.default_layer_filter("stem/kernel", (3, 3, 4, 8)) == "pattern"
  tx = _raw()
  notes = _notes(tx, params)
  assert any("leaves tall/kernel (3x1), wide/kernel (5x5) dense" in n for n in notes), notes
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    state = tx.init(params)  # said once per transform
    assert set(state.layers) == {"stem/kernel", "proj/kernel"}
    # a layer_filter of one's own decides alone: no word
    _raw(layer_filter=lambda path, shape: "kernel" if len(shape) == 4 else None).init(params)


def test_raw_transform_names_the_1x1_convs_it_prunes_by_name():
  params = nnx.state(_OddKernels(nnx.Rngs(0)), nnx.Param)
  notes = _notes(_raw(), params)
  assert any("prunes the 1x1 convs proj/kernel" in n and "layer_filter_for" in n for n in notes)
  # a 1x1 conv whose name says nothing of a skip path is not named (a bottleneck's conv3)
  assert not name_chosen_projections({"block": {"conv3": {"kernel": np.zeros((1, 1, 8, 8))}}})
  # decided by structure, the name is not the question any more: only the kernel-size note
  by_structure = ct.layer_filter_for(_OddKernels(nnx.Rngs(0)), (1, 8, 8, 4))
  notes = _notes(_raw(layer_filter=by_structure), params)
  assert len(notes) == 1 and "dense: its patterns" in notes[0]
  # the preset checks the name rule against the structure at fit start: no note from it
  tx = methods.get("clicktrain", kernel_prune_ratio=0.5).make_tx(
    optax.sgd(0.1), methods.Run(steps_per_epoch=2, epochs=40)
  )
  assert all("1x1" not in n for n in _notes(tx, params))
