"""ClickTrain through nnx.Optimizer (tiny NNX net; narrow clicktrain-vgg11 as a slow test),
with the mask / FLOPs helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxprune
from jaxprune import models
from jaxprune.clicktrain import readouts


class _TinyNet(nnx.Module):
  def __init__(self, rngs):
    self.stem = nnx.Conv(3, 8, (3, 3), use_bias=False, rngs=rngs)
    self.conv1 = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (1, 1), use_bias=False, rngs=rngs)
    self.head = nnx.Linear(8, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.stem(x))
    x = nnx.relu(self.bn(self.conv1(x)))
    x = nnx.relu(self.conv2(x))
    return self.head(x.mean((1, 2)))


def _model(kind):
  if kind == "tiny":
    return _TinyNet(nnx.Rngs(0)), [0.5, 0.25], (4, 8, 8, 3)
  model = models.create(
    "clicktrain-vgg11", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=1 / 16
  )
  return model, [0.35, 0.45, 0.65, 0.75, 0.8, 0.8, 0.85], (4, 32, 32, 3)


@pytest.mark.parametrize("kind", ["tiny", pytest.param("vgg11", marks=pytest.mark.slow)])
def test_nnx_optimizer_end_to_end(kind):
  model, ratios, shape = _model(kind)
  tx = jaxprune.clicktrain.clicktrain(
    optax.sgd(0.05, momentum=0.9),
    steps_per_epoch=1,
    hard_prune_epoch=4,
    pool_start_epoch=1,
    pool_epochs=1,
    finalize_epochs=1,
    pool_size=8,
    kernel_prune_ratio=ratios,
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=shape), jnp.float32)
  y = jnp.arange(shape[0]) % 10

  @nnx.jit
  def step(model, optimizer, x, y):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads, value=loss)
    return loss

  model.train()
  stages = []
  for _ in range(6):
    step(model, optimizer, x, y)
    stages.append(readouts.stage_name(optimizer.opt_state))
  # stage after each step (transitions at epoch ends; one step per epoch here)
  assert stages == ["pool", "finalize", "regularize", "pruned", "pruned", "pruned"]
  params = nnx.state(model, nnx.Param)
  masks = readouts.masks(optimizer.opt_state, params)
  for w, m in zip(jax.tree.leaves(params), jax.tree.leaves(masks, is_leaf=lambda v: v is None)):
    if m is not None:
      assert np.all(np.asarray(w)[np.asarray(m) == 0] == 0)
  usage = readouts.pattern_usage(optimizer.opt_state)
  assert len(usage[3][0]) <= 8  # every kept kernel uses one of the pool's patterns
  kernels = readouts.kernel_masks(optimizer.opt_state)
  assert len(kernels) == len(ratios)
  for keep, r in zip(kernels.values(), ratios):
    assert (~keep).sum() == int(np.ceil(r * keep.size - 1e-9))
  cr = readouts.compression(optimizer.opt_state, params)
  assert cr == pytest.approx(jaxprune.flops.compression_ratio(params))  # weights really zero
  # hand count: pruned layers keep 4 (3x3) or 1 (1x1) weights per kept kernel
  total = nonzero = 0
  for path, w in jax.tree_util.tree_flatten_with_path(nnx.as_pure(params))[0]:
    if np.ndim(w) != 4:
      continue
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    total += w.size
    nonzero += (
      int(kernels[name].sum()) * min(4, w.shape[0] * w.shape[1]) if name in kernels else w.size
    )
  assert cr == pytest.approx(total / nonzero)
  saved = readouts.flops_saved(model, optimizer.opt_state, (1,) + shape[1:])
  assert 0.3 < saved["inference"] < 1.0 and 0.2 < saved["training"] < saved["inference"] + 0.1
