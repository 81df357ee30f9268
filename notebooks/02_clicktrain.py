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
# # ClickTrain: patterns, votes and masks
#
# ClickTrain (Zhang et al., ICS 2021, https://arxiv.org/abs/2011.10170) prunes during training:
# every 3x3 kernel keeps 4 of its 9 weights in one of a small pool of *patterns*, and a
# fraction of whole kernels is removed (*connectivity* pruning). It runs as a stage machine
# over epochs: dense warm-up, pattern pool generation (DPPG, §4.2), adaptive finalization by
# votes (§4.3), group-lasso regularization (§4.4), then the hard prune.
#
# `jaxprune.clicktrain.clicktrain` is an Optax wrapper around your optimizer that runs those
# stages inside `jit`; the read-outs (`clicktrain.masks`, `stage_name`, `pattern_usage`,
# `compression`, `flops_saved`, `find_state`) find its state inside any optimizer state.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("JAXPRUNE_NOTEBOOK_SMALL", "0") == "1"
EPOCHS = 6 if SMALL else 15
DEPTH = 8 if SMALL else 20  # PruneTrain's CIFAR ResNet, depth 6n + 2
TRAIN_IMAGES = 512 if SMALL else None  # a class-balanced subset (None: all 1 437 images)
KERNEL_PRUNE_RATIO = 0.5  # fraction of kernels removed per layer
SWEEP_RATIOS = () if SMALL else (0.25, 0.65, 0.8)  # more runs for compression vs accuracy
SEED = 0

# %%
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxprune import clicktrain, data, methods, models, quickstart, train
from jaxprune.paths import flatten_with_paths, path_string

# %% [markdown]
# ## The pattern space and the released library
#
# A pattern keeps 4 of the 9 positions of a 3x3 kernel: there are C(9, 4) = 126 of them
# (`clicktrain.all_patterns()`). The authors' released code ships 12 (`library_patterns()`);
# its one-shot mode uses the first four, the 2x2 blocks around the centre. The paper's mode
# instead *generates* a pool from the gradients (DPPG), shown further down.

# %%
print(f"{len(clicktrain.all_patterns())} patterns of 4 in a 3x3 kernel")


def show_patterns(patterns, title, labels=None):
  fig, axes = plt.subplots(1, len(patterns), figsize=(1.1 * len(patterns), 1.5), squeeze=False)
  for i, (ax, pattern) in enumerate(zip(axes[0], patterns)):
    ax.imshow(pattern, cmap="Greys", vmin=0, vmax=1)
    ax.set_xticks([]), ax.set_yticks([])
    if labels is not None:
      ax.set_title(labels[i], fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  plt.show()


show_patterns(clicktrain.library_patterns(), "The released library (12 patterns)")

# %% [markdown]
# ## Train with ClickTrain
#
# Through `jaxprune.methods`, with the quickstart's stage schedule compressed into the run:
# pool generation and finalization one fifth of the run each, the hard prune at two thirds.
# The trainer records the stage and the compression after every epoch.

# %%
train_set = data.load("digits", split="train").balanced_subset(TRAIN_IMAGES, seed=SEED)
test_set = data.load("digits", split="test")


def build_model() -> nnx.Module:
  spec = models.prunetrain_resnet_spec(DEPTH).scaled(0.5)  # half width
  return models.create(
    "prunetrain-resnet20", spec=spec, in_channels=1, num_classes=10, rngs=nnx.Rngs(SEED)
  )


def train_clicktrain(ratio: float) -> train.Trainer:
  config = {**quickstart.METHODS["clicktrain"][1](EPOCHS), "kernel_prune_ratio": ratio}
  method = methods.get("clicktrain", **config)
  train_loader = data.Loader(train_set, 64, shuffle=True, seed=SEED, augment=None, drop_last=True)
  run = methods.Run.from_loader(train_loader, epochs=EPOCHS)
  inner = quickstart.dense_tx(0.1, 5e-4, run.steps_per_epoch, run.epochs)
  trainer = train.Trainer(
    build_model(),
    method.make_tx(inner, run),
    metrics={
      "stage": lambda t: clicktrain.stage_name(t.opt_state),
      "compression": lambda t: clicktrain.compression(t.opt_state, t.params),
    },
    progress=False,
  )
  trainer.fit(
    train_loader, data.Loader(test_set, 256, shuffle=False, drop_last=False), epochs=EPOCHS
  )
  return trainer


trainer = train_clicktrain(KERNEL_PRUNE_RATIO)
for record in trainer.history:
  print(
    f"epoch {record['epoch']:2d}  stage {record['stage']:<10s}  "
    f"compression {record['compression']:5.2f}x  test acc {record['test_acc']:.2%}"
  )

# %% [markdown]
# ## The pattern pool (DPPG, §4.2)
#
# During the pool stage every kernel proposes a candidate pattern each batch (grown from its
# most important weights, importance (g·w)², Eq. 1) and the candidate gets a competitive score.
# The `pool_size` best-scored patterns over all layers form one global pool.

# %%
state = clicktrain.find_state(trainer.opt_state)
pattern_layers = {name: layer for name, layer in state.layers.items() if layer.pool is not None}
first = next(iter(pattern_layers.values()))
pool = np.asarray(first.pool)
scores = np.asarray(first.competitive_scores)
table = clicktrain.all_patterns()
show_patterns(table[pool], "The generated pool", labels=[f"#{i}" for i in pool])
top = np.argsort(-scores)[:20]
plt.figure(figsize=(9, 2.5))
plt.bar(range(len(top)), scores[top], color=["tab:green" if i in pool else "tab:gray" for i in top])
plt.xticks(range(len(top)), [f"#{i}" for i in top], rotation=90, fontsize=7)
plt.ylabel("competitive score")
plt.title("The 20 best-scored candidates of the first pattern layer (green: in the pool)")
plt.show()

# %% [markdown]
# ## Votes and finalization (§4.3)
#
# In the finalization stage every kernel votes each batch for the pool pattern that keeps
# most of its importance (unless the loss rose by more than the margin δ); its most voted
# pattern becomes final. Kernels are ranked by their summed Eq. 2 scores and the lowest
# `KERNEL_PRUNE_RATIO` of each layer are removed.

# %%
votes = {name: np.asarray(layer.votes).sum(axis=(0, 1)) for name, layer in pattern_layers.items()}
fig, ax = plt.subplots(figsize=(9, 3))
bottom = np.zeros(len(pool))
for name, counts in votes.items():
  ax.bar(range(len(pool)), counts, bottom=bottom, label=name)
  bottom += counts
ax.set_xticks(range(len(pool)), [f"#{i}" for i in pool])
ax.set(xlabel="pool pattern", ylabel="votes", title="Votes per pool pattern, stacked by layer")
ax.legend(fontsize=6, ncol=2)
plt.show()

for size, (ids, counts) in clicktrain.pattern_usage(trainer.opt_state).items():
  print(f"{size}x{size} kernels kept per final pattern:", dict(zip(ids.tolist(), counts.tolist())))

# %% [markdown]
# ## Per-layer sparsity
#
# `clicktrain.masks` gives the weight mask (pattern x kernel) of every pruned layer; the stem
# (it reads the image) and the 1x1 shortcut convs stay dense.

# %%
params = nnx.state(trainer.model, nnx.Param)
weight_masks = clicktrain.masks(trainer.opt_state, params)
masks_by_layer = {
  path_string(path): np.asarray(mask)
  for path, mask in flatten_with_paths(weight_masks)
  if mask is not None
}
conv_layers = [
  path_string(path) for path, p in flatten_with_paths(nnx.as_pure(params)) if p.ndim == 4
]
sparsity = [1 - masks_by_layer[n].mean() if n in masks_by_layer else 0.0 for n in conv_layers]
plt.figure(figsize=(9, 3))
plt.bar(range(len(conv_layers)), sparsity)
plt.xticks(range(len(conv_layers)), conv_layers, rotation=90, fontsize=7)
plt.ylabel("fraction of weights pruned")
plt.title(f"Per-layer sparsity (kernel prune ratio {KERNEL_PRUNE_RATIO})")
plt.show()

# %% [markdown]
# ## The masks of a few kernels
#
# Each square is one 3x3 kernel `W[:, :, c, f]` of a pruned layer: its weights (colour) where
# the mask keeps them. An all-white square is a kernel removed by connectivity pruning.

# %%
layer = next(iter(pattern_layers))
named = {path_string(path): np.asarray(p) for path, p in flatten_with_paths(nnx.as_pure(params))}
kernel, mask = named[layer], masks_by_layer[layer]
fig, axes = plt.subplots(3, 8, figsize=(9, 3.6))
limit = np.abs(kernel).max()
for i, ax in enumerate(axes.flat):
  c, f = divmod(i, 8)
  shown = np.where(mask[:, :, c, f] > 0, kernel[:, :, c, f], np.nan)
  ax.imshow(shown, cmap="coolwarm", vmin=-limit, vmax=limit)
  ax.set_xticks([]), ax.set_yticks([])
  ax.set_title(f"c{c} f{f}", fontsize=7)
fig.suptitle(f"{layer}: kernels of input channels 0-2, filters 0-7")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Compression vs accuracy
#
# More runs at other kernel prune ratios: a 3x3 kernel with a pattern keeps 4/9 of its
# weights (2.25x), and removing a fraction p of the kernels multiplies that by 1/(1-p).
# `clicktrain.flops_saved` gives the training and inference FLOPs saved per step once pruned
# (ClickTrain Table 1's columns).

# %%
image = (1, *train_set.image_shape)
runs = {KERNEL_PRUNE_RATIO: trainer}
for ratio in SWEEP_RATIOS:
  runs[ratio] = train_clicktrain(ratio)

print(
  "| kernel prune ratio | compression | test acc | training FLOPs saved | inference FLOPs saved |"
)
print("|---:|---:|---:|---:|---:|")
points = []
for ratio in sorted(runs):
  t = runs[ratio]
  saved = clicktrain.flops_saved(t.model, t.opt_state, image)
  last = t.history[-1]
  points.append((last["compression"], last["test_acc"], ratio))
  print(
    f"| {ratio} | {last['compression']:.2f}x | {last['test_acc']:.2%} "
    f"| {saved['training']:.1%} | {saved['inference']:.1%} |"
  )

plt.figure(figsize=(5, 3.5))
plt.plot([p[0] for p in points], [p[1] for p in points], marker="o")
for compression, accuracy, ratio in points:
  plt.annotate(f"p={ratio}", (compression, accuracy), fontsize=8)
plt.xlabel("conv compression (x)")
plt.ylabel("test accuracy")
plt.title("ClickTrain: compression vs accuracy")
plt.show()
