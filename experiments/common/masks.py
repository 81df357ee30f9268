"""The pruned states the benches time, built one way for every bench.

- :func:`clicktrain_like_mask`: a random ClickTrain-like kernel mask for one conv, fine-grained
  (a library pattern per kept kernel) or aligned (``groups=G``: each filter group shares its
  kept input channels' patterns), at a kernel-prune ratio;
- :func:`pruned_layers`: the convs ClickTrain prunes, with their input shapes;
- :func:`clicktrain_to_hard_prune`: the real transform, at the paper's per-layer ratios
  (:func:`jaxprune.clicktrain.preset.paper_kernel_ratios`), on a schedule that reaches its hard
  prune in a few steps (its masks are the transform's own, not random), and
  :func:`step_until_pruned`, which steps it there;
- :func:`kill_channels`: PruneTrain-like dead channels, which a reconfiguration removes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from flax import nnx

from jaxprune import flops, methods
from jaxprune import prunetrain as pt
from jaxprune.clicktrain import patterns, stage_name
from jaxprune.clicktrain.config import default_layer_filter
from jaxprune.clicktrain.execution.aligned_layout import aligned_mask
from jaxprune.clicktrain.preset import paper_kernel_ratios


def clicktrain_like_mask(
  shape: Sequence[int],
  ratio: float,
  rng: np.random.Generator,
  *,
  groups: int | None = None,
  balanced: bool = False,
  contiguous: bool = False,
) -> np.ndarray:
  """A random ClickTrain-like mask of an HWIO kernel ``shape``.

  Args:
    shape: ``(kh, kw, cin, cout)``; a 3x3 kernel keeps a library pattern (4 of 9 taps), any
      other its every tap.
    ratio: the kernel-prune ratio.
    rng: the random source.
    groups: ``None``: fine-grained, ``ceil(ratio·Cin·Cout)`` kernels removed and a pattern per
      kept kernel. ``G``: aligned (:func:`jaxprune.clicktrain.execution.aligned_layout
      .aligned_mask`), per filter group ``ceil(ratio·Cin)`` input channels removed and a
      pattern per kept (group, channel).
    balanced: fine-grained only: the same number of kernels removed from every filter (the
      paper's load-balance constraint); otherwise spread at random over the layer, as the
      released code's layer-wide ranking does for random scores.
    contiguous: aligned only: the kept channels are the first ones, ordered by pattern, so
      the aligned conv needs no channel gather (what folding the order into the previous
      layer would give).

  Returns:
    The float32 mask, 1 where a weight is kept.

  Raises:
    ValueError: ``balanced`` with ``groups`` or ``contiguous`` without it.
  """
  kh, kw, cin, cout = shape
  library = patterns.library_patterns() if (kh, kw) == (3, 3) else np.ones((1, kh, kw))
  if groups is not None:
    if balanced:
      raise ValueError("balanced: aligned masks remove the same channels from a whole group")
    kept = cin - math.ceil(ratio * cin)
    taps = np.zeros((groups, cin, kh, kw), np.float32)
    for g in range(groups):
      chosen = rng.integers(0, len(library), kept)
      if contiguous:
        taps[g, :kept] = library[np.sort(chosen)]
      else:
        taps[g, rng.permutation(cin)[:kept]] = library[chosen]
    return aligned_mask(taps, cout)
  if contiguous:
    raise ValueError("contiguous: only an aligned mask (groups=G) orders its kept channels")
  mask = np.transpose(library[rng.integers(0, len(library), (cin, cout))], (2, 3, 0, 1))
  if balanced:
    keep = np.ones((cin, cout), bool)
    for f in range(cout):
      keep[rng.permutation(cin)[: math.ceil(ratio * cin)], f] = False
  else:
    keep = np.ones(cin * cout, bool)
    keep[rng.permutation(cin * cout)[: math.ceil(ratio * cin * cout)]] = False
    keep = keep.reshape(cin, cout)
  return (mask * keep[None, None]).astype(np.float32)


def pruned_layers(model: nnx.Module, image_size: int, batch: int) -> list[Any]:
  """The convs ClickTrain prunes (every conv its default layer filter takes), as
  :func:`jaxprune.flops.layer_flops` entries at a square input of ``image_size``."""
  chosen = []
  for layer in flops.layer_flops(model, (batch, image_size, image_size, 3)):
    if layer.kind != "conv" or layer.param_path is None:
      continue
    name = "/".join(map(str, layer.param_path))
    if default_layer_filter(name, tuple(layer.param_shape)) is not None:
      chosen.append(layer)
  return chosen


def clicktrain_to_hard_prune(
  model_name: str, *, mode: str = "paper", filter_groups: int | None = None
) -> tuple[methods.Method, methods.Run]:
  """ClickTrain at the paper's ratios of ``model_name`` on a one-step-per-epoch schedule that
  reaches its hard prune within the run's ``epochs`` steps: the method and its run.

  ``mode="paper"`` walks every stage (warm-up, pattern pool, finalisation, regularisation);
  ``"one_shot"`` picks its masks from the first step's gradient.
  """
  if mode == "paper":
    schedule = {"pool_start_epoch": 1, "pool_epochs": 1, "finalize_epochs": 1}
    steps = 4
  elif mode == "one_shot":
    schedule = {"one_shot_epoch": 0}
    steps = 1
  else:
    raise ValueError(f"mode: expected 'paper' or 'one_shot', got {mode!r}")
  config = {"filter_groups": filter_groups} if filter_groups else {}
  method = methods.get(
    "clicktrain" if mode == "paper" else "clicktrain-one-shot",
    kernel_prune_ratio=paper_kernel_ratios(model_name),
    hard_prune_epoch=steps,
    **schedule,
    **config,
  )
  return method, methods.Run(steps_per_epoch=1, epochs=steps + 6)


def step_until_pruned(step: Callable[[], Any], run: methods.Run) -> Any:
  """Calls ``step()`` (one step of :func:`clicktrain_to_hard_prune`'s run, returning
  ClickTrain's state after it) until the stage reads ``"pruned"``, at most ``run.epochs`` times;
  returns that state.

  Raises:
    RuntimeError: the run ended before the hard prune.
  """
  state = None
  for _ in range(run.epochs):
    state = step()
    if stage_name(state) == "pruned":
      return state
  raise RuntimeError(
    f"ClickTrain did not reach its hard prune in {run.epochs} steps (stage {stage_name(state)!r})"
  )


def kill_channels(
  model: nnx.Module, keep: float, seed: int = 0, input_shape=None, input_dtype=None
) -> None:
  """Zeroes every kernel weight of a random ``1 - keep`` share of every prunable channel group
  (at least one channel stays), wherever it is written and read: dead groups, which
  :func:`jaxprune.prunetrain.reconfigure` removes (PruneTrain §4.2). In place. ``input_shape``
  and ``input_dtype`` are the traced input's (token ids for a language model)."""
  rng = np.random.default_rng(seed)
  graph = pt.channel_graph(model, input_shape, input_dtype=input_dtype)
  kernels = {}
  for group in graph.prunable:
    dead = rng.permutation(group.width)[: group.width - max(1, round(keep * group.width))]
    for use in group.kernels:
      value = kernels.setdefault(use.path, np.array(graph.values[use.path]))
      index = [slice(None)] * value.ndim
      index[use.axis] = np.isin(use.coords, dead)
      value[tuple(index)] = 0.0
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Variable) and tuple(path) in kernels:
      node[...] = kernels[tuple(path)]
