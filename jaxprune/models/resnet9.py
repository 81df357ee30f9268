"""The ffcv CIFAR ResNet-9 used by SDGP (2x wide: ≈9.09 M parameters).

Layout of ffcv's ``cifar/train_cifar.py`` model, with every width doubled as in SDGP's
CIFAR configuration (SDGP's runs: convs 128, 256, [256, 256], 512, [512, 512], 256)::

    prep    ConvBN(3 → 128, 3x3)
    layer1  ConvBN(128 → 256, 5x5, stride 2, padding 2)
    res1    x + ConvBN(256 → 256) ∘ ConvBN(256 → 256)        (no ReLU after the sum)
    layer2  ConvBN(256 → 512, 3x3), then MaxPool 2x2
    res2    x + ConvBN(512 → 512) ∘ ConvBN(512 → 512)
    layer3  ConvBN(512 → 256, 3x3, padding 0)
    global max pool → Linear(256, classes, no bias) → × 0.2

Conv and Linear weights use PyTorch's default init, as the ffcv recipe (lr 0.5) was tuned with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprune.models._common import (
  check_layer_paths,
  check_multiplier,
  check_no_removed_blocks,
  check_precision,
  float32_logits,
  require_positive,
  scale_width,
)
from jaxprune.models.layers import ConvBN, torch_default_init

__all__ = ["ResNet9", "ResNet9Spec", "sdgp_resnet9_spec"]


@dataclasses.dataclass(frozen=True)
class ResNet9Spec:
  """Widths of the ffcv ResNet-9; validated on construction (``ValueError`` naming the field).

  Attributes:
    prep: ``prep`` conv width.
    layer1: ``layer1`` conv width (the residual stream of ``res1``).
    res1: widths of the two convs of ``res1``; ``res1[1]`` must equal ``layer1``.
    layer2: ``layer2`` conv width (the residual stream of ``res2``).
    res2: widths of the two convs of ``res2``; ``res2[1]`` must equal ``layer2``.
    layer3: ``layer3`` conv width (features of the linear head).
    logit_scale: constant multiplying the logits (ffcv's ``Mul(0.2)``).
    in_channels: image channels.
  """

  prep: int = 128
  layer1: int = 256
  res1: tuple[int, int] = (256, 256)
  layer2: int = 512
  res2: tuple[int, int] = (512, 512)
  layer3: int = 256
  logit_scale: float = 0.2
  in_channels: int = 3

  def __post_init__(self):
    for name in ("res1", "res2"):
      value = tuple(getattr(self, name))
      object.__setattr__(self, name, value)
      if len(value) != 2:
        raise ValueError(f"{name} must have 2 entries, got {value!r}")
      for i, w in enumerate(value):
        require_positive(f"{name}[{i}]", w)
    for name in ("prep", "layer1", "layer2", "layer3", "in_channels"):
      require_positive(name, getattr(self, name))
    for res, stream in (("res1", "layer1"), ("res2", "layer2")):
      if getattr(self, res)[1] != getattr(self, stream):
        raise ValueError(
          f"{res}[1] must equal {stream} (residual sum), got "
          f"{getattr(self, res)[1]} != {getattr(self, stream)}"
        )

  def scaled(self, multiplier: float) -> ResNet9Spec:
    """Every width times ``multiplier`` (rounded, at least 1)."""
    check_multiplier(multiplier)

    def s(w: int) -> int:
      return scale_width(w, multiplier)

    return dataclasses.replace(
      self,
      prep=s(self.prep),
      layer1=s(self.layer1),
      res1=tuple(s(w) for w in self.res1),
      layer2=s(self.layer2),
      res2=tuple(s(w) for w in self.res2),
      layer3=s(self.layer3),
    )

  def layer_widths(self) -> dict[str, int]:
    """Output width of every conv, keyed by its attribute path in :class:`ResNet9`.

    For example ``"prep"``, ``"layer1"``, ``"res1/0"``, ...

    The inverse of :meth:`with_widths`: ``spec.with_widths(spec.layer_widths()) == spec``.
    """
    widths = {name: getattr(self, name) for name in ("prep", "layer1", "layer2", "layer3")}
    for res in ("res1", "res2"):
      widths.update({f"{res}/{i}": w for i, w in enumerate(getattr(self, res))})
    return widths

  def with_widths(
    self, widths: Mapping[str, int], *, removed_blocks: Iterable[str] = ()
  ) -> ResNet9Spec:
    """This spec with new conv output widths (convs not named keep theirs).

    Args:
      widths: new output width per layer path (the keys of :meth:`layer_widths`).
      removed_blocks: must be empty (the residual branches are fixed).

    Returns:
      The new spec (validated: ``res1/1`` must equal ``layer1``, ``res2/1`` ``layer2``).

    Raises:
      ValueError: an unknown layer path, a non-empty ``removed_blocks``, or widths that
        break a residual sum.
    """
    check_layer_paths(widths, self.layer_widths())
    check_no_removed_blocks(removed_blocks, self)
    new = {**self.layer_widths(), **widths}
    return dataclasses.replace(
      self,
      **{name: new[name] for name in ("prep", "layer1", "layer2", "layer3")},
      res1=(new["res1/0"], new["res1/1"]),
      res2=(new["res2/0"], new["res2/1"]),
    )


def sdgp_resnet9_spec() -> ResNet9Spec:
  """SDGP's 2x-wide ffcv ResNet-9 (SDGP's CIFAR recipe)."""
  return ResNet9Spec()


class ResNet9(nnx.Module):
  """ffcv ResNet-9 (see the module docstring for the layout).

  Attributes:
    spec, num_classes: as built.
    prep, layer1, layer2, layer3: ``ConvBN``.
    res1, res2: ``nnx.List`` of two ``ConvBN`` each (residual branches).
    head: ``nnx.Linear(layer3, num_classes, use_bias=False)``.
    dtype, param_dtype: compute and parameter dtypes of every layer (``None`` / float32 by
      default; see :class:`~jaxprune.models.ConvBN`); the logits are returned in float32.

  Example:
    >>> model = ResNet9(sdgp_resnet9_spec(), num_classes=10, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 32, 32, 3))).shape
    (2, 10)
  """

  def __init__(
    self,
    spec: ResNet9Spec,
    *,
    num_classes: int,
    rngs: nnx.Rngs,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
  ):
    if not isinstance(spec, ResNet9Spec):
      raise ValueError(f"spec must be a ResNet9Spec, got {type(spec).__name__}")
    require_positive("num_classes", num_classes)
    self.dtype, self.param_dtype = check_precision(dtype, param_dtype)
    precision = {"dtype": self.dtype, "param_dtype": self.param_dtype}
    self.spec = spec
    self.num_classes = num_classes
    init = torch_default_init
    self.prep = ConvBN(spec.in_channels, spec.prep, 3, kernel_init=init, rngs=rngs, **precision)
    self.layer1 = ConvBN(
      spec.prep, spec.layer1, 5, strides=2, kernel_init=init, rngs=rngs, **precision
    )
    self.res1 = nnx.List(
      [
        ConvBN(spec.layer1, spec.res1[0], 3, kernel_init=init, rngs=rngs, **precision),
        ConvBN(spec.res1[0], spec.res1[1], 3, kernel_init=init, rngs=rngs, **precision),
      ]
    )
    self.layer2 = ConvBN(spec.layer1, spec.layer2, 3, kernel_init=init, rngs=rngs, **precision)
    self.res2 = nnx.List(
      [
        ConvBN(spec.layer2, spec.res2[0], 3, kernel_init=init, rngs=rngs, **precision),
        ConvBN(spec.res2[0], spec.res2[1], 3, kernel_init=init, rngs=rngs, **precision),
      ]
    )
    self.layer3 = ConvBN(
      spec.layer2, spec.layer3, 3, padding=0, kernel_init=init, rngs=rngs, **precision
    )
    self.head = nnx.Linear(
      spec.layer3, num_classes, use_bias=False, kernel_init=init, rngs=rngs, **precision
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    x = self.layer1(self.prep(x))
    x = x + self.res1[1](self.res1[0](x))
    x = nnx.max_pool(self.layer2(x), (2, 2), strides=(2, 2))
    x = x + self.res2[1](self.res2[0](x))
    x = jnp.max(self.layer3(x), axis=(1, 2))  # AdaptiveMaxPool2d((1, 1)) + Flatten
    return float32_logits(self.head(x)) * self.spec.logit_scale
