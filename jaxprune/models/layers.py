"""Building blocks shared by every model: ``ConvBN``, ``BasicBlock``, ``Bottleneck``, ``BlurPool``.

All convolutions are ``nnx.Conv`` without bias (BatchNorm follows), NHWC inputs and HWIO
kernels (``block.conv1.conv.kernel[:, :, c, f]`` is the kernel from input channel ``c`` to
output channel ``f``). BatchNorm uses PyTorch's defaults (momentum 0.1, i.e. Flax
``momentum=0.9``, epsilon 1e-5) because the papers' recipes were tuned with them.

Residual blocks may have their *branch removed* (PruneTrain §4.2 layer removal): such a block
has ``conv1 = conv2 (= conv3) = None`` and computes ``relu(shortcut(x))``, which is the value
of the full block when its branch output is zero. For an identity shortcut this is ``x``
itself because the block input is already a ReLU output.

Mixed precision follows Flax's layers: ``dtype`` is the compute dtype (``None``: inferred, i.e.
float32) and ``param_dtype`` the storage dtype of the parameters (float32 by default). The conv
runs in ``dtype``; BatchNorm keeps its parameters and running statistics in float32 and
normalises in float32 (its input is promoted to the statistics' dtype), and ``ConvBN`` casts the
result back to ``dtype``: the statistics of a bfloat16 activation are as exact as those of a
float32 one, and the normalisation is one fused elementwise pass whatever its dtype.

``BlurPool`` is anti-aliased downsampling (Zhang, "Making Convolutional Networks Shift-Invariant
Again", ICML 2019): a fixed binomial low-pass filter per channel, then subsampling. With
``blurpool=True`` a ``ConvBN`` blurs its input (stride 1) before its strided conv, the form
SDGP's released ImageNet code uses (ffcv's ``BlurPoolConv2d``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune.models._common import check_precision, require_positive
from jaxprune.models.conv import conv_general_dilated
from jaxprune.models.pluggable_conv import conv_sharing_variables

__all__ = [
  "BasicBlock",
  "BlurPool",
  "Bottleneck",
  "ConvBN",
  "binomial_filter",
  "conv_kernel_init",
  "conv_sharing_variables",
  "global_avg_pool",
  "kaiming_uniform_relu_init",
  "normal_init",
  "torch_default_init",
]

# Initializers. Each draws its samples from fixed-size blocks of 2**16 unit samples made by one
# jitted function, then slices and reshapes: a Threefry sampler compiled per distinct kernel
# shape costs seconds of XLA compile time on CPU per layer, which dominated building a model;
# this way it is compiled once per process. The distributions are exactly the stated ones.
_SAMPLE_BLOCK = 1 << 16


@functools.partial(jax.jit, static_argnames="distribution")
def _unit_block(key: jax.Array, distribution: str) -> jax.Array:
  if distribution == "normal":
    return jax.random.normal(key, (_SAMPLE_BLOCK,), jnp.float32)
  return jax.random.uniform(key, (_SAMPLE_BLOCK,), jnp.float32, -1.0, 1.0)


def _unit_samples(key: jax.Array, shape: Sequence[int], distribution: str) -> jax.Array:
  """``shape`` samples of N(0, 1) (``"normal"``) or U(-1, 1) (``"uniform"``)."""
  size = math.prod(shape)
  num_blocks = -(-size // _SAMPLE_BLOCK)
  blocks = [_unit_block(k, distribution) for k in jax.random.split(key, num_blocks)]
  flat = blocks[0] if num_blocks == 1 else jnp.concatenate(blocks)
  return flat[:size].reshape(shape)


def _fans(shape: Sequence[int]) -> tuple[int, int]:
  """(fan_in, fan_out) of an HWIO conv kernel or an (in, out) dense kernel."""
  receptive_field = math.prod(shape[:-2])
  return shape[-2] * receptive_field, shape[-1] * receptive_field


def conv_kernel_init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
  """He et al. (2015) normal init with fan_out, N(0, 2 / (k·k·out)).

  As in the papers' PyTorch code (``normal_(0, sqrt(2 / n))``) and torchvision (``kaiming_normal_``,
  fan_out).
  """
  return (_unit_samples(key, shape, "normal") * math.sqrt(2.0 / _fans(shape)[1])).astype(dtype)


def torch_default_init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
  """PyTorch's default Conv2d/Linear weight init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

  That is ``kaiming_uniform_(a=sqrt(5))``.
  """
  return (_unit_samples(key, shape, "uniform") / math.sqrt(_fans(shape)[0])).astype(dtype)


def kaiming_uniform_relu_init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
  """He et al. (2015) uniform init with fan_in and the ReLU gain √2.

  U(-b, b) with b = √2 · √3 / √fan_in = √(6 / fan_in), i.e. PyTorch's ``kaiming_uniform_(w,
  nonlinearity="relu")``. For an HWIO kernel fan_in = kh·kw·(in / groups).
  """
  bound = math.sqrt(6.0 / _fans(shape)[0])
  return (_unit_samples(key, shape, "uniform") * bound).astype(dtype)


def normal_init(std: float) -> nnx.Initializer:
  """N(0, std²) weights (ClickTrain's VGG classifier uses std 0.01)."""

  def init(key: jax.Array, shape: Sequence[int], dtype=jnp.float32) -> jax.Array:
    return (_unit_samples(key, shape, "normal") * std).astype(dtype)

  return init


# PyTorch BatchNorm2d(momentum=0.1) updates running = 0.9 running + 0.1 batch.
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5


_BLUR_PADDINGS = ("zeros", "reflect")


def binomial_filter(size: int) -> np.ndarray:
  """The ``size`` x ``size`` binomial low-pass filter of BlurPool, summing to 1.

  The outer product of row ``size - 1`` of Pascal's triangle with itself (3: [1, 2, 1] ⊗ [1, 2, 1] /
  16).
  """
  row = np.array([math.comb(size - 1, k) for k in range(size)], np.float64)
  f = np.outer(row, row)
  return (f / f.sum()).astype(np.float32)


class BlurPool(nnx.Module):
  """Anti-aliased downsampling (Zhang 2019, §3.2 "BlurPool").

  Binomial blur of every channel, then keep every ``stride``-th row and column. No parameters: the
  filter is fixed, and is built for the input's channel count at call time (so pruning channels
  around it is free).

  Attributes:
    filter_size: side of the binomial filter (1 to 7; 1 = plain subsampling).
    stride: subsampling factor (1: blur only, as before a strided conv).
    padding: ``"zeros"`` (ffcv's and SDGP's form) or ``"reflect"`` (Zhang's default);
      ``(filter_size - 1) // 2`` before, the rest after, on each spatial axis.

  Example:
    >>> BlurPool(stride=2)(jnp.ones((1, 8, 8, 4))).shape
    (1, 4, 4, 4)

  References:
    Zhang, "Making Convolutional Networks Shift-Invariant Again", ICML 2019.
    https://arxiv.org/abs/1904.11486
  """

  def __init__(self, *, filter_size: int = 3, stride: int = 2, padding: str = "zeros"):
    """Builds the layer.

    Raises:
      ValueError: ``filter_size`` outside 1..7, ``stride`` < 1 or an unknown ``padding``.
    """
    if (
      isinstance(filter_size, bool) or not isinstance(filter_size, int) or not 1 <= filter_size <= 7
    ):
      raise ValueError(f"filter_size must be an int in [1, 7], got {filter_size!r}")
    require_positive("stride", stride)
    if padding not in _BLUR_PADDINGS:
      raise ValueError(f"padding must be one of {_BLUR_PADDINGS}, got {padding!r}")
    self.filter_size = filter_size
    self.stride = stride
    self.padding = padding

  def __call__(self, x: jax.Array) -> jax.Array:
    if x.ndim != 4:
      raise ValueError(f"x must be NHWC (4-D), got shape {x.shape}")
    channels = x.shape[-1]
    lo = (self.filter_size - 1) // 2
    pads = ((lo, self.filter_size - 1 - lo),) * 2
    if self.padding == "reflect":
      x = jnp.pad(x, ((0, 0), *pads, (0, 0)), mode="reflect")
      pads = ((0, 0), (0, 0))
    # One depthwise (feature_group_count = channels) HWIO filter per channel.
    f = jnp.asarray(binomial_filter(self.filter_size), x.dtype)
    kernel = jnp.broadcast_to(f[:, :, None, None], (*f.shape, 1, channels))
    return jax.lax.conv_general_dilated(
      x,
      kernel,
      (self.stride, self.stride),
      pads,
      dimension_numbers=("NHWC", "HWIO", "NHWC"),
      feature_group_count=channels,
    )


class ConvBN(nnx.Module):
  """Conv (no bias) → BatchNorm → optional ReLU.

  Attributes:
    conv: ``nnx.Conv`` with ``use_bias=False``; kernel HWIO at ``conv.kernel``.
    bn: ``nnx.BatchNorm`` over the output channels.
    relu: whether a ReLU follows the BatchNorm.
    blur: a stride-1 ``BlurPool`` applied to the input before ``conv``, or ``None``.

  Example:
    >>> layer = ConvBN(3, 16, kernel_size=3, rngs=nnx.Rngs(0))
    >>> layer(jnp.zeros((2, 32, 32, 3))).shape
    (2, 32, 32, 16)
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size: int = 3,
    *,
    strides: int = 1,
    padding: int | None = None,
    relu: bool = True,
    bn_scale_init: float = 1.0,
    kernel_init: nnx.Initializer = conv_kernel_init,
    blurpool: bool = False,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
    rngs: nnx.Rngs,
  ):
    """Builds the layer.

    Args:
      in_features: input channels.
      out_features: output channels (filters).
      kernel_size: square kernel size.
      strides: convolution stride.
      padding: symmetric zero padding on each side, PyTorch style; ``None`` means
        ``kernel_size // 2``. Explicit padding (not ``"SAME"``) keeps strided convs
        aligned exactly as in the papers' PyTorch models.
      relu: apply ReLU after BatchNorm.
      bn_scale_init: initial BatchNorm γ (ClickTrain's VGG uses 0.5).
      kernel_init: conv kernel initializer (He normal, fan_out, by default).
      blurpool: blur the input (3x3 binomial, stride 1, zero padding) before the conv, so a
        strided conv subsamples a low-passed signal (Zhang 2019; SDGP's ImageNet configs).
      dtype: compute dtype of the conv and of the layer's output (``None``: inferred from
        the input and parameters, Flax's default); BatchNorm normalises in float32.
      param_dtype: dtype of the conv kernel and BatchNorm γ/β (running statistics are always
        float32).
      rngs: NNX random streams.

    Raises:
      ValueError: a non-positive size or stride, a negative padding, or a non-floating
        ``dtype`` / ``param_dtype``.
    """
    dtype, param_dtype = check_precision(dtype, param_dtype)
    require_positive("in_features", in_features)
    require_positive("out_features", out_features)
    require_positive("kernel_size", kernel_size)
    require_positive("strides", strides)
    if padding is None:
      padding = kernel_size // 2
    if padding < 0:
      raise ValueError(f"padding must be >= 0, got {padding}")
    self.conv = nnx.Conv(
      in_features,
      out_features,
      (kernel_size, kernel_size),
      strides=(strides, strides),
      padding=((padding, padding), (padding, padding)),
      use_bias=False,
      kernel_init=kernel_init,
      # The weight gradient as a patch matmul on CPU (models/conv.py: XLA:CPU's own
      # recomputes a ResNet stage's residual stream for every layer's weight gradient).
      conv_general_dilated=conv_general_dilated,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
    )
    # dtype=None: BatchNorm promotes its input to its float32 statistics and parameters, so
    # it normalises in float32; __call__ casts the result back to the compute dtype.
    self.bn = nnx.BatchNorm(
      out_features,
      momentum=_BN_MOMENTUM,
      epsilon=_BN_EPSILON,
      scale_init=nnx.initializers.constant(bn_scale_init),
      param_dtype=param_dtype,
      rngs=rngs,
    )
    self.dtype = dtype
    self.relu = relu
    self.blur = BlurPool(stride=1) if blurpool else None

  @property
  def in_features(self) -> int:
    return self.conv.in_features

  @property
  def out_features(self) -> int:
    return self.conv.out_features

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.blur is not None:
      x = self.blur(x)
    y = self.bn(self.conv(x))
    if self.dtype is not None:
      y = y.astype(self.dtype)
    return jax.nn.relu(y) if self.relu else y


def _shortcut(
  in_features: int,
  out_features: int,
  strides: int,
  projection: bool,
  rngs: nnx.Rngs,
  blurpool: bool = False,
  precision: dict | None = None,
) -> ConvBN | None:
  if projection:
    # He et al. option B: 1x1 conv + BN, no ReLU (the ReLU comes after the sum).
    return ConvBN(
      in_features,
      out_features,
      1,
      strides=strides,
      padding=0,
      relu=False,
      blurpool=blurpool and strides > 1,
      rngs=rngs,
      **(precision or {}),
    )
  if strides != 1 or in_features != out_features:
    raise ValueError(
      "projection=False needs strides == 1 and in_features == out_features, got "
      f"strides={strides}, in_features={in_features}, out_features={out_features}"
    )
  return None


def _check_widths(widths: Sequence[int] | None, expected_len: int) -> tuple[int, ...] | None:
  if widths is None:
    return None
  widths = tuple(widths)
  if len(widths) != expected_len:
    raise ValueError(f"widths must have {expected_len} entries, got {widths!r}")
  for i, w in enumerate(widths):
    require_positive(f"widths[{i}]", w)
  return widths


class _ResidualBlock(nnx.Module):
  """Shared construction and forward of the residual blocks:
  ``relu(branch(x) + shortcut(x))``."""

  num_inner_widths: int
  branch_names: tuple[str, ...]

  def __init__(
    self,
    in_features: int,
    out_features: int,
    *,
    widths: Sequence[int] | None = (),
    strides: int = 1,
    projection: bool = False,
    blurpool: bool = False,
    dtype: jax.typing.DTypeLike | None = None,
    param_dtype: jax.typing.DTypeLike = jnp.float32,
    rngs: nnx.Rngs,
  ):
    """Builds the block.

    Args:
      in_features: block input channels.
      out_features: block output channels (the residual stream width).
      widths: the inner conv widths (see the class docstring); ``()`` (default) means
        the standard ones; ``None`` removes the branch.
      strides: stride of the block (on the 3x3 conv carrying it, and the projection).
      projection: use a 1x1 conv + BN shortcut; required when the shape changes.
      blurpool: with ``strides > 1``, blur the input of every strided conv (the one carrying
        the stride and the projection) first (``ConvBN(blurpool=True)``).
      dtype: compute dtype of every ``ConvBN`` (see :class:`ConvBN`).
      param_dtype: parameter dtype of every ``ConvBN``.
      rngs: NNX random streams.
    """
    require_positive("in_features", in_features)
    require_positive("out_features", out_features)
    if widths == ():
      widths = self._default_widths(out_features)
    widths = _check_widths(widths, self.num_inner_widths)
    blur = blurpool and strides > 1
    precision = {"dtype": dtype, "param_dtype": param_dtype}
    self.shortcut = _shortcut(in_features, out_features, strides, projection, rngs, blur, precision)
    if widths is None:
      for name in self.branch_names:
        setattr(self, name, None)
    else:
      layers = self._build_branch(in_features, out_features, widths, strides, rngs, blur, precision)
      for name, layer in zip(self.branch_names, layers, strict=True):
        setattr(self, name, layer)

  @staticmethod
  def _default_widths(out_features: int) -> tuple[int, ...]:
    raise NotImplementedError

  @staticmethod
  def _build_branch(
    in_features: int,
    out_features: int,
    widths: tuple[int, ...],
    strides: int,
    rngs: nnx.Rngs,
    blurpool: bool,
    precision: dict,
  ) -> list[ConvBN]:
    raise NotImplementedError

  @property
  def has_branch(self) -> bool:
    """False when the branch was removed (the block computes only its shortcut)."""
    return self.conv1 is not None

  def remove_branch(self) -> None:
    """Drops the branch (PruneTrain §4.1 layer removal).

    The block then computes ``relu(shortcut(x))``, its value with a zero branch output. With
    ``branch_names`` this declares the branch removable to :func:`jaxprune.prunetrain.reconfigure`.
    """
    for name in self.branch_names:
      setattr(self, name, None)

  def __call__(self, x: jax.Array) -> jax.Array:
    shortcut = x if self.shortcut is None else self.shortcut(x)
    if not self.has_branch:
      # PruneTrain layer removal: the branch output is zero.
      return jax.nn.relu(shortcut)
    y = x
    for name in self.branch_names:
      y = getattr(self, name)(y)
    return jax.nn.relu(y + shortcut)


class BasicBlock(_ResidualBlock):
  """He et al. basic block: 3x3 ConvBN → 3x3 ConvBN (no ReLU) + shortcut → ReLU.

  ``widths = (mid,)``: output width of ``conv1``; default ``(out_features,)``.

  Attributes:
    conv1: 3x3 ``ConvBN`` ``in → widths[0]`` with the block's stride (``None`` if removed).
    conv2: 3x3 ``ConvBN`` ``widths[0] → out``, no ReLU (``None`` if removed).
    shortcut: 1x1 projection ``ConvBN`` (no ReLU) or ``None`` for identity.

  Example:
    >>> block = BasicBlock(16, 32, strides=2, projection=True, rngs=nnx.Rngs(0))
    >>> block(jnp.zeros((1, 8, 8, 16))).shape
    (1, 4, 4, 32)
  """

  num_inner_widths = 1
  branch_names = ("conv1", "conv2")

  @staticmethod
  def _default_widths(out_features: int) -> tuple[int, ...]:
    return (out_features,)

  @staticmethod
  def _build_branch(in_features, out_features, widths, strides, rngs, blurpool, precision):
    return [
      ConvBN(in_features, widths[0], 3, strides=strides, blurpool=blurpool, rngs=rngs, **precision),
      ConvBN(widths[0], out_features, 3, relu=False, rngs=rngs, **precision),
    ]


class Bottleneck(_ResidualBlock):
  """Bottleneck block: 1x1 → 3x3 → 1x1 (no ReLU) + shortcut → ReLU.

  ResNet v1.5: the stride is on the 3x3 conv, as in PruneTrain's, kuangliu's and torchvision's code.

  ``widths = (w1, w2)``: output widths of ``conv1`` and ``conv2``; default
  ``(out_features // 4,) * 2``.

  Attributes:
    conv1: 1x1 ``ConvBN`` ``in → widths[0]`` (``None`` if removed).
    conv2: 3x3 ``ConvBN`` ``widths[0] → widths[1]`` with the block's stride.
    conv3: 1x1 ``ConvBN`` ``widths[1] → out``, no ReLU.
    shortcut: 1x1 projection ``ConvBN`` (no ReLU) or ``None`` for identity.

  Example:
    >>> block = Bottleneck(16, 64, widths=(16, 16), projection=True, rngs=nnx.Rngs(0))
    >>> block(jnp.zeros((1, 8, 8, 16))).shape
    (1, 8, 8, 64)
  """

  num_inner_widths = 2
  branch_names = ("conv1", "conv2", "conv3")

  @staticmethod
  def _default_widths(out_features: int) -> tuple[int, ...]:
    return (max(out_features // 4, 1),) * 2

  @staticmethod
  def _build_branch(in_features, out_features, widths, strides, rngs, blurpool, precision):
    return [
      ConvBN(in_features, widths[0], 1, rngs=rngs, **precision),
      ConvBN(widths[0], widths[1], 3, strides=strides, blurpool=blurpool, rngs=rngs, **precision),
      ConvBN(widths[1], out_features, 1, relu=False, rngs=rngs, **precision),
    ]


def global_avg_pool(x: jax.Array) -> jax.Array:
  """Mean over the spatial axes of an NHWC tensor → ``(N, C)``."""
  return jnp.mean(x, axis=(1, 2))
