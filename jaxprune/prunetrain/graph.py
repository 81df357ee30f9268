"""The channel graph of a model: which layers write and read each channel tensor (PruneTrain §4.2).

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
from flax import nnx

__all__ = ["DEFAULT_THRESHOLD", "ChannelTensor", "SliceableLayer", "channel_graph", "live_channels"]

# PruneTrain §4.1: "we use a small threshold of 1e-4 to zero out these weights".
DEFAULT_THRESHOLD = 1e-4


@dataclasses.dataclass(eq=False)
class SliceableLayer:
  """A layer whose kernel channels can be sliced: a ``ConvBN`` or an ``nnx.Linear``.

  Attributes:
    path: attribute path from the model root, e.g. ``("stages", 0, 1, "conv1")``.
    module: the module itself.
    kind: ``"conv"`` (``ConvBN``: HWIO kernel + BatchNorm) or ``"linear"`` (``(in, out)``).
  """

  path: tuple
  module: Any
  kind: str

  def kernel(self) -> np.ndarray:
    param = self.module.conv.kernel if self.kind == "conv" else self.module.kernel
    return np.asarray(param[...])

  def output_magnitude(self) -> np.ndarray:
    """max|w| of every output-channel group (PruneTrain's dead-group test)."""
    kernel = np.abs(self.kernel())
    return kernel.max(axis=(0, 1, 2)) if self.kind == "conv" else kernel.max(axis=0)

  def input_magnitude(self) -> np.ndarray:
    """max|w| of every input-channel group."""
    kernel = np.abs(self.kernel())
    return kernel.max(axis=(0, 1, 3)) if self.kind == "conv" else kernel.max(axis=1)

  @property
  def name(self) -> str:
    return "/".join(str(p) for p in self.path)


@dataclasses.dataclass(eq=False)
class ChannelTensor:
  """A set of channels shared by its writers' outputs and its readers' inputs.

  Attributes:
    name: readable name (the first writer's path, or the block's inner tensor).
    writers: layers whose output channels are these channels.
    readers: layers whose input channels are these channels.
    branch: ``(stage, block)`` if the tensor lives inside a residual branch (it may then
      shrink to zero width: the branch is removed), else None.
  """

  name: str
  writers: list[SliceableLayer] = dataclasses.field(default_factory=list)
  readers: list[SliceableLayer] = dataclasses.field(default_factory=list)
  branch: Optional[tuple[int, int]] = None

  @property
  def width(self) -> int:
    layer = self.writers[0]
    return int(layer.kernel().shape[-1])


@dataclasses.dataclass
class _Graph:
  tensors: list[ChannelTensor]
  # (stage, block) -> the branch's layers, for residual models.
  branches: dict[tuple[int, int], list[SliceableLayer]]


def _branch_layers(block: Any) -> list[Any]:
  """``conv1, conv2, ...`` of a residual block, in order (empty if the branch was removed)."""
  layers = []
  index = 1
  while hasattr(block, f"conv{index}"):
    layer = getattr(block, f"conv{index}")
    if layer is None:
      return []
    layers.append(layer)
    index += 1
  return layers


def _is_residual_model(model: Any) -> bool:
  return all(hasattr(model, name) for name in ("stem", "stages", "head"))


def _is_chain_model(model: Any) -> bool:
  return all(hasattr(model, name) for name in ("features", "classifier"))


def channel_graph(model: nnx.Module) -> list[ChannelTensor]:
  """The channel tensors of a model, found by walking its module tree.

  Args:
    model: a :class:`jaxprune.models.ResNet` or :class:`jaxprune.models.VGG` (or any module
      with the same attributes: ``stem``/``stages``/``head`` of residual blocks with
      ``conv1..convN`` and ``shortcut``, or ``features``/``classifier``).

  Returns:
    Every channel tensor, in execution order.

  Raises:
    ValueError: the model has neither structure.
  """
  return _build_graph(model).tensors


def _build_graph(model: nnx.Module) -> _Graph:
  if _is_residual_model(model):
    return _residual_graph(model)
  if _is_chain_model(model):
    return _chain_graph(model)
  raise ValueError(
    f"model must be a residual (stem/stages/head) or chain (features/classifier) network, "
    f"got {type(model).__name__}"
  )


def _residual_graph(model: nnx.Module) -> _Graph:
  stream = ChannelTensor("stem", writers=[SliceableLayer(("stem",), model.stem, "conv")])
  tensors = [stream]
  branches: dict[tuple[int, int], list[SliceableLayer]] = {}
  for s, stage in enumerate(model.stages):
    for b, block in enumerate(stage):
      prefix = ("stages", s, b)
      if block.shortcut is not None:
        # A projection starts a new stream tensor: it reads the old one, writes the new one.
        projection = SliceableLayer(prefix + ("shortcut",), block.shortcut, "conv")
        stream.readers.append(projection)
        out = ChannelTensor("/".join(map(str, prefix)), writers=[projection])
        tensors.append(out)
      else:
        out = stream  # identity shortcut: the block adds into the same tensor (§4.2 Fig. 5c)
      modules = _branch_layers(block)
      if modules:
        layers = [
          SliceableLayer(prefix + (f"conv{i + 1}",), m, "conv") for i, m in enumerate(modules)
        ]
        branches[(s, b)] = layers
        stream.readers.append(layers[0])
        for first, second in zip(layers[:-1], layers[1:]):
          tensors.append(
            ChannelTensor(first.name, writers=[first], readers=[second], branch=(s, b))
          )
        out.writers.append(layers[-1])
      stream = out
  stream.readers.append(SliceableLayer(("head",), model.head, "linear"))
  return _Graph(tensors, branches)


def _chain_graph(model: nnx.Module) -> _Graph:
  tensors = []
  previous: Optional[ChannelTensor] = None
  layers = [SliceableLayer(("features", i), m, "conv") for i, m in enumerate(model.features)]
  layers += [SliceableLayer(("classifier", i), m, "linear") for i, m in enumerate(model.classifier)]
  for layer in layers:
    if previous is not None:
      previous.readers.append(layer)
    if layer is layers[-1]:
      break  # the classifier's outputs are the logits: never pruned (§4.1)
    previous = ChannelTensor(layer.name, writers=[layer])
    tensors.append(previous)
  return _Graph(tensors, {})


def live_channels(tensor: ChannelTensor, threshold: float = DEFAULT_THRESHOLD) -> np.ndarray:
  """Channel union (PruneTrain §4.2): a channel lives if any writer's output group or any
  reader's input group has ``max|w| >= threshold``.

  Args:
    tensor: a channel tensor from :func:`channel_graph`.
    threshold: the dead-group threshold (absolute).

  Returns:
    A boolean vector over the tensor's channels.
  """
  alive = np.zeros(tensor.width, dtype=bool)
  for layer in tensor.writers:
    alive |= layer.output_magnitude() >= threshold
  for layer in tensor.readers:
    alive |= layer.input_magnitude() >= threshold
  return alive
