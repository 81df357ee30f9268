"""ResNets built from an explicit width spec (CIFAR and ImageNet variants).

A ``ResNetSpec`` lists every width of the network, so PruneTrain's reconfiguration can
rebuild a smaller model with ``ResNet(new_spec, num_classes=..., rngs=...)``:

* ``stem_width``: output channels of the stem conv;
* per stage, ``width``: the residual stream width (the output of every block of the stage;
  PruneTrain's channel union keeps one width per stage, §4.2);
* per block, ``widths``: the inner conv widths (``(mid,)`` for ``BasicBlock``, ``(w1, w2)``
  for ``Bottleneck``) or ``None`` when the branch was removed; ``projection``: whether the
  shortcut is a 1x1 conv + BN (it stays a projection after pruning even when the in/out
  widths become equal, because it holds trained weights).

The first block of a stage carries the stage stride (on ``conv1`` of a basic block, on the
3x3 ``conv2`` of a bottleneck, and on the projection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprune.models._common import (
  check_layer_paths,
  check_multiplier,
  check_precision,
  float32_logits,
  require_positive,
  scale_width,
)
from jaxprune.models.layers import (
  BasicBlock,
  Bottleneck,
  ConvBN,
  global_avg_pool,
  torch_default_init,
)

__all__ = [
  "BlockSpec",
  "ResNet",
  "ResNetSpec",
  "StageSpec",
  "clicktrain_resnet_spec",
  "imagenet_resnet_spec",
  "prunetrain_resnet_spec",
]

BlockType = Literal["basic", "bottleneck"]
_BLOCK_CLASSES = {"basic": BasicBlock, "bottleneck": Bottleneck}


@dataclasses.dataclass(frozen=True)
class BlockSpec:
  """One residual block.

  Attributes:
    widths: inner conv output widths, ``(mid,)`` for a basic block, ``(w1, w2)`` for a
      bottleneck; ``None`` when the branch was removed (the block computes
      ``relu(shortcut(x))``).
    projection: 1x1 conv + BN shortcut (``True``) or identity (``False``).
  """

  widths: tuple[int, ...] | None
  projection: bool = False

  def __post_init__(self):
    if self.widths is not None:
      object.__setattr__(self, "widths", tuple(self.widths))


@dataclasses.dataclass(frozen=True)
class StageSpec:
  """A stage of blocks sharing one residual stream width.

  Attributes:
    width: residual stream width (output channels of every block in the stage).
    blocks: the blocks, first one carries ``stride``.
    stride: spatial stride of the first block.
  """

  width: int
  blocks: tuple[BlockSpec, ...]
  stride: int = 1

  def __post_init__(self):
    object.__setattr__(self, "blocks", tuple(self.blocks))


@dataclasses.dataclass(frozen=True)
class ResNetSpec:
  """Every width of a ResNet; validated on construction (``ValueError`` naming the field).

  Attributes:
    block: ``"basic"`` (``BasicBlock``) or ``"bottleneck"`` (``Bottleneck``).
    stem_width: output channels of the stem ``ConvBN``.
    stages: the stages, in order.
    in_channels: image channels.
    stem_kernel: stem conv kernel size (3 for CIFAR, 7 for ImageNet).
    stem_stride: stem conv stride (1 for CIFAR, 2 for ImageNet).
    stem_pool: 3x3 stride-2 max pool after the stem (ImageNet).
    blurpool: blur (3x3 binomial, stride 1) the input of every strided conv but the stem —
      each stage's first 3x3 with a stride and its projection — before the conv (Zhang 2019;
      where SDGP's released ImageNet code puts it: strided convs with >= 16 input channels).
  """

  block: BlockType
  stem_width: int
  stages: tuple[StageSpec, ...]
  in_channels: int = 3
  stem_kernel: int = 3
  stem_stride: int = 1
  stem_pool: bool = False
  blurpool: bool = False

  def __post_init__(self):
    object.__setattr__(self, "stages", tuple(self.stages))
    if self.block not in _BLOCK_CLASSES:
      raise ValueError(f"block must be one of {sorted(_BLOCK_CLASSES)}, got {self.block!r}")
    for name in ("stem_width", "in_channels", "stem_kernel", "stem_stride"):
      require_positive(name, getattr(self, name))
    if not isinstance(self.blurpool, bool):
      raise ValueError(f"blurpool must be a bool, got {self.blurpool!r}")
    if not self.stages:
      raise ValueError("stages must not be empty")
    num_inner = _BLOCK_CLASSES[self.block].num_inner_widths
    in_width = self.stem_width
    for s, stage in enumerate(self.stages):
      if not isinstance(stage, StageSpec):
        raise ValueError(f"stages[{s}] must be a StageSpec, got {type(stage).__name__}")
      require_positive(f"stages[{s}].width", stage.width)
      require_positive(f"stages[{s}].stride", stage.stride)
      if not stage.blocks:
        raise ValueError(f"stages[{s}].blocks must not be empty")
      for b, block in enumerate(stage.blocks):
        field = f"stages[{s}].blocks[{b}]"
        if not isinstance(block, BlockSpec):
          raise ValueError(f"{field} must be a BlockSpec, got {type(block).__name__}")
        if block.widths is not None:
          if len(block.widths) != num_inner:
            raise ValueError(
              f"{field}.widths must have {num_inner} entries for "
              f"{self.block!r} blocks, got {block.widths!r}"
            )
          for i, w in enumerate(block.widths):
            require_positive(f"{field}.widths[{i}]", w)
        stride = stage.stride if b == 0 else 1
        if not block.projection and (stride != 1 or in_width != stage.width):
          raise ValueError(
            f"{field}.projection must be True: the block maps {in_width} channels "
            f"to {stage.width} with stride {stride}"
          )
        in_width = stage.width

  @property
  def block_class(self) -> type[BasicBlock] | type[Bottleneck]:
    return _BLOCK_CLASSES[self.block]

  @property
  def num_blocks(self) -> tuple[int, ...]:
    """Number of blocks per stage."""
    return tuple(len(stage.blocks) for stage in self.stages)

  @classmethod
  def uniform(
    cls,
    block: BlockType,
    *,
    stem_width: int,
    stage_widths: Sequence[int],
    num_blocks: Sequence[int],
    strides: Sequence[int],
    inner_widths: Sequence[Sequence[int]] | None = None,
    **kwargs,
  ) -> ResNetSpec:
    """A spec where all blocks of a stage are alike.

    Projections are exactly where the shape changes (He et al. option B).

    Args:
      block: ``"basic"`` or ``"bottleneck"``.
      stem_width: stem output channels.
      stage_widths: residual stream width per stage.
      num_blocks: blocks per stage.
      strides: stride of each stage's first block.
      inner_widths: per stage, the inner widths of its blocks; default: the stage width
        for basic blocks, ``stage_width // 4`` twice for bottlenecks.
      **kwargs: the remaining ``ResNetSpec`` fields.

    Returns:
      The validated spec.
    """
    stage_widths, num_blocks, strides = tuple(stage_widths), tuple(num_blocks), tuple(strides)
    for name, values in (("num_blocks", num_blocks), ("strides", strides)):
      if len(values) != len(stage_widths):
        raise ValueError(
          f"{name} has {len(values)} entries but stage_widths has {len(stage_widths)}"
        )
    if inner_widths is None:
      if block == "bottleneck":
        inner_widths = [(max(w // 4, 1),) * 2 for w in stage_widths]
      else:
        inner_widths = [(w,) for w in stage_widths]
    elif len(inner_widths) != len(stage_widths):
      raise ValueError(
        f"inner_widths has {len(inner_widths)} entries but stage_widths has {len(stage_widths)}"
      )
    stages = []
    in_width = stem_width
    for width, count, stride, inner in zip(stage_widths, num_blocks, strides, inner_widths):
      require_positive("num_blocks entries", count)
      blocks = [BlockSpec(tuple(inner), projection=stride != 1 or in_width != width)]
      blocks += [BlockSpec(tuple(inner)) for _ in range(count - 1)]
      stages.append(StageSpec(width, tuple(blocks), stride))
      in_width = width
    return cls(block, stem_width, tuple(stages), **kwargs)

  def scaled(self, multiplier: float) -> ResNetSpec:
    """Every width times ``multiplier`` (rounded, at least 1); structure unchanged."""
    check_multiplier(multiplier)
    return self.map_widths(lambda width, _: scale_width(width, multiplier))

  def map_widths(self, fn: Callable[[int, int], int], like: ResNetSpec | None = None) -> ResNetSpec:
    """Every width ``w`` replaced by ``fn(w, w_like)``; structure unchanged.

    ``w_like`` is the width in the same position of ``like`` (default: this spec), e.g.
    the dense model's widths when rounding a pruned spec up without exceeding them.
    Removed blocks (``widths=None``) stay removed.

    Raises:
      ValueError: ``like`` has other stages or blocks, or a removed block where this
        spec has one.
    """
    like = self if like is None else like
    if like.num_blocks != self.num_blocks:
      raise ValueError(f"like: blocks per stage {like.num_blocks} differ from {self.num_blocks}")

    def map_block(block: BlockSpec, like_block: BlockSpec) -> BlockSpec:
      if block.widths is None:
        return block
      if like_block.widths is None or len(like_block.widths) != len(block.widths):
        raise ValueError(f"like: block {like_block} does not match {block}")
      return dataclasses.replace(
        block, widths=tuple(fn(w, w_like) for w, w_like in zip(block.widths, like_block.widths))
      )

    stages = tuple(
      dataclasses.replace(
        stage,
        width=fn(stage.width, like_stage.width),
        blocks=tuple(map(map_block, stage.blocks, like_stage.blocks)),
      )
      for stage, like_stage in zip(self.stages, like.stages)
    )
    return dataclasses.replace(self, stem_width=fn(self.stem_width, like.stem_width), stages=stages)

  def layer_widths(self) -> dict[str, int]:
    """Output width of every conv and of the classifier's input.

    Keyed by the layer's attribute path in :class:`ResNet` (``"stem"``, ``"stages/0/1/conv1"``,
    ``"stages/1/0/shortcut"``, ...); removed branches have no entries.

    The inverse of :meth:`with_widths`: ``spec.with_widths(spec.layer_widths()) == spec``.
    """
    widths = {"stem": self.stem_width}
    names = self.block_class.branch_names
    for s, stage in enumerate(self.stages):
      for b, block in enumerate(stage.blocks):
        prefix = f"stages/{s}/{b}"
        if block.projection:
          widths[f"{prefix}/shortcut"] = stage.width
        if block.widths is not None:
          widths.update({f"{prefix}/{n}": w for n, w in zip(names, block.widths)})
          widths[f"{prefix}/{names[-1]}"] = stage.width
    return widths

  def with_widths(
    self, widths: Mapping[str, int], *, removed_blocks: Iterable[str] = ()
  ) -> ResNetSpec:
    """This spec with new layer output widths and some residual branches removed.

    Args:
      widths: new output width per layer path (the keys of :meth:`layer_widths`); layers
        not named keep theirs, except the writers of a residual stream (a stage's last
        branch convs and projections, and the stem for a stage without projection): they
        share one width, so the named ones must agree and the others follow them.
      removed_blocks: ``"stages/s/b"`` of every block whose branch is removed (the block
        then computes ``relu(shortcut(x))``).

    Returns:
      The new spec (validated).

    Raises:
      ValueError: an unknown layer or block path, or writers of one stream that disagree.

    Example:
      >>> spec = prunetrain_resnet_spec(20)
      >>> spec.with_widths({"stages/0/0/conv1": 9}).stages[0].blocks[0].widths
      (9,)
    """
    check_layer_paths(widths, self.layer_widths())
    blocks_known = {
      f"stages/{s}/{b}" for s, stage in enumerate(self.stages) for b in range(len(stage.blocks))
    }
    removed = set(removed_blocks)
    if removed - blocks_known:
      raise ValueError(f"removed_blocks: unknown block paths {sorted(removed - blocks_known)}")
    names = self.block_class.branch_names
    stem_width = widths.get("stem", self.stem_width)
    stream = ("stem", stem_width)  # (a writer of the current stream, its width)
    stages = []
    for s, stage in enumerate(self.stages):
      blocks = []
      for b, block in enumerate(stage.blocks):
        prefix = f"stages/{s}/{b}"
        last = f"{prefix}/{names[-1]}"
        has_branch = block.widths is not None and prefix not in removed
        given = [p for p in (f"{prefix}/shortcut", last) if p in widths]
        given = [p for p in given if has_branch or p != last]
        if block.projection:  # a projection starts a new stream tensor
          stream = (given[0], widths[given[0]]) if given else (f"{prefix}/shortcut", stage.width)
        for path in given:
          if widths[path] != stream[1]:
            raise ValueError(
              f"widths: {path} ({widths[path]}) and {stream[0]} ({stream[1]}) write the "
              "same residual stream and must have the same width"
            )
        inner = None
        if has_branch:
          inner = tuple(widths.get(f"{prefix}/{n}", w) for n, w in zip(names, block.widths))
        blocks.append(dataclasses.replace(block, widths=inner))
      stages.append(dataclasses.replace(stage, width=stream[1], blocks=tuple(blocks)))
    return dataclasses.replace(self, stem_width=stem_width, stages=tuple(stages))


class ResNet(nnx.Module):
  """ResNet: stem, stages of residual blocks, global average pool and a linear head.

  Stem ``ConvBN`` (+ optional max pool) → stages of residual blocks → global average pool →
  ``nnx.Linear`` head.

  Attributes:
    spec: the ``ResNetSpec`` it was built from.
    num_classes: output logits.
    stem: ``ConvBN`` (with ReLU).
    stages: ``nnx.List`` of ``nnx.List`` of ``BasicBlock`` / ``Bottleneck``.
    head: ``nnx.Linear(last stage width, num_classes)``.
    dtype, param_dtype: compute and parameter dtypes of every layer (``None`` / float32 by
      default; see :class:`~jaxprune.models.ConvBN`); the logits are returned in float32.

  Example:
    >>> spec = prunetrain_resnet_spec(20)
    >>> model = ResNet(spec, num_classes=10, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 32, 32, 3))).shape
    (2, 10)
    >>> smaller = ResNet(spec.scaled(0.5), num_classes=10, rngs=nnx.Rngs(0))
  """

  def __init__(
    self,
    spec: ResNetSpec,
    *,
    num_classes: int,
    rngs: nnx.Rngs,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
  ):
    if not isinstance(spec, ResNetSpec):
      raise ValueError(f"spec must be a ResNetSpec, got {type(spec).__name__}")
    require_positive("num_classes", num_classes)
    self.dtype, self.param_dtype = check_precision(dtype, param_dtype)
    precision = {"dtype": self.dtype, "param_dtype": self.param_dtype}
    self.spec = spec
    self.num_classes = num_classes
    self.stem = ConvBN(
      spec.in_channels,
      spec.stem_width,
      spec.stem_kernel,
      strides=spec.stem_stride,
      rngs=rngs,
      **precision,
    )
    block_class = spec.block_class
    stages = []
    in_width = spec.stem_width
    for stage in spec.stages:
      blocks = []
      for b, block in enumerate(stage.blocks):
        blocks.append(
          block_class(
            in_width,
            stage.width,
            widths=block.widths,
            strides=stage.stride if b == 0 else 1,
            projection=block.projection,
            blurpool=spec.blurpool,
            rngs=rngs,
            **precision,
          )
        )
        in_width = stage.width
      stages.append(nnx.List(blocks))
    self.stages = nnx.List(stages)
    self.head = nnx.Linear(
      in_width,
      num_classes,
      kernel_init=torch_default_init,
      bias_init=nnx.initializers.zeros_init(),
      rngs=rngs,
      **precision,
    )

  def forward_features(self, x: jax.Array) -> jax.Array:
    """The last stage's output, before pooling (NHWC)."""
    x = self.stem(x)
    if self.spec.stem_pool:
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for stage in self.stages:
      for block in stage:
        x = block(x)
    return x

  def __call__(self, x: jax.Array) -> jax.Array:
    return float32_logits(self.head(global_avg_pool(self.forward_features(x))))


def prunetrain_resnet_spec(depth: int) -> ResNetSpec:
  """PruneTrain's CIFAR ResNets (He et al. 2016 §4.2, as in PruneTrain's code).

  * ``depth`` 20/32/56/110 (``6n + 2``): basic blocks, stem 16, stages 16/32/64 with ``n``
    blocks each, 1x1 projection + BN shortcuts where the shape changes.
  * ``depth`` 50: bottleneck, stem 16, 3 stages x 8 blocks, inner widths 16/32/64,
    stream widths 64/128/256 (projection also on the first block, 16 → 64).

  Raises:
    ValueError: ``depth`` is neither 50 nor of the form ``6n + 2``.
  """
  if depth == 50:
    return ResNetSpec.uniform(
      "bottleneck",
      stem_width=16,
      stage_widths=(64, 128, 256),
      num_blocks=(8, 8, 8),
      strides=(1, 2, 2),
      inner_widths=((16, 16), (32, 32), (64, 64)),
    )
  if not isinstance(depth, int) or depth < 8 or (depth - 2) % 6:
    raise ValueError(f"depth must be 50 or 6n+2 (20, 32, 56, 110), got {depth!r}")
  n = (depth - 2) // 6
  return ResNetSpec.uniform(
    "basic", stem_width=16, stage_widths=(16, 32, 64), num_blocks=(n,) * 3, strides=(1, 2, 2)
  )


_CLICKTRAIN_BLOCKS = {
  18: ("basic", (2, 2, 2, 2)),
  32: ("basic", (3, 4, 5, 3)),
  34: ("basic", (3, 4, 6, 3)),
  50: ("bottleneck", (3, 4, 6, 3)),
  101: ("bottleneck", (3, 4, 23, 3)),
}


def _four_stage_spec(depth: int, **kwargs) -> ResNetSpec:
  if depth not in _CLICKTRAIN_BLOCKS:
    raise ValueError(f"depth must be one of {sorted(_CLICKTRAIN_BLOCKS)}, got {depth!r}")
  block, num_blocks = _CLICKTRAIN_BLOCKS[depth]
  planes = (64, 128, 256, 512)
  expansion = 4 if block == "bottleneck" else 1
  return ResNetSpec.uniform(
    block,
    stem_width=64,
    stage_widths=tuple(p * expansion for p in planes),
    num_blocks=num_blocks,
    strides=(1, 2, 2, 2),
    inner_widths=tuple((p,) * (2 if block == "bottleneck" else 1) for p in planes),
    **kwargs,
  )


def clicktrain_resnet_spec(depth: int) -> ResNetSpec:
  """ClickTrain's CIFAR ResNets (kuangliu/pytorch-cifar layout, as in ClickTrain's code).

  3x3 stem of 64, no max pool, 4 stages of 64/128/256/512 planes.

  ``depth`` 18 [2,2,2,2], 32 [3,4,5,3] (their "ResNet-32", ≈20.1 M parameters), 34
  [3,4,6,3] basic blocks; 50 [3,4,6,3], 101 [3,4,23,3] bottlenecks (stream widths ×4).
  """
  return _four_stage_spec(depth)


def imagenet_resnet_spec(depth: int) -> ResNetSpec:
  """torchvision ImageNet ResNets (v1.5: bottleneck stride on the 3x3).

  7x7/2 stem of 64, 3x3/2 max pool, then the same stages as ``clicktrain_resnet_spec(depth)``.
  """
  return _four_stage_spec(depth, stem_kernel=7, stem_stride=2, stem_pool=True)
