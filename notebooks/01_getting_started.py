# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Getting started: dense, ClickTrain, PruneTrain and SDGP on the digits
#
# Every pruning method in `jaxprune` is one `jaxprune.methods.Method`: it wraps your Optax
# optimizer (`make_tx`), may swap some layers of the model (`convert`) and may act between
# epochs (`callbacks`). So one training loop serves all of them, the dense baseline included.
# This notebook trains the three papers' methods and the dense baseline on scikit-learn's 8x8
# digits (no download) with the same model, data, optimizer and budget, then compares them.
#
# The method settings are the short-run ones of `jaxprune.quickstart`, which the quickstart
# command (`python -m experiments.run quickstart`) trains too.

# %% tags=["parameters"]
import os

# JAXPRUNE_NOTEBOOK_SMALL=1 (the test suite) runs a tiny setting: ResNet-8, 6 epochs, 512 of
# the training images. The default is the quickstart's: ResNet-20 at half width, 15 epochs,
# all 1 437 training images.
SMALL = os.environ.get("JAXPRUNE_NOTEBOOK_SMALL", "0") == "1"
EPOCHS = 6 if SMALL else 15
DEPTH = 8 if SMALL else 20  # PruneTrain's CIFAR ResNet, depth 6n + 2
TRAIN_IMAGES = 512 if SMALL else None  # a class-balanced subset (None: all 1 437 images)
SEED = 0

# %%
import time

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxprune import data, flops, masking, methods, models, quickstart, train

# %% [markdown]
# ## Data and model
#
# `jaxprune.data.load` returns an in-memory `Dataset`; a `Loader` batches it (and reshuffles
# per epoch from its seed). The model is PruneTrain's CIFAR ResNet at half width with a
# one-channel stem.

# %%
train_set = data.load("digits", split="train").balanced_subset(TRAIN_IMAGES, seed=SEED)
test_set = data.load("digits", split="test")
print(f"{len(train_set)} training and {len(test_set)} test images of shape {train_set.image_shape}")


def build_model() -> nnx.Module:
  spec = models.prunetrain_resnet_spec(DEPTH).scaled(0.5)  # half width
  return models.create(
    "prunetrain-resnet20", spec=spec, in_channels=1, num_classes=10, rngs=nnx.Rngs(SEED)
  )


print(f"ResNet-{DEPTH}: {models.param_count(build_model()):,} parameters")

# %% [markdown]
# ## One loop for every method
#
# `methods.get(name, **config)` builds a method from the registry (`methods.available()` lists
# them). `Run` tells it the length of the run, so a method can place its schedule (ClickTrain's
# stages, PruneTrain's reconfigurations) inside it.

# %%
print("registered methods:", ", ".join(methods.available()))

ROWS = ("dense", "clicktrain", "prunetrain", "sdgp rescaled 2:4")


def train_row(row: str) -> dict:
  registered, config = quickstart.METHODS[row]
  method = methods.get(registered, **config(EPOCHS))
  train_loader = data.Loader(train_set, 64, shuffle=True, seed=SEED, augment=None, drop_last=True)
  test_loader = data.Loader(test_set, 256, shuffle=False, drop_last=False)
  run = methods.Run.from_loader(train_loader, epochs=EPOCHS)
  model = method.convert(build_model())
  inner = quickstart.dense_tx(0.1, 5e-4, run.steps_per_epoch, run.epochs)
  trainer = train.Trainer(
    model, method.make_tx(inner, run), callbacks=method.callbacks(run), progress=False
  )
  start = time.perf_counter()
  history = trainer.fit(train_loader, test_loader, epochs=EPOCHS)
  seconds = time.perf_counter() - start
  return {"history": history, "trainer": trainer, "method": method, "seconds": seconds}


results = {}
for row in ROWS:
  results[row] = train_row(row)
  print(f"{row}: test accuracy {results[row]['history'][-1]['test_acc']:.2%}")

# %% [markdown]
# ## Compared in a table
#
# Compression counts conv weights: the dense model's conv weights over the nonzero conv
# weights of the final model. ClickTrain zeroes weights inside the kernels (its masks, read
# from the optimizer state); PruneTrain removes whole channels, so its model is smaller; SDGP
# prunes data gradients, not weights, so its model stays dense. The training FLOPs of one
# image count only kept weights (`masking.find_masks` finds ClickTrain's masks in the
# optimizer state); for SDGP they are what N:M sparse hardware would run, with the
# data-gradient convolutions at density n/m.

# %%
image = (1, *train_set.image_shape)


def conv_nonzeros(model: nnx.Module) -> int:
  params = nnx.state(model, nnx.Param)
  return sum(int(np.count_nonzero(p)) for p in jax.tree.leaves(params) if p.ndim == 4)


dense_conv_weights = conv_nonzeros(build_model())

print("| method | test acc | compression | training MFLOPs / image | train time (s) |")
print("|---|---:|---:|---:|---:|")
summary = {}
for row, result in results.items():
  trainer, config = result["trainer"], result["method"].config
  model = trainer.model
  compression = dense_conv_weights / conv_nonzeros(model)
  mflops = 1e-6 * flops.training_flops_per_step(
    model,
    image,
    masks=masking.find_masks(trainer.opt_state, trainer.params),
    backward_data_density=config["n"] / config["m"] if result["method"].name == "sdgp" else 1.0,
  )
  summary[row] = (result["history"][-1]["test_acc"], compression)
  print(
    f"| {row} | {summary[row][0]:.2%} | {compression:.2f}x | {mflops:.3f} "
    f"| {result['seconds']:.1f} |"
  )

# %% [markdown]
# ## And in a plot
#
# Test accuracy after every epoch. ClickTrain's hard prune zeroes the pruned weights at once;
# its preset then re-estimates the BatchNorm statistics from 10 training batches
# (`clicktrain.HardPruneBatchNorm`), without which that epoch scored about 15% (the running
# averages still described the dense weights). What dip remains is the prune itself, recovered
# by the next epoch. PruneTrain's dips are its reconfigurations.

# %%
fig, (ax_curve, ax_bar) = plt.subplots(1, 2, figsize=(11, 4))
for row, result in results.items():
  epochs = [r["epoch"] for r in result["history"]]
  ax_curve.plot(epochs, [r["test_acc"] for r in result["history"]], marker="o", label=row)
ax_curve.set(xlabel="epoch", ylabel="test accuracy", title="Accuracy during training")
ax_curve.legend()
ax_bar.bar(list(summary), [c for _, c in summary.values()], color="tab:gray")
ax_bar.set(ylabel="conv compression (x)", title="Conv weights removed")
ax_bar.tick_params(axis="x", rotation=20)
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Next
#
# One notebook per paper walks its mechanism: `02_clicktrain.ipynb` (patterns, votes, masks),
# `03_prunetrain.ipynb` (channels and FLOPs over training) and `04_sdgp.ipynb` (N:M gradient
# pruning and the time model).
