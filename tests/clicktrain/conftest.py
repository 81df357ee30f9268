"""Shared pieces of the ClickTrain transform tests (a fixture, so ``--import-mode=importlib``
works): a toy param tree and loss, fake gradients, one paper-mode run, the released rule."""

import functools
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxprune.clicktrain import transform as ct


def _params(seed=0):
  rng = np.random.default_rng(seed)
  n = lambda *shape, scale: jnp.asarray(rng.normal(size=shape) * scale, jnp.float32)
  return {
    "stem": {"kernel": n(3, 3, 3, 6, scale=0.3)},
    "block": {
      "conv1": {"kernel": n(3, 3, 6, 8, scale=0.2)},
      "conv2": {"kernel": n(1, 1, 8, 8, scale=0.3)},
      "shortcut": {"kernel": n(1, 1, 6, 8, scale=0.3)},
    },
    "head": {"kernel": n(8, 3, scale=0.3), "bias": jnp.zeros(3)},
  }


def _conv(x, w):
  return jax.lax.conv_general_dilated(
    x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


def _loss(p, x, y):
  h = jax.nn.relu(_conv(x, p["stem"]["kernel"]))
  b = jax.nn.relu(_conv(h, p["block"]["conv1"]["kernel"]))
  b = _conv(b, p["block"]["conv2"]["kernel"]) + _conv(h, p["block"]["shortcut"]["kernel"])
  logits = jax.nn.relu(b).mean((1, 2)) @ p["head"]["kernel"] + p["head"]["bias"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _batch(i):
  rng = np.random.default_rng(100 + i)
  return jnp.asarray(rng.normal(size=(8, 6, 6, 3)), jnp.float32), jnp.arange(8) % 3


def _fake_grads(params, i):
  rng = np.random.default_rng(1000 + i)
  return jax.tree.map(lambda l: jnp.asarray(rng.normal(size=l.shape), l.dtype), params)


CONV1, CONV2 = "block/conv1/kernel", "block/conv2/kernel"


# One shared paper-mode run (fixed params, fake gradients, identity inner optimizer so
# that the emitted update is the modified gradient): epoch 0 = DPPG, epochs 1-2 =
# finalization, then regularization. Batch 3's loss rises 10% -> it must not vote.
LOSSES = [1.0, 1.0, 0.9, 0.99, 0.98, 0.97]
RATIOS = (0.25, 0.55)  # conv1, conv2 in flatten order
LAMBDA = 0.01


def _paper_tx(**kw):
  """The paper-mode schedule of the shared run (pool, finalization, then regularizing from
  step 6), identity inner; ``kw``: further ``clicktrain`` keywords (the aligned mode's)."""
  return ct.clicktrain(
    optax.identity(),
    steps_per_epoch=2,
    hard_prune_epoch=50,
    pool_start_epoch=0,
    pool_epochs=1,
    finalize_epochs=2,
    pool_size=5,
    kernel_prune_ratio=RATIOS,
    group_lasso_coefficient=LAMBDA,
    **kw,
  )


def _pruning_tx(inner):
  """Paper mode on a short schedule around ``inner``: 2 steps per epoch, one epoch each of
  warm-up, pool and finalization, the hard prune at the end of epoch 4, half the kernels."""
  return ct.clicktrain(
    inner,
    steps_per_epoch=2,
    hard_prune_epoch=4,
    pool_start_epoch=1,
    pool_epochs=1,
    finalize_epochs=1,
    pool_size=6,
    kernel_prune_ratio=0.5,
  )


def _run(tx, steps=7):
  """``tx`` on the toy params for ``steps`` steps of falling loss: ``(params, states (the
  initial one first), last update)``."""
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  states, out = [st], None
  for i in range(steps):
    out, st = update(_fake_grads(p, i), st, p, value=jnp.float32(1.0 - 0.01 * i))
    states.append(st)
  return p, states, out


def _one_shot_tx(filter_groups, **kw):
  """The one_shot rule picking its masks at the first step and pruning at the second, inner
  SGD at rate 0; ``kw``: further ``clicktrain`` keywords (ratios, the filter grouping)."""
  return ct.clicktrain(
    optax.sgd(0.0),
    steps_per_epoch=1,
    hard_prune_epoch=2,
    mode="one_shot",
    one_shot_epoch=0,
    filter_groups=filter_groups,
    **kw,
  )


@functools.lru_cache(maxsize=None)
def _paper_run():
  tx = _paper_tx()
  p = _params()
  st = tx.init(p)
  update = jax.jit(tx.update)
  states = [st]
  for i, l in enumerate(LOSSES):
    _, st = update(_fake_grads(p, i), st, p, value=jnp.float32(l))
    states.append(st)
  return update, p, states


# The released code's pattern table, transcribed from it (rows top -> bottom); a pool of
# 4, 8 or 12 is its head.
_RELEASED_TABLE = (
  "000/011/011", "000/110/110", "011/011/000", "110/110/000",
  "000/001/111", "000/111/010", "010/011/010", "010/110/010",
  "111/010/000", "000/100/111", "111/100/000", "000/101/011",
)  # fmt: skip


def _one_shot_reference(w, g, ratio, num_patterns=4):
  """NumPy re-implementation of the released code's rule on one batch."""
  w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
  blocks = [
    np.array([[c == "1" for c in r] for r in s.split("/")], float)
    for s in _RELEASED_TABLE[:num_patterns]
  ]
  kh, kw, cin, cout = w.shape
  pat = np.zeros((cin, cout), int)
  ks = np.zeros((cin, cout))
  for c in range(cin):
    for f in range(cout):
      t = g[:, :, c, f] * w[:, :, c, f]
      scores = [np.sum((t * b) ** 2) for b in blocks]
      pat[c, f] = int(np.argmax(scores))
      ks[c, f] = np.sum(t**2)
  n_pruned = math.ceil(ratio * cin * cout)
  flat = sorted(range(cin * cout), key=lambda i: (ks.ravel()[i], i))[:n_pruned]
  keep = np.ones(cin * cout, bool)
  keep[flat] = False
  mask = np.stack([blocks[i] for i in pat.ravel()]).reshape(cin, cout, 3, 3)
  return pat, keep.reshape(cin, cout), np.moveaxis(mask, (2, 3), (0, 1)) * keep.reshape(cin, cout)


@pytest.fixture
def kit(optax_train_step):
  """The transform tests' toy params, batches and gradients, the shared paper-mode run and the
  NumPy reference of the released one-shot rule."""
  return types.SimpleNamespace(
    params=_params,
    loss=_loss,
    batch=_batch,
    fake_grads=_fake_grads,
    # the jitted training step of a transform on the toy loss: train_step(tx)(p, st, x, y)
    train_step=lambda tx: optax_train_step(_loss, tx),
    pruning_tx=_pruning_tx,
    CONV1=CONV1,
    CONV2=CONV2,
    paper_run=_paper_run,
    paper_tx=_paper_tx,
    one_shot_tx=_one_shot_tx,
    run=_run,
    LOSSES=LOSSES,
    RATIOS=RATIOS,
    LAMBDA=LAMBDA,
    one_shot_reference=_one_shot_reference,
  )
