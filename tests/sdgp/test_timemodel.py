"""The parts of SDGP's time model (``jaxprune.sdgp.timemodel``) and the interleaved timing
(``jaxprune.timing.interleaved_times``) that measure them."""

import jax
from flax import nnx

from jaxprune import models
from jaxprune.sdgp import timemodel
from jaxprune.timing import interleaved_times


def test_timemodel_records_every_conv_with_its_shapes():
  model = models.create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.125)
  layers = timemodel.conv_layers(model, (2, 32, 32, 3))
  convs = [c for _, c in nnx.iter_modules(model) if isinstance(c, nnx.Conv)]
  assert len(layers) == len(convs) == 8
  assert layers[0]["lhs"] == (2, 32, 32, 3)  # the stem runs first
  for layer in layers:
    assert layer["lhs"][-1] == layer["rhs"][-2]  # input channels match the kernel
  # the recorder was removed again
  assert all(
    c.conv_general_dilated is not None
    and not isinstance(c.conv_general_dilated, timemodel._ConvRecorder)
    for c in convs
  )


def test_each_layer_has_its_three_parts_but_the_stem_no_data_gradient():
  model = models.create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.125)
  stem, second = timemodel.conv_layers(model, (2, 32, 32, 3))[:2]
  assert set(timemodel.layer_jobs(stem, jax.random.key(0))) == {"forward", "weight_grad"}
  jobs = timemodel.layer_jobs(second, jax.random.key(1))
  assert set(jobs) == {"forward", "input_grad", "weight_grad"}
  fn, args = jobs["input_grad"]
  assert fn(*args).shape == second["lhs"]  # dX has the input's shape
  times = interleaved_times(jobs, rounds=2)
  assert set(times) == set(jobs) and all(t > 0 for t in times.values())
