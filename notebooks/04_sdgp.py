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
# # SDGP: N:M pruning of the data gradient
#
# SDGP (McDanel, Dinh and Magallanes, 2022, https://arxiv.org/abs/2202.00774) leaves the
# weights and the forward pass alone. In the backward pass of each convolution it keeps
# `n` of every `m` consecutive channels of the output gradient dL/dO (Algorithm 1), so the
# data-gradient convolution dX = dO ⊛ rot180(W) could run on N:M sparse hardware; the
# weight gradient dW still uses the dense dL/dO (§III-A).
#
# `jaxprune.sdgp.nm_prune` prunes a tensor; `sdgp.convert_model` (or `methods.get("sdgp")`)
# swaps a model's convolutions for ones with that backward pass. This notebook looks at one
# real output gradient before and after pruning, at how biased and noisy each pruning method
# is, and at the time model behind the paper's projected speed-ups (§IV-C, Fig. 9/10).

# %% tags=["parameters"]
import os

SMALL = os.environ.get("JAXPRUNE_NOTEBOOK_SMALL", "0") == "1"
DEPTH = 8 if SMALL else 20  # PruneTrain's CIFAR ResNet, depth 6n + 2
DRAWS = 16 if SMALL else 500  # random draws per method for the bias / variance estimate
TIME_ROUNDS = 2 if SMALL else 20  # timed rounds of every conv part (the minimum is kept)
TIMED_LAYERS = 2 if SMALL else None  # time the first few conv layers only (None: all)
BATCH = 64
SEED = 0

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax
from flax import nnx

from jaxprune import data, flops, models, sdgp
from jaxprune.sdgp.timemodel import conv_layers, layer_jobs
from jaxprune.timing import interleaved_times

# %% [markdown]
# ## A real output gradient
#
# One batch of digits through PruneTrain's ResNet at half width. To get dL/dO of one
# convolution, a zero *probe* is added to its output: the gradient of the loss with respect
# to the probe is the gradient with respect to the output.

# %%
train_set = data.load("digits", split="train")
images, labels = next(iter(data.Loader(train_set, BATCH, shuffle=True, seed=SEED)))
images, labels = jnp.asarray(images), jnp.asarray(labels)
spec = models.prunetrain_resnet_spec(DEPTH).scaled(0.5)  # half width
model = models.create(
  "prunetrain-resnet20", spec=spec, in_channels=1, num_classes=10, rngs=nnx.Rngs(SEED)
)
layers = flops.layer_flops(model, images.shape)
LAYER = "stages/1/0/conv2/conv/kernel"  # a 3x3 conv of the second stage


def output_gradient(model: nnx.Module, conv_path: str) -> jax.Array:
  """dL/dO of the conv whose kernel is ``conv_path`` (mean cross-entropy of the batch,
  BatchNorm in training mode, as in a training step)."""
  module_path = tuple(int(p) if p.isdigit() else p for p in conv_path.split("/")[:-1])
  shape = next(layer.output_shape for layer in layers if layer.name == conv_path)

  def loss(probe, model):
    conv = dict(nnx.iter_modules(model))[module_path]  # the copy nnx.grad traces
    original = conv.conv_general_dilated
    conv.conv_general_dilated = lambda *args, **kwargs: original(*args, **kwargs) + probe
    try:
      logits = model(images)
    finally:
      conv.conv_general_dilated = original
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return nnx.jit(nnx.grad(loss))(jnp.zeros(shape), model)


grad = output_gradient(model, LAYER)
print(f"dL/dO of {LAYER}: shape {grad.shape} (batch, height, width, channels)")

# %% [markdown]
# ## Before and after N:M pruning
#
# Groups are `m` consecutive channels at one (sample, row, column). Below: one sample's
# gradient as positions x channels, dense and after 2:4 pruning by each method. Magnitude
# keeps the two largest of each group of four; rescaled magnitude then scales each
# (sample, channel) back to its L1 norm (SDGP §III-B, the paper's best); random keeps a
# random two; MVUE (Chmiel et al., ICLR 2023) keeps one per pair with probability
# proportional to magnitude and rescales it so the result is unbiased.

# %%
N, M = 2, 4
key = jax.random.key(SEED)
sample = grad[0].reshape(-1, grad.shape[-1])  # (positions, channels)
panels = {"dense dL/dO": sample}
for method in sdgp.METHODS:
  pruned = sdgp.nm_prune(grad, N, M, method, key=key)
  panels[f"{method} {N}:{M}"] = pruned[0].reshape(sample.shape)
limit = float(jnp.abs(sample).max())
fig, axes = plt.subplots(1, len(panels), figsize=(2.3 * len(panels), 3.6))
for ax, (title, values) in zip(axes, panels.items()):
  shown = np.where(np.asarray(values) == 0, np.nan, np.asarray(values))
  ax.imshow(shown, cmap="coolwarm", vmin=-limit, vmax=limit, aspect="auto")
  ax.set_title(title, fontsize=8)
  ax.set_xlabel("channel")
axes[0].set_ylabel("position (row-major)")
fig.suptitle("One sample's output gradient; white = pruned")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Bias and variance of each method
#
# Over `DRAWS` random keys, for the pruned gradient P of the true gradient G:
# relative bias ‖E[P] − G‖ / ‖G‖ and relative variance E‖P − E[P]‖² / ‖G‖². The
# deterministic methods have no variance but a bias; MVUE is unbiased at the cost of variance;
# random is both (it does not rescale). E[P] is a mean over `DRAWS` draws, so for the random
# methods the bias column carries sampling noise of about √(variance / DRAWS) (the last
# column): a bias at that level is no bias.

# %%
keys = jax.random.split(key, DRAWS)
norm = float(jnp.linalg.norm(grad))
rows = []
for n, m in ((2, 4), (1, 4)):
  for method in sdgp.METHODS:
    draws = jnp.stack([sdgp.nm_prune(grad, n, m, method, key=k) for k in keys])
    mean = draws.mean(axis=0)
    bias = float(jnp.linalg.norm(mean - grad)) / norm
    variance = float(jnp.mean(jnp.sum((draws - mean) ** 2, axis=(1, 2, 3, 4)))) / norm**2
    rows.append((f"{n}:{m}", method, bias, variance))

print("| n:m | method | relative bias | relative variance | noise of the bias estimate |")
print("|---|---|---:|---:|---:|")
for nm, method, bias, variance in rows:
  print(f"| {nm} | {method} | {bias:.3f} | {variance:.3f} | {(variance / DRAWS) ** 0.5:.3f} |")

# One row per method, one bar per n:m: horizontal bars keep the long method names readable.
methods_ = list(sdgp.METHODS)
settings_ = list(dict.fromkeys(nm for nm, *_ in rows))
y = np.arange(len(methods_))
height = 0.8 / len(settings_)
fig, (ax_bias, ax_var) = plt.subplots(1, 2, figsize=(10, 3), sharey=True)
for k, nm in enumerate(settings_):
  by_method = {method: (bias, variance) for nm_, method, bias, variance in rows if nm_ == nm}
  offset = (k - (len(settings_) - 1) / 2) * height
  ax_bias.barh(y + offset, [by_method[m][0] for m in methods_], height, label=nm)
  ax_var.barh(y + offset, [by_method[m][1] for m in methods_], height, label=nm)
ax_bias.set_yticks(y, methods_)
ax_bias.invert_yaxis()  # the first method on top (the axes are shared)
ax_bias.set(title="relative bias", xlabel="‖E[P] − G‖ / ‖G‖")
ax_var.set(title="relative variance", xlabel="E‖P − E[P]‖² / ‖G‖²")
ax_var.legend(title="n:m")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## The time model (§IV-C, Fig. 9/10)
#
# Of a conv layer's training work, the forward, the data gradient dX and the weight gradient
# dW each cost about the same (the stem has no dX: its input is the image). SDGP accelerates
# only dX, by m/n with N:M sparse hardware. From FLOPs (`jaxprune.flops`, whose per-layer
# split is exactly this) and from the times of each part measured on this machine
# (`jaxprune.sdgp.timemodel`, each part its own jitted function on the layer's real
# shapes), the projected conv time with pruned dX is `total − ΣdX · (1 − n/m)`.

# %%
conv_flops = [layer for layer in layers if layer.kind == "conv"]
flops_share = sum(lay.backward_data for lay in conv_flops) / sum(lay.training for lay in conv_flops)

records = conv_layers(model, (BATCH, *train_set.image_shape))[:TIMED_LAYERS]
jobs = {}
for i, record in enumerate(records):
  for part, job in layer_jobs(record, jax.random.fold_in(key, i)).items():
    jobs[(i, part)] = job
times = interleaved_times(jobs, TIME_ROUNDS)
totals = {
  p: sum(t for (_, part), t in times.items() if part == p)
  for p in ("forward", "input_grad", "weight_grad")
}
conv_time = sum(totals.values())
time_share = totals["input_grad"] / conv_time
print(
  f"dX share of conv training: {flops_share:.1%} of the FLOPs, {time_share:.1%} of the time here"
)
print("(the paper measures about a third for ResNet-18 on an A100)\n")

settings = [(2, 4), (1, 4), (2, 8), (4, 32)]
dense_flops = flops.training_flops_per_step(layers)
print("| n:m | training FLOPs speed-up | conv time speed-up (measured parts) |")
print("|---|---:|---:|")
speedups = []
for n, m in settings:
  by_flops = dense_flops / flops.training_flops_per_step(layers, backward_data_density=n / m)
  by_time = conv_time / (conv_time - totals["input_grad"] * (1 - n / m))
  speedups.append((by_flops, by_time))
  print(f"| {n}:{m} | {by_flops:.3f}x | {by_time:.3f}x |")

x = np.arange(len(settings))
plt.figure(figsize=(6, 3))
plt.bar(x - 0.2, [s[0] for s in speedups], 0.4, label="from FLOPs")
plt.bar(x + 0.2, [s[1] for s in speedups], 0.4, label="from measured conv parts")
plt.xticks(x, [f"{n}:{m}" for n, m in settings])
plt.ylabel("projected speed-up (x)")
plt.title("SDGP time model: only dX gets faster")
plt.ylim(0, 1.3 * max(max(s) for s in speedups))  # room above the bars for the legend
plt.legend(loc="upper left", ncol=2)
plt.show()
