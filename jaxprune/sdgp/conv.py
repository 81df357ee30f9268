"""SDGP convolution: dense forward, input gradient from the N:M-pruned output gradient.

SDGP (McDanel et al., 2022, §III-A, Fig. 2/3): the output data gradient dL/dO of a conv is
pruned to N:M along its channel axis before the input data gradient dL/dD is computed; the
weight gradient dL/dW still uses the dense dL/dO (the paper copies dL/dO for that reason).

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprune._conv_args import canonical_padding, spatial_pair
from jaxprune.linen_bridge import refuse_bridged
from jaxprune.models.conversions import record_conversion, replace_submodule
from jaxprune.models.layers import kaiming_uniform_relu_init
from jaxprune.models.pluggable_conv import (
  BoundConv,
  ConvFunction,
  PluggableConv,
  conv_sharing_variables,
  next_call_key,
)
from jaxprune.sdgp._backward import SDGPKey, apply, check_out_channels
from jaxprune.sdgp.linear import SDGPLinear
from jaxprune.sdgp.prune import SDGPSettings
from pallas_kernels import nm_math

Array = jax.Array

_NHWC = ("NHWC", "HWIO", "NHWC")

# This call's key of an SDGP layer: split from its SDGPKey and advanced (the shared rule of
# conv layers that draw per call, data-parallel device folding included).
next_layer_key = next_call_key


@dataclasses.dataclass(frozen=True)
class PrunedDataGradient:
  """SDGP's backward pass around a conv function (:mod:`jaxprune.models.pluggable_conv`).

  A wrapper of the shared conv-function protocol: the forward pass is ``inner``'s; the VJP
  returns ``dW`` from ``inner``'s own VJP of the dense output gradient and ``dX`` from its VJP
  of the N:M-pruned one. Swapping ``inner`` (``jaxprune.models.with_base``) keeps the pruning:
  a sparse ``inner`` computes its sparse data gradient from the pruned output gradient.

  Attributes:
    settings: the N:M settings.
    inner: the wrapped conv function (default: ``lax.conv_general_dilated``).
  """

  settings: SDGPSettings
  inner: ConvFunction = jax.lax.conv_general_dilated

  def __call__(self, lhs: Array, rhs: Array, window_strides, padding, *, key=None, **geometry):
    """``inner(lhs, rhs, window_strides, padding, **geometry)`` with SDGP's VJP; ``key``:
    the call's PRNG key, required for the random methods."""
    conv_fn = BoundConv.bind(self.inner, window_strides, padding, **geometry)
    return apply(self.settings, conv_fn, lhs, rhs, key)


def with_pruned_data_gradient(
  conv_fn,
  x: Array,
  kernel: Array,
  *,
  n: int,
  m: int,
  method: str,
  key: Array | None = None,
  backend: str = "auto",
  rescale_eps: float | str | None = nm_math.RELEASED,
) -> Array:
  """``conv_fn(x, kernel)`` with SDGP's backward pass, for any convolution function.

  The VJP returns ``dW`` from ``conv_fn``'s own VJP of the dense output gradient and ``dX``
  from its VJP of ``nm_prune(dO, n, m, method, key=key)``. ``conv_fn`` keeps its own
  backward: a sparse convolution (``jaxprune.clicktrain.execution.pattern_conv``) then computes its
  sparse data gradient from the N:M-pruned output gradient, so the two methods compose.
  (A layer composes through :class:`PrunedDataGradient` instead.)

  Args:
    conv_fn: a hashable callable ``(x, kernel) -> y`` (e.g. a frozen dataclass); its last
      output axis (channels) must be divisible by ``m``.
    x, kernel: its arguments.
    n, m, method, key, backend, rescale_eps: as in :func:`jaxprune.sdgp.nm_prune`.

  Returns:
    ``conv_fn(x, kernel)``.
  """
  eps = nm_math.resolve_rescale_eps(method, rescale_eps)
  return apply(SDGPSettings(n, m, method, backend, eps), conv_fn, x, kernel, key)


def sdgp_conv(
  x: Array,
  kernel: Array,
  *,
  n: int,
  m: int,
  method: str,
  strides: int | Sequence[int] = (1, 1),
  padding="SAME",
  lhs_dilation: int | Sequence[int] = (1, 1),
  rhs_dilation: int | Sequence[int] = (1, 1),
  feature_group_count: int = 1,
  precision=None,
  key: Array | None = None,
  backend: str = "auto",
  rescale_eps: float | str | None = nm_math.RELEASED,
) -> Array:
  """2-D convolution (NHWC × HWIO) with SDGP's backward pass.

  Forward is ``lax.conv_general_dilated``. The VJP returns ``dW`` computed from the dense
  output gradient and ``dX`` computed from ``nm_prune(dO, n, m, method, key=key)`` — groups
  of ``m`` consecutive output channels at each (sample, h, w), the reduction axis of the
  input-gradient conv (SDGP §III-A). ``key`` is not differentiated; pass a fresh one per
  layer and step for ``"random"`` / ``"mvue"`` (``SDGPConv`` does this).

  Args:
    x: NHWC input.
    kernel: HWIO kernel; its output channels must be divisible by ``m``.
    n, m, method, backend, rescale_eps: as in ``jaxprune.sdgp.nm_prune`` (``rescale_eps``:
      ``"released"``, the default, the released code's ``1e-4`` under
      ``"rescaled_magnitude"``; ``None``, the ε-free rescale whose gradients scale exactly
      with the loss, which :class:`SDGPConv` and :func:`convert_model` use by default).
    strides, padding, lhs_dilation, rhs_dilation, feature_group_count, precision: as in
      ``lax.conv_general_dilated`` (``padding``: ``"SAME"``, ``"VALID"``, an int or
      ``((lo, hi), (lo, hi))``).
    key: PRNG key for the random methods.

  Returns:
    The NHWC convolution output.

  Example:
    >>> y = sdgp_conv(x, w, n=2, m=4, method="rescaled_magnitude")
    >>> dx, dw = jax.grad(lambda x, w: sdgp_conv(x, w, n=2, m=4,
    ...     method="magnitude").sum(), argnums=(0, 1))(x, w)
  """
  if x.ndim != 4:
    raise ValueError(f"x must be NHWC (4-D), got shape {x.shape}")
  if kernel.ndim != 4:
    raise ValueError(f"kernel must be HWIO (4-D), got shape {kernel.shape}")
  eps = nm_math.resolve_rescale_eps(method, rescale_eps)
  return PrunedDataGradient(SDGPSettings(n, m, method, backend, eps))(
    x,
    kernel,
    spatial_pair(strides, "strides"),
    canonical_padding(padding, ("SAME", "VALID", "SAME_LOWER")),
    lhs_dilation=spatial_pair(lhs_dilation, "lhs_dilation"),
    rhs_dilation=spatial_pair(rhs_dilation, "rhs_dilation"),
    dimension_numbers=_NHWC,
    feature_group_count=int(feature_group_count),
    precision=precision,
    key=key,
  )


# ---------------------------------------------------------------------------------------
# Flax NNX module and model converter
# ---------------------------------------------------------------------------------------


class SDGPConv(PluggableConv):
  """``nnx.Conv`` whose input gradient uses the N:M-pruned output gradient (SDGP).

  Same parameters (``kernel``, ``bias``) and forward as ``nnx.Conv``; only the VJP w.r.t.
  the input changes (see ``sdgp_conv``). Its convolution is a :class:`PrunedDataGradient`
  (a :class:`jaxprune.models.PluggableConv` conv function). For ``"random"`` / ``"mvue"``
  the layer holds an ``SDGPKey`` variable ``sdgp_key`` that is split on every call and passed
  to the convolution, so every layer and step draws fresh masks inside a jitted train step.

  Example:
    >>> conv = SDGPConv(64, 128, (3, 3), n=2, m=4, method="rescaled_magnitude",
    ...                 rngs=nnx.Rngs(0))
    >>> sdgp = SDGPConv.from_conv(nnx.Conv(64, 128, (3, 3), rngs=nnx.Rngs(0)),
    ...                           SDGPSettings(2, 4, "mvue"), key=jax.random.key(1))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size,
    strides=1,
    *,
    n: int | None = None,
    m: int | None = None,
    method: str | None = None,
    backend: str = "auto",
    rescale_eps: float | None = None,
    settings: SDGPSettings | None = None,
    key: Array | None = None,
    rngs: nnx.Rngs,
    **conv_kwargs,
  ):
    """Builds the layer; ``conv_kwargs`` are ``nnx.Conv``'s keyword arguments.

    Args:
      in_features, out_features, kernel_size, strides: as ``nnx.Conv``.
      n, m, method, backend, rescale_eps: as ``jaxprune.sdgp.nm_prune``; ``m`` divides
        out_features.
      settings: the same as one :class:`SDGPSettings`, instead of ``n``, ``m``, ``method``,
        ``backend`` and ``rescale_eps``.
      key: seed key of the random methods; default ``rngs.sdgp()`` (falls back to
        ``rngs.default``).
      rngs: ``nnx.Rngs`` for the parameters.
      **conv_kwargs: forwarded to ``nnx.Conv``.
    """
    if settings is None:
      settings = SDGPSettings(n, m, method, backend, rescale_eps)
    elif (n, m, method) != (None, None, None):
      raise ValueError("settings: give either settings or n, m and method, not both")
    check_out_channels("out_features", out_features, settings.m)
    if "conv_general_dilated" in conv_kwargs:
      raise ValueError("conv_general_dilated: SDGPConv sets its own convolution")
    super().__init__(
      in_features,
      out_features,
      kernel_size,
      strides,
      conv_general_dilated=PrunedDataGradient(settings),
      rngs=rngs,
      **conv_kwargs,
    )
    if settings.uses_key:
      if key is None:
        key = rngs.sdgp() if "sdgp" in rngs else rngs.default()
      self.sdgp_key = SDGPKey(key)
    else:
      self.sdgp_key = nnx.data(None)

  @property
  def settings(self) -> SDGPSettings:
    """The layer's N:M settings."""
    return self.conv_general_dilated.settings

  @property
  def n(self) -> int:
    return self.settings.n

  @property
  def m(self) -> int:
    return self.settings.m

  @property
  def method(self) -> str:
    return self.settings.method

  @classmethod
  def from_conv(
    cls, conv: nnx.Conv, settings: SDGPSettings, *, key: Array | None = None
  ) -> SDGPConv:
    """An ``SDGPConv`` sharing ``conv``'s ``kernel`` / ``bias`` Variables and settings."""
    if isinstance(conv, SDGPConv):
      raise ValueError("conv is already an SDGPConv")
    if settings.uses_key and key is None:
      raise ValueError(f"key is required for method {settings.method!r}")
    return conv_sharing_variables(cls, conv, settings=settings, key=key)


@dataclasses.dataclass(frozen=True)
class SDGPConversion:
  """:func:`convert_model`'s settings, recorded on the converted model.

  Recorded with :func:`jaxprune.models.record_conversion`, so that :func:`jaxprune.models.rebuild` —
  and through it PruneTrain's reconfiguration and the trainer's resume — converts the rebuilt model
  the same way. Created (and checked) once: the preset's ``convert`` is this object.

  ``settings`` are the N:M settings every converted conv gets. ``seed`` is an int or a key;
  it is stored as an int, ``(key_impl, key_data)`` for a typed key, or ``(None, key_data)``
  for a raw ``uint32`` key (hashable forms: the record is static). ``channel_multiple`` is
  ``m``: a converted conv's output channels must stay a multiple of it. ``reinit``:
  re-initialise every converted conv as the authors' released converter does (see
  :func:`convert_model`); a rebuild re-initialises the fresh model too, whose values the
  caller then overwrites, so the option never touches trained weights after the first call.

  Raises:
    ValueError: ``reinit`` is not a bool; when called, as :func:`convert_model` (a model
      with no conv to convert included, a rebuilt one too: it would silently stop being
      SDGP).
  """

  settings: SDGPSettings
  min_in_channels: int = 4
  seed: int | tuple | Array = 0
  reinit: bool = False
  layers: tuple[str, ...] = ("conv",)

  def __post_init__(self):
    if not isinstance(self.reinit, bool):
      raise ValueError(f"reinit must be a bool, got {self.reinit!r}")
    layers = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
    if not layers or not set(layers) <= {"conv", "linear"}:
      raise ValueError(f"layers must be a non-empty subset of ('conv', 'linear'), got {layers!r}")
    object.__setattr__(self, "layers", tuple(sorted(set(layers))))
    object.__setattr__(self, "seed", _hashable_seed(self.seed))

  @property
  def channel_multiple(self) -> int:
    return self.settings.m

  def key(self) -> Array:
    if isinstance(self.seed, int):
      return jax.random.key(self.seed)
    impl, data = self.seed
    data = jnp.asarray(np.asarray(data, np.uint32))
    return data if impl is None else jax.random.wrap_key_data(data, impl=impl)

  def __call__(self, model: nnx.Module) -> nnx.Module:
    """Converts ``model`` in place (see :func:`convert_model`) and records ``self`` on it."""
    refuse_bridged(
      model,
      what="SDGP replaces nnx.Conv layers and cannot reach the Linen convs inside it, which would "
      "keep their dense data gradient",
      instead="Inside a Linen module call jaxprune.sdgp.sdgp_conv(x, kernel, n=..., m=..., "
      "method=...) in place of the convolution, or write the model with flax.nnx layers",
    )
    n, m = self.settings.n, self.settings.m
    targets, dense_targets = [], []
    for path, module in nnx.iter_modules(model):
      # Converting twice would skip the SDGPConvs and silently keep the first N:M setting.
      if isinstance(module, (SDGPConv, SDGPLinear)):
        raise ValueError(
          f"model: already converted (the layer at {'/'.join(map(str, path)) or '<root>'} is "
          f"an {type(module).__name__} with n={module.settings.n}, m={module.settings.m}); "
          f"build a fresh model to convert it with n={n}, m={m}"
        )
      if (
        "linear" in self.layers
        and isinstance(module, nnx.Linear)
        and module.in_features >= self.min_in_channels
        and module.out_features % m == 0  # a 10-logit classifier keeps its dense backward
      ):
        if not path:
          raise ValueError("model: pass a model containing layers, not a layer itself")
        dense_targets.append((path, module))
      if "conv" not in self.layers:
        continue
      if isinstance(module, nnx.Conv) and module.in_features >= self.min_in_channels:
        if not path:
          raise ValueError("model: pass a model containing convs, not a conv itself")
        if module.out_features % m != 0:
          raise ValueError(
            f"model: conv at {'/'.join(map(str, path))} has {module.out_features} "
            f"output channels, not divisible by m={m}"
          )
        targets.append((path, module))
    if not targets and not dense_targets:
      raise ValueError(_no_targets_message(model, self.min_in_channels, self.layers, m))
    base_key = self.key()
    # A stream of its own: the random methods' per-layer keys stay what they were without it.
    init_base = jax.random.split(base_key)[1]
    for index, (path, conv) in enumerate(targets):
      key = jax.random.fold_in(base_key, index) if self.settings.uses_key else None
      new = SDGPConv.from_conv(conv, self.settings, key=key)
      if self.reinit:
        _reinitialise(new, jax.random.fold_in(init_base, index))
      replace_submodule(model, path, new)
    # After the convs, so a conv-only conversion keeps its keys when linear is added.
    for index, (path, linear) in enumerate(dense_targets, start=len(targets)):
      key = jax.random.fold_in(base_key, index) if self.settings.uses_key else None
      replace_submodule(model, path, SDGPLinear.from_linear(linear, self.settings, key=key))
    return record_conversion(model, self)


def _no_targets_message(
  model: nnx.Module, min_in_channels: int, layers: tuple[str, ...] = ("conv",), m: int = 1
) -> str:
  """Why a model has nothing to convert: what :class:`SDGPConversion` looked for, what it found."""
  convs = [
    f"{'/'.join(map(str, p))} ({mod.in_features} in)"
    for p, mod in nnx.iter_modules(model)
    if isinstance(mod, nnx.Conv)
  ]
  shown = ", ".join(convs[:6]) + (", ..." if len(convs) > 6 else "")
  found = (
    f"{len(convs)} nnx.Conv, all with fewer: {shown}"
    if convs
    else f"no nnx.Conv in {type(model).__name__} (a model without convolutions)"
  )
  if "linear" in layers:
    linears = [mod for _, mod in nnx.iter_modules(model) if isinstance(mod, nnx.Linear)]
    found += f", and {len(linears)} nnx.Linear, none with >= {min_in_channels} inputs and "
    found += f"output features divisible by m={m}"
  elif any(isinstance(mod, nnx.Linear) for _, mod in nnx.iter_modules(model)):
    found += "; its nnx.Linear layers convert with layers=('conv', 'linear')"
  return (
    f"model: SDGP prunes the data gradient of every {' and '.join(f'nnx.{k.title()}' for k in layers)} "
    f"with >= min_in_channels={min_in_channels} input channels and found {found}; nothing would "
    "be converted (train it with the dense method, or lower min_in_channels)"
  )


def _reinitialise(conv: nnx.Conv, key: Array) -> None:
  """The released converter builds each SDGP conv afresh: kernel
  ``kaiming_uniform_(nonlinearity="relu")``, U(±√(6 / fan_in)), bias zero."""
  kernel = conv.kernel
  kernel[...] = kaiming_uniform_relu_init(key, kernel.shape, kernel.dtype)
  if conv.bias is not None:
    conv.bias[...] = jnp.zeros(conv.bias.shape, conv.bias.dtype)


def _hashable_seed(seed: int | tuple | Array) -> int | tuple:
  if isinstance(seed, tuple):  # already in the stored form
    return seed
  if isinstance(seed, (int, np.integer)):
    return int(seed)
  if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
    return (str(jax.random.key_impl(seed)), tuple(np.asarray(jax.random.key_data(seed)).tolist()))
  return (None, tuple(np.asarray(seed).tolist()))


def convert_model(
  model: nnx.Module,
  *,
  n: int,
  m: int,
  method: str,
  min_in_channels: int = 4,
  seed: int | Array = 0,
  backend: str = "auto",
  reinit: bool = False,
  rescale_eps: float | None = None,
  layers: tuple[str, ...] = ("conv",),
) -> nnx.Module:
  """Swaps every ``nnx.Conv`` with ``>= min_in_channels`` inputs for an ``SDGPConv``, in place.

  SDGP applies N:M pruning to every conv's data gradient except the stem's (3 input
  channels, its input gradient is never used) and leaves Dense layers untouched, as the
  authors' code does. Weights are shared: each ``SDGPConv`` holds the original ``kernel`` /
  ``bias`` Variables, so ``nnx.state(model, nnx.Param)`` is unchanged and the gradients
  differ only through the pruned input gradients. The settings are recorded on the model
  (:class:`SDGPConversion`), so :func:`jaxprune.models.rebuild` re-applies them to a rebuilt
  model (e.g. after PruneTrain's reconfiguration).

  Args:
    model: any NNX module (mutated in place and returned).
    n, m, method, backend: as ``jaxprune.sdgp.nm_prune``.
    min_in_channels: convs with fewer input channels are kept (default 4: skip RGB stems).
    seed: int or key; layer ``i`` (in graph order) gets ``fold_in(key, i)``.
    rescale_eps: as ``jaxprune.sdgp.nm_prune`` (``1e-4``: the released rescale formula).
    reinit: re-initialise every converted conv the way the authors' released converter does
      (it builds each SDGP conv afresh): kernel U(-b, b) with b = √(6 / fan_in) (PyTorch's
      ``kaiming_uniform_`` with the ReLU gain; fan_in = kh·kw·in / groups), bias zero; layer
      ``i`` draws from ``fold_in(split(key)[1], i)``, so a seed reproduces it. Off by default:
      the converted convs keep their kernels bit for bit (weights are shared).
    layers: what to convert: ``("conv",)`` (the paper's and its code's), or with ``"linear"``
      also every ``nnx.Linear`` with ``>= min_in_channels`` inputs whose output features are a
      multiple of ``m`` into an :class:`~jaxprune.sdgp.SDGPLinear` (beyond the paper: a
      transformer's projections; a classifier of 10 logits keeps its dense backward).

  Returns:
    ``model``, with its convs replaced.

  Raises:
    ValueError: bad ``n``/``m``/``method``, a conv to convert whose output channels are
      not divisible by ``m`` (named in the message), a ``model`` already converted (it
      holds an ``SDGPConv``: converting again would keep the first N:M setting), or a
      ``model`` with no conv to convert (no ``nnx.Conv``, or none with ``min_in_channels``
      inputs: returned unchanged it would train dense under SDGP's name; the message lists
      the convs found).

  Example:
    >>> model = convert_model(models.create("sdgp-resnet9", num_classes=10,
    ...                       rngs=nnx.Rngs(0)), n=2, m=4, method="rescaled_magnitude")
  """
  settings = SDGPSettings(n, m, method, backend, rescale_eps)
  return SDGPConversion(settings, min_in_channels, seed, reinit, layers)(model)
