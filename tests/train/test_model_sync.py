"""The module handed to ``Trainer`` stays usable after ``fit`` (the step donates buffers)."""

import numpy as np
import optax
from flax import nnx

from jaxprune import data, train


class _TinyNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv(x)).mean(axis=(1, 2)))


def test_model_passed_to_trainer_holds_the_trained_weights_after_fit():
  rng = np.random.default_rng(0)
  dataset = data.Dataset.from_arrays(
    rng.integers(0, 256, (48, 6, 6, 1), dtype=np.uint8),
    rng.integers(0, 3, 48).astype(np.int32),
    num_classes=3,
  )
  model = _TinyNet(nnx.Rngs(0))
  before = np.asarray(model.conv.kernel[...]).copy()
  trainer = train.Trainer(model, optax.sgd(0.5), progress=False)
  trainer.fit(data.Loader(dataset, 16, seed=0), epochs=2)
  after = np.asarray(model.conv.kernel[...])  # raises if the arrays were donated and not synced
  assert not np.array_equal(before, after)
  np.testing.assert_array_equal(after, np.asarray(trainer.model.conv.kernel[...]))
  x = np.zeros((2, 6, 6, 1), np.float32)
  np.testing.assert_allclose(np.asarray(model(x)), np.asarray(trainer.model(x)))
  # A second trainer can start from it (fine-tuning after a first run).
  train.Trainer(model, optax.sgd(0.1), progress=False).fit(
    data.Loader(dataset, 16, seed=1), epochs=1
  )
