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
# # PruneTrain: channels, FLOPs and step time over training
#
# PruneTrain (Lym et al., SC 2019, https://arxiv.org/abs/1901.09290) adds a channel group
# lasso to the loss (Eq. 2, with λ set from a penalty ratio at the first step, Eq. 3), so
# whole channels shrink to zero during training. Every few epochs it *reconfigures* the
# network (§4.2): the dead channels (and any residual branch left empty) are cut out, the
# model is rebuilt smaller, and training goes on with fewer FLOPs per step.
#
# In `jaxprune` the penalty is an Optax wrapper (`prunetrain.with_group_lasso`) and the
# reconfiguration a trainer callback (`prunetrain.PruneTrainCallback`), which also accounts
# the costs (`jaxprune.flops`) of the model that trained each epoch; `methods.get("prunetrain")`
# builds both.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("JAXPRUNE_NOTEBOOK_SMALL", "0") == "1"
EPOCHS = 6 if SMALL else 15
RECONFIGURE_EVERY = 2 if SMALL else 3  # epochs
THRESHOLD = 0.02  # a channel is dead when every weight of its group is below this
DEPTH = 8 if SMALL else 20  # PruneTrain's CIFAR ResNet, depth 6n + 2
STEP_TIME_ROUNDS = 3 if SMALL else 20  # timed train steps per model (the minimum is shown)
SEED = 0

# %%
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxprune import data, flops, methods, models, prunetrain, quickstart, train

# %% [markdown]
# ## Train with PruneTrain
#
# The quickstart's settings for a short run (a penalty ratio of 0.9: the paper's 0.2 kills
# few channels in a few epochs), with a dead-channel threshold of 0.02 and a reconfiguration
# every `RECONFIGURE_EVERY` epochs (at the quickstart's 0.01 and every fifth epoch, ResNet-20
# loses no channel in 15 epochs: they die late, as the learning rate decays). Two extra
# per-epoch records: the width of every layer after the epoch, and the time of one training
# step of the model that trains next (timed outside the epoch, so the recompilation after a
# reconfiguration is not counted).

# %%
train_set = data.load("digits", split="train")
test_set = data.load("digits", split="test")
image = (1, *train_set.image_shape)
spec = models.prunetrain_resnet_spec(DEPTH).scaled(0.5)  # half width
model = models.create(
  "prunetrain-resnet20", spec=spec, in_channels=1, num_classes=10, rngs=nnx.Rngs(SEED)
)
dense_spec = model.spec

config = quickstart.METHODS["prunetrain"][1](EPOCHS)
config.update(every_epochs=RECONFIGURE_EVERY, threshold=THRESHOLD)
method = methods.get("prunetrain", **config)
train_loader = data.Loader(train_set, 64, shuffle=True, seed=SEED, augment=None, drop_last=True)
run = methods.Run.from_loader(train_loader, epochs=EPOCHS)
batch = next(iter(data.Loader(train_set, 64, shuffle=False)))


def step_seconds(trainer: train.Trainer) -> float:
  """Fastest of a few training steps of the trainer's current model on one fixed batch.

  The step donates its inputs, so every call gets its own copy of the trainer's state; the
  first call compiles the step for the current model (and is never the fastest)."""
  images, labels = jnp.asarray(batch[0]), jnp.asarray(batch[1])
  best = float("inf")
  for _ in range(STEP_TIME_ROUNDS + 1):
    state = train.TrainState.start(trainer.params, trainer.rest, trainer.opt_state)
    state = jax.block_until_ready(jax.tree.map(jnp.copy, state))
    start = time.perf_counter()
    jax.block_until_ready(trainer.steps.train(state, images, labels))
    best = min(best, time.perf_counter() - start)
  return best


trainer = train.Trainer(
  model,
  method.make_tx(quickstart.dense_tx(0.1, 5e-4, run.steps_per_epoch, run.epochs), run),
  callbacks=method.callbacks(run),
  metrics={"widths": lambda t: t.model.spec.layer_widths(), "step_s": step_seconds},
  progress=False,
)
dense_step_s = step_seconds(trainer)
history = trainer.fit(
  train_loader, data.Loader(test_set, 256, shuffle=False, drop_last=False), epochs=EPOCHS
)
for r in history:
  print(
    f"epoch {r['epoch']:2d}  test acc {r['test_acc']:.2%}  reconfigured "
    f"{r.get('pt_reconfigured', '-')!s:5s}  params {r['pt_params']:,.0f}"
  )

# %% [markdown]
# ## Channels per layer over epochs
#
# Epoch 0 is the dense model. A layer that drops to zero was removed together with its
# residual branch.

# %%
layers = list(dense_spec.layer_widths())
widths = [dense_spec.layer_widths()] + [r["widths"] for r in history]
grid = np.array([[w.get(name, 0) for w in widths] for name in layers])
fig, ax = plt.subplots(figsize=(7, 0.28 * len(layers) + 1.5))
im = ax.imshow(grid, aspect="auto", cmap="viridis")
for (i, j), value in np.ndenumerate(grid):
  ax.text(j, i, str(value), ha="center", va="center", fontsize=7, color="w")
ax.set_yticks(range(len(layers)), layers, fontsize=7)
ax.set_xticks(range(len(widths)))
ax.set(xlabel="epoch", title="Output channels per layer")
fig.colorbar(im)
plt.show()

# %% [markdown]
# ## FLOPs and step time over epochs
#
# Per image: the inference FLOPs of the model that trained each epoch and its training FLOPs
# (forward + both backward convolutions, `flops.training_flops_per_step`); the callback also
# integrates training FLOPs over the run (`pt_train_flops_ratio`: the run so far relative to a
# dense run of the same length, PruneTrain Table 1's "training FLOPs"). Step time is
# measured on this machine at a fixed batch of 64 (on a busy machine it is noisy; on a CPU a
# small model's step is dominated by per-op overhead more than by FLOPs).

# %%
epochs = [r["epoch"] for r in history]
fig, (ax_flops, ax_time) = plt.subplots(1, 2, figsize=(11, 3.5))
ax_flops.plot(epochs, [r["pt_inference_flops"] / 1e6 for r in history], marker="o")
ax_flops.set(xlabel="epoch", ylabel="inference MFLOPs per image", title="FLOPs")
ax_run = ax_flops.twinx()
ax_run.plot(epochs, [r["pt_train_flops_ratio"] for r in history], marker="s", color="tab:orange")
ax_run.set_ylabel("training FLOPs so far / dense run", color="tab:orange")
ax_time.plot([0] + epochs, [1e3 * dense_step_s] + [1e3 * r["step_s"] for r in history], marker="o")
ax_time.set(xlabel="after epoch", ylabel="ms per step (batch 64)", title="Training step time")
fig.tight_layout()
plt.show()
print(
  f"training FLOPs of the run: {history[-1]['pt_train_flops_ratio']:.1%} of a dense run; "
  f"final step time {history[-1]['step_s'] / dense_step_s:.0%} of the dense step"
)

# %% [markdown]
# ## The reconfigured architecture
#
# Each reconfiguration's report says what it removed; the final model is an ordinary
# `ResNet` built from a smaller spec (`model.spec`), so it trains, saves and runs like any
# other. `flops.format_table` lists its layers.

# %%
callback = next(c for c in trainer.callbacks if isinstance(c, prunetrain.PruneTrainCallback))
for i, report in enumerate(callback.reports, 1):
  removed = {name: n for name, n in report.channels_removed.items() if n}
  print(
    f"reconfiguration {i}: {sum(removed.values())} channels removed, "
    f"{len(report.removed_branches)} branches removed, "
    f"params {report.params_before:,} -> {report.params_after:,}"
  )
print("\ndense spec:", dense_spec)
print("final spec:", trainer.model.spec)
print()
print(flops.format_table(flops.layer_flops(trainer.model, image)))
