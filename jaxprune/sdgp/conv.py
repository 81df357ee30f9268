"""SDGP convolution: dense forward, input gradient from the N:M-pruned output gradient.

SDGP (McDanel et al., 2022, §III-A, Fig. 2/3): the output data gradient dL/dO of a conv is
pruned to N:M along its channel axis before the input data gradient dL/dD is computed; the
weight gradient dL/dW still uses the dense dL/dO (the paper copies dL/dO for that reason).

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import nm_math
from jaxprune._conv_args import canonical_padding, spatial_pair
from jaxprune.distributed import device_key
from jaxprune.models.conversions import record_conversion, replace_submodule
from jaxprune.models.layers import conv_sharing_variables, kaiming_uniform_relu_init
from jaxprune.sdgp.prune import BACKENDS, nm_prune

Array = jax.Array

_RANDOM_METHODS = ("random", "mvue")
_NHWC = ("NHWC", "HWIO", "NHWC")


def _check_out_channels(name: str, channels: int, m) -> None:
  # Groups run over output channels (the dX conv's reduction axis), so they must tile it.
  if isinstance(m, int) and m >= 1 and channels % m != 0:
    raise ValueError(f"{name}: {channels} output channels are not divisible by m={m}")


@dataclasses.dataclass(frozen=True)
class _ConvConfig:
  """Static (hashable) settings of one dense convolution: the conv function SDGP wraps."""

  strides: tuple[int, ...]
  padding: str | tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  feature_group_count: int
  precision: object

  def __call__(self, x: Array, kernel: Array) -> Array:
    return jax.lax.conv_general_dilated(
      x,
      kernel,
      self.strides,
      self.padding,
      lhs_dilation=self.lhs_dilation,
      rhs_dilation=self.rhs_dilation,
      dimension_numbers=_NHWC,
      feature_group_count=self.feature_group_count,
      precision=self.precision,
    )


@dataclasses.dataclass(frozen=True)
class _Pruning:
  """Static (hashable) N:M settings of the data-gradient pruning."""

  n: int
  m: int
  method: str
  backend: str


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _sdgp_apply(pruning: _Pruning, conv_fn, x: Array, kernel: Array, key: Array | None) -> Array:
  return conv_fn(x, kernel)


def _sdgp_apply_fwd(pruning, conv_fn, x, kernel, key):
  return conv_fn(x, kernel), (x, kernel, key)


def _sdgp_apply_bwd(pruning, conv_fn, residuals, cotangent):
  x, kernel, key = residuals
  # dW from the dense output gradient (SDGP §III-A: dL/dO is copied before pruning).
  _, weight_vjp = jax.vjp(lambda w: conv_fn(x, w), kernel)
  (d_kernel,) = weight_vjp(cotangent)
  # dX from the N:M-pruned output gradient (SDGP Alg. 1, groups on the channel axis).
  # The barrier keeps XLA from fusing (and so recomputing) the cotangent's producers into
  # the pruning pass: the cotangent is materialised once for the dW conv anyway.
  cotangent = jax.lax.optimization_barrier(cotangent)
  pruned = nm_prune(
    cotangent, pruning.n, pruning.m, pruning.method, key=key, backend=pruning.backend
  )
  _, input_vjp = jax.vjp(lambda x_: conv_fn(x_, kernel), x)
  (d_x,) = input_vjp(pruned)
  return d_x, d_kernel, None


_sdgp_apply.defvjp(_sdgp_apply_fwd, _sdgp_apply_bwd)


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
) -> Array:
  """``conv_fn(x, kernel)`` with SDGP's backward pass, for any convolution function.

  The VJP returns ``dW`` from ``conv_fn``'s own VJP of the dense output gradient and ``dX``
  from its VJP of ``nm_prune(dO, n, m, method, key=key)``. ``conv_fn`` keeps its own
  backward: a sparse convolution (``jaxprune.clicktrain.pattern_conv``) then computes its
  sparse data gradient from the N:M-pruned output gradient, so the two methods compose.

  Args:
    conv_fn: a hashable callable ``(x, kernel) -> y`` (e.g. a frozen dataclass); its last
      output axis (channels) must be divisible by ``m``.
    x, kernel: its arguments.
    n, m, method, key, backend: as in :func:`jaxprune.sdgp.nm_prune`.

  Returns:
    ``conv_fn(x, kernel)``.
  """
  _check_out_channels("kernel", kernel.shape[-1], m)
  nm_math.validate((1, kernel.shape[-1]), jnp.float32, n, m, method, key)
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  return _sdgp_apply(_Pruning(n, m, method, backend), conv_fn, x, kernel, key)


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
    n, m, method, backend: as in ``jaxprune.sdgp.nm_prune``.
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
  conv_fn = _ConvConfig(
    strides=spatial_pair(strides, "strides"),
    padding=canonical_padding(padding, ("SAME", "VALID", "SAME_LOWER")),
    lhs_dilation=spatial_pair(lhs_dilation, "lhs_dilation"),
    rhs_dilation=spatial_pair(rhs_dilation, "rhs_dilation"),
    feature_group_count=int(feature_group_count),
    precision=precision,
  )
  return with_pruned_data_gradient(
    conv_fn, x, kernel, n=n, m=m, method=method, key=key, backend=backend
  )


# ---------------------------------------------------------------------------------------
# Flax NNX module and model converter
# ---------------------------------------------------------------------------------------

# The key of the SDGPConv currently running; read by `_SDGPConvFunction` while nnx.Conv's
# __call__ runs (synchronously, at trace time), so SDGPConv reuses nnx.Conv's call logic
# (padding modes, masks, dtype promotion) unchanged.
_ACTIVE_KEY: contextvars.ContextVar = contextvars.ContextVar("sdgp_active_key", default=None)


@contextlib.contextmanager
def _active_key(key):
  token = _ACTIVE_KEY.set(key)
  try:
    yield
  finally:
    _ACTIVE_KEY.reset(token)


@dataclasses.dataclass(frozen=True)
class _SDGPConvFunction:
  """Drop-in for ``lax.conv_general_dilated`` inside ``nnx.Conv`` (a static attribute)."""

  n: int
  m: int
  method: str
  backend: str

  def __call__(
    self,
    inputs,
    kernel,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
    out_sharding=None,
    preferred_element_type=None,
  ):
    if inputs.ndim != 4:
      raise ValueError(f"SDGPConv supports 2-D convolutions only, got input {inputs.shape}")
    y = sdgp_conv(
      inputs,
      kernel,
      n=self.n,
      m=self.m,
      method=self.method,
      strides=window_strides,
      padding=padding,
      lhs_dilation=lhs_dilation or (1, 1),
      rhs_dilation=rhs_dilation or (1, 1),
      feature_group_count=feature_group_count,
      precision=precision,
      key=_ACTIVE_KEY.get(),
      backend=self.backend,
    )
    if preferred_element_type is not None:
      y = y.astype(preferred_element_type)
    return y


def next_layer_key(key_variable: SDGPKey | None) -> Array | None:
  """This call's key of an SDGP layer (``None`` for the deterministic methods).

  Splits the layer's :class:`SDGPKey` and advances it: a fresh key per call (= per layer and
  step), so SDGP draws new masks every iteration. Inside a data-parallel step
  (:func:`jaxprune.distributed.per_device_keys`) the returned key also folds in the device's
  index, so each device prunes its shard's gradient with its own draw, while the stored key
  advances as on one device.
  """
  if key_variable is None:
    return None
  state_key, key = jax.random.split(key_variable[...])
  key_variable[...] = state_key
  return device_key(key)


class SDGPKey(nnx.Variable):
  """PRNG key of an ``SDGPConv`` with a random method; advanced on every call.

  Not an ``nnx.Param``: a train step must carry it like BatchNorm statistics (``nnx.jit``
  and ``nnx.value_and_grad`` do; a functional loop must return ``nnx.state(model)``).
  """


class SDGPConv(nnx.Conv):
  """``nnx.Conv`` whose input gradient uses the N:M-pruned output gradient (SDGP).

  Same parameters (``kernel``, ``bias``) and forward as ``nnx.Conv``; only the VJP w.r.t.
  the input changes (see ``sdgp_conv``). For ``"random"`` / ``"mvue"`` the layer holds an
  ``SDGPKey`` variable ``sdgp_key`` that is split on every call, so every layer and step
  draws fresh masks inside a jitted train step.

  Example:
    >>> conv = SDGPConv(64, 128, (3, 3), n=2, m=4, method="rescaled_magnitude",
    ...                 rngs=nnx.Rngs(0))
    >>> sdgp = SDGPConv.from_conv(nnx.Conv(64, 128, (3, 3), rngs=nnx.Rngs(0)),
    ...                           n=2, m=4, method="mvue", key=jax.random.key(1))
  """

  def __init__(
    self,
    in_features: int,
    out_features: int,
    kernel_size,
    strides=1,
    *,
    n: int,
    m: int,
    method: str,
    key: Array | None = None,
    backend: str = "auto",
    rngs: nnx.Rngs,
    **conv_kwargs,
  ):
    """Builds the layer; ``conv_kwargs`` are ``nnx.Conv``'s keyword arguments.

    Args:
      in_features, out_features, kernel_size, strides: as ``nnx.Conv``.
      n, m, method, backend: as ``jaxprune.sdgp.nm_prune``; ``m`` divides out_features.
      key: seed key of the random methods; default ``rngs.sdgp()`` (falls back to
        ``rngs.default``).
      rngs: ``nnx.Rngs`` for the parameters.
      **conv_kwargs: forwarded to ``nnx.Conv``.
    """
    _check_out_channels("out_features", out_features, m)
    nm_math.validate((1, out_features), jnp.float32, n, m, method, key=0)
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if "conv_general_dilated" in conv_kwargs:
      raise ValueError("conv_general_dilated: SDGPConv sets its own convolution")
    padding = conv_kwargs.get("padding", "SAME")
    if isinstance(padding, str) and padding.upper() in ("CIRCULAR", "REFLECT", "CAUSAL"):
      raise ValueError(f"padding {padding!r} is not supported by SDGPConv")
    super().__init__(
      in_features,
      out_features,
      kernel_size,
      strides,
      conv_general_dilated=_SDGPConvFunction(n, m, method, backend),
      rngs=rngs,
      **conv_kwargs,
    )
    self.n = n
    self.m = m
    self.method = method
    if method in _RANDOM_METHODS:
      if key is None:
        key = rngs.sdgp() if "sdgp" in rngs else rngs.default()
      self.sdgp_key = SDGPKey(key)
    else:
      self.sdgp_key = nnx.data(None)

  @classmethod
  def from_conv(
    cls,
    conv: nnx.Conv,
    *,
    n: int,
    m: int,
    method: str,
    key: Array | None = None,
    backend: str = "auto",
  ) -> SDGPConv:
    """An ``SDGPConv`` sharing ``conv``'s ``kernel`` / ``bias`` Variables and settings."""
    if isinstance(conv, SDGPConv):
      raise ValueError("conv is already an SDGPConv")
    if method in _RANDOM_METHODS and key is None:
      raise ValueError(f"key is required for method {method!r}")
    return conv_sharing_variables(cls, conv, n=n, m=m, method=method, key=key, backend=backend)

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    with _active_key(next_layer_key(self.sdgp_key)):
      return super().__call__(inputs, out_sharding=out_sharding)


@dataclasses.dataclass(frozen=True)
class SDGPConversion:
  """:func:`convert_model`'s settings, recorded on the converted model
  (:func:`jaxprune.models.record_conversion`), so that :func:`jaxprune.models.rebuild` — and
  through it PruneTrain's reconfiguration and the trainer's resume — converts the rebuilt
  model the same way.

  ``seed`` is an int, or ``(key_impl, key_data)`` for a seed given as a typed key, or
  ``(None, key_data)`` for a raw ``uint32`` key (hashable forms: the record is static).
  ``channel_multiple`` is ``m``: a converted conv's output channels must stay a multiple of it.
  ``reinit``: re-initialise every converted conv as the authors' released converter does
  (see :func:`convert_model`); a rebuild re-initialises the fresh model too, whose values the
  caller then overwrites, so the option never touches trained weights after the first call.
  """

  n: int
  m: int
  method: str
  min_in_channels: int
  seed: int | tuple
  backend: str
  reinit: bool = False

  @property
  def channel_multiple(self) -> int:
    return self.m

  def key(self) -> Array:
    if isinstance(self.seed, int):
      return jax.random.key(self.seed)
    impl, data = self.seed
    data = jnp.asarray(np.asarray(data, np.uint32))
    return data if impl is None else jax.random.wrap_key_data(data, impl=impl)

  def __call__(self, model: nnx.Module) -> nnx.Module:
    """Converts ``model`` in place (see :func:`convert_model`) and records ``self`` on it."""
    n, m, method = self.n, self.m, self.method
    nm_math.validate((1, m), jnp.float32, n, m, method, key=0)
    targets = []
    for path, module in nnx.iter_modules(model):
      # Converting twice would skip the SDGPConvs and silently keep the first N:M setting.
      if isinstance(module, SDGPConv):
        raise ValueError(
          f"model: already converted (conv at {'/'.join(map(str, path)) or '<root>'} is an "
          f"SDGPConv with n={module.n}, m={module.m}); build a fresh model to convert it with "
          f"n={n}, m={m}"
        )
      if (
        isinstance(module, nnx.Conv)
        and not isinstance(module, SDGPConv)
        and module.in_features >= self.min_in_channels
      ):
        if not path:
          raise ValueError("model: pass a model containing convs, not a conv itself")
        if module.out_features % m != 0:
          raise ValueError(
            f"model: conv at {'/'.join(map(str, path))} has {module.out_features} "
            f"output channels, not divisible by m={m}"
          )
        targets.append((path, module))
    base_key = self.key()
    # A stream of its own: the random methods' per-layer keys stay what they were without it.
    init_base = jax.random.split(base_key)[1]
    for index, (path, conv) in enumerate(targets):
      key = jax.random.fold_in(base_key, index) if method in _RANDOM_METHODS else None
      new = SDGPConv.from_conv(conv, n=n, m=m, method=method, key=key, backend=self.backend)
      if self.reinit:
        _reinitialise(new, jax.random.fold_in(init_base, index))
      replace_submodule(model, path, new)
    return record_conversion(model, self)


def _reinitialise(conv: nnx.Conv, key: Array) -> None:
  """The released converter builds each SDGP conv afresh: kernel
  ``kaiming_uniform_(nonlinearity="relu")``, U(±√(6 / fan_in)), bias zero."""
  kernel = conv.kernel
  kernel[...] = kaiming_uniform_relu_init(key, kernel.shape, kernel.dtype)
  if conv.bias is not None:
    conv.bias[...] = jnp.zeros(conv.bias.shape, conv.bias.dtype)


def _hashable_seed(seed: int | Array) -> int | tuple:
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
    reinit: re-initialise every converted conv the way the authors' released converter does
      (it builds each SDGP conv afresh): kernel U(-b, b) with b = √(6 / fan_in) (PyTorch's
      ``kaiming_uniform_`` with the ReLU gain; fan_in = kh·kw·in / groups), bias zero; layer
      ``i`` draws from ``fold_in(split(key)[1], i)``, so a seed reproduces it. Off by default:
      the converted convs keep their kernels bit for bit (weights are shared).

  Returns:
    ``model``, with its convs replaced.

  Raises:
    ValueError: bad ``n``/``m``/``method``, a conv to convert whose output channels are
      not divisible by ``m`` (named in the message), or a ``model`` already converted (it
      holds an ``SDGPConv``: converting again would keep the first N:M setting).

  Example:
    >>> model = convert_model(models.create("sdgp-resnet9", num_classes=10,
    ...                       rngs=nnx.Rngs(0)), n=2, m=4, method="rescaled_magnitude")
  """
  if not isinstance(reinit, bool):
    raise ValueError(f"reinit must be a bool, got {reinit!r}")
  conversion = SDGPConversion(
    n, m, method, min_in_channels, _hashable_seed(seed), backend, reinit=reinit
  )
  return conversion(model)
