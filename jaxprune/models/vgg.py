"""VGG with BatchNorm built from an explicit width spec (PruneTrain and ClickTrain CIFAR VGGs).

``VGGSpec.widths[i]`` is the output width of ``model.features[i]`` (a 3x3 ``ConvBN``);
``pool_after`` lists the conv indices followed by a 2x2 max pool. After the features the
remaining spatial map is averaged (global average pool): on 32x32 CIFAR inputs this is
exactly PruneTrain's flatten of the 1x1 map after 5 pools and ClickTrain's ``AvgPool2d(2)``
of the 2x2 map after 4 pools, and it keeps the model usable on other input sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

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
from jaxprune.models.layers import ConvBN, global_avg_pool, normal_init, torch_default_init

__all__ = ["VGG", "VGGSpec", "clicktrain_vgg_spec", "prunetrain_vgg_spec"]

# Conv widths per block of the standard VGG configurations (Simonyan & Zisserman, Table 1);
# a 2x2 max pool follows each block.
_VGG_BLOCKS = {
  11: ((64,), (128,), (256, 256), (512, 512), (512, 512)),
  13: ((64, 64), (128, 128), (256, 256), (512, 512), (512, 512)),
  16: ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512)),
  19: ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4),
}


@dataclasses.dataclass(frozen=True)
class VGGSpec:
  """Every width of a VGG; validated on construction (``ValueError`` naming the field).

  Attributes:
    widths: output width of each 3x3 conv, in order.
    pool_after: indices into ``widths`` of the convs followed by a 2x2 max pool.
    hidden: widths of the hidden ``Linear`` layers of the classifier (each preceded by
      dropout and followed by ReLU); ``()`` = a single ``Linear`` to the classes.
    dropout: dropout rate before each hidden ``Linear``.
    in_channels: image channels.
    bn_scale_init: initial BatchNorm γ (ClickTrain's code uses 0.5).
    linear_init_std: std of the normal init of the classifier weights (ClickTrain: 0.01);
      ``None`` = PyTorch's default uniform init.
  """

  widths: tuple[int, ...]
  pool_after: tuple[int, ...]
  hidden: tuple[int, ...] = ()
  dropout: float = 0.5
  in_channels: int = 3
  bn_scale_init: float = 1.0
  linear_init_std: float | None = None

  def __post_init__(self):
    for name in ("widths", "pool_after", "hidden"):
      object.__setattr__(self, name, tuple(getattr(self, name)))
    if not self.widths:
      raise ValueError("widths must not be empty")
    for i, w in enumerate(self.widths):
      require_positive(f"widths[{i}]", w)
    for i, w in enumerate(self.hidden):
      require_positive(f"hidden[{i}]", w)
    if len(set(self.pool_after)) != len(self.pool_after) or any(
      not isinstance(p, int) or not 0 <= p < len(self.widths) for p in self.pool_after
    ):
      raise ValueError(
        f"pool_after must be distinct conv indices in [0, {len(self.widths)}), "
        f"got {self.pool_after!r}"
      )
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
    require_positive("in_channels", self.in_channels)
    if self.linear_init_std is not None and not self.linear_init_std > 0:
      raise ValueError(f"linear_init_std must be > 0 or None, got {self.linear_init_std}")

  def scaled(self, multiplier: float) -> VGGSpec:
    """Every conv and hidden width times ``multiplier`` (rounded, at least 1)."""
    check_multiplier(multiplier)
    return dataclasses.replace(
      self,
      widths=tuple(scale_width(w, multiplier) for w in self.widths),
      hidden=tuple(scale_width(w, multiplier) for w in self.hidden),
    )

  def layer_widths(self) -> dict[str, int]:
    """Output width of every conv and hidden ``Linear``, keyed by attribute path.

    Convs are ``"features/i"`` and hidden ``Linear`` layers ``"classifier/j"``, keyed by the layer's
    attribute path in :class:`VGG`; the classifier's last layer (the logits) is not a spec width.

    The inverse of :meth:`with_widths`: ``spec.with_widths(spec.layer_widths()) == spec``.
    """
    widths = {f"features/{i}": w for i, w in enumerate(self.widths)}
    widths.update({f"classifier/{j}": w for j, w in enumerate(self.hidden)})
    return widths

  def with_widths(
    self, widths: Mapping[str, int], *, removed_blocks: Iterable[str] = ()
  ) -> VGGSpec:
    """This spec with new layer output widths (layers not named keep theirs).

    Args:
      widths: new output width per layer path (the keys of :meth:`layer_widths`).
      removed_blocks: must be empty (a VGG has no residual branches); accepted so every
        spec takes the same call.

    Returns:
      The new spec (validated).

    Raises:
      ValueError: an unknown layer path or a non-empty ``removed_blocks``.
    """
    check_layer_paths(widths, self.layer_widths())
    check_no_removed_blocks(removed_blocks, self)
    return dataclasses.replace(
      self,
      widths=tuple(widths.get(f"features/{i}", w) for i, w in enumerate(self.widths)),
      hidden=tuple(widths.get(f"classifier/{j}", w) for j, w in enumerate(self.hidden)),
    )


def _spec_from_blocks(blocks: Sequence[Sequence[int]], pools: int, **kwargs) -> VGGSpec:
  widths = [w for block in blocks for w in block]
  ends = [sum(len(b) for b in blocks[: i + 1]) - 1 for i in range(len(blocks))]
  return VGGSpec(tuple(widths), tuple(ends[:pools]), **kwargs)


def prunetrain_vgg_spec(depth: int) -> VGGSpec:
  """PruneTrain's CIFAR VGG-``depth`` (11, 13, 16, 19).

  BN, 5 max pools, one ``Linear(512, classes)``; He-normal conv init, BN γ = 1 (PruneTrain's code).
  """
  if depth not in _VGG_BLOCKS:
    raise ValueError(f"depth must be one of {sorted(_VGG_BLOCKS)}, got {depth!r}")
  return _spec_from_blocks(_VGG_BLOCKS[depth], pools=5)


def clicktrain_vgg_spec(depth: int) -> VGGSpec:
  """ClickTrain's CIFAR VGG-``depth`` (11, 13, 16, 19), as in their ``vgg.py``.

  BN, 4 max pools (none after the last block) + ``AvgPool2d(2)``, classifier Dropout → Linear(512,
  512) → ReLU → Dropout → Linear(512, 512) → ReLU → Linear(512, classes), BN γ initialised to 0.5,
  Linear weights N(0, 0.01).
  """
  if depth not in _VGG_BLOCKS:
    raise ValueError(f"depth must be one of {sorted(_VGG_BLOCKS)}, got {depth!r}")
  return _spec_from_blocks(
    _VGG_BLOCKS[depth],
    pools=4,
    hidden=(512, 512),
    dropout=0.5,
    bn_scale_init=0.5,
    linear_init_std=0.01,
  )


class VGG(nnx.Module):
  """VGG: 3x3 ``ConvBN`` layers with max pools → global average pool → classifier.

  Attributes:
    spec: the ``VGGSpec`` it was built from.
    num_classes: output logits.
    features: ``nnx.List`` of ``ConvBN`` (``features[i]`` has ``spec.widths[i]`` filters).
    classifier: ``nnx.List`` of ``nnx.Linear`` (hidden layers, then the output layer).
    dropout: the ``nnx.Dropout`` applied before each hidden ``Linear``.
    dtype, param_dtype: compute and parameter dtypes of every layer (``None`` / float32 by
      default; see :class:`~jaxprune.models.ConvBN`); the logits are returned in float32.

  Example:
    >>> model = VGG(prunetrain_vgg_spec(11), num_classes=10, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 32, 32, 3))).shape
    (2, 10)
  """

  def __init__(
    self,
    spec: VGGSpec,
    *,
    num_classes: int,
    rngs: nnx.Rngs,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
  ):
    if not isinstance(spec, VGGSpec):
      raise ValueError(f"spec must be a VGGSpec, got {type(spec).__name__}")
    require_positive("num_classes", num_classes)
    self.dtype, self.param_dtype = check_precision(dtype, param_dtype)
    precision = {"dtype": self.dtype, "param_dtype": self.param_dtype}
    self.spec = spec
    self.num_classes = num_classes
    features = []
    in_width = spec.in_channels
    for width in spec.widths:
      features.append(
        ConvBN(in_width, width, 3, bn_scale_init=spec.bn_scale_init, rngs=rngs, **precision)
      )
      in_width = width
    self.features = nnx.List(features)
    if spec.linear_init_std is None:
      linear_init = torch_default_init
    else:
      linear_init = normal_init(spec.linear_init_std)
    classifier = []
    for width in (*spec.hidden, num_classes):
      classifier.append(
        nnx.Linear(
          in_width,
          width,
          kernel_init=linear_init,
          bias_init=nnx.initializers.zeros_init(),
          rngs=rngs,
          **precision,
        )
      )
      in_width = width
    self.classifier = nnx.List(classifier)
    self.dropout = nnx.Dropout(spec.dropout, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    pools = set(self.spec.pool_after)
    for i, layer in enumerate(self.features):
      x = layer(x)
      if i in pools:
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
    x = global_avg_pool(x)
    for linear in self.classifier[:-1]:
      x = jax.nn.relu(linear(self.dropout(x)))
    return float32_logits(self.classifier[-1](x))
