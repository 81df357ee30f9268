"""Pattern-sparse convolution on a fixed-position layout (ClickTrain §5.2).

``pattern_conv(x, kernel, layout)`` computes the same thing as
``lax.conv_general_dilated(x, kernel * mask)`` (NHWC × HWIO) but touches only the kept
weights: the forward pass is an SpMM of the ``(Cout, width)`` filter values with the unfolded
input, the data gradient is the same product with the layout's transpose (folded back), and
the weight gradient is computed at the kept positions only (§5.2, "Backward Phase
Acceleration"). The kernel argument stays the dense HWIO parameter, so the optimizer, the
masks and checkpoints see the model exactly as before; its gradient is zero at pruned
positions.

Backends, chosen per call (per layer by :mod:`jaxprune.clicktrain.execution.conversion`):

* ``"reference"`` — pure JAX: the gathered SpMM, one kept column per step (the data gradient
  on the layout's transpose, gathers only). The CPU path and the oracle of the GPU kernels.
* ``"pallas"`` — the Pallas GPU kernels of :mod:`pallas_kernels.pattern_spmm` on the
  transposed, coalesced form (``Yt = W · Xt`` with ``Xt (Cin·kh·kw, N·OH·OW)`` the unfolded
  input): forward SpMM, the data gradient as the same SpMM on the layout's transpose
  (``dXt = Wᵀ · dYt``, folded back by the patch extraction's VJP), and the kept-position
  weight gradient. Compiled when lowered for CUDA, interpreted (slow, exact) elsewhere.
* ``"auto"`` — the Pallas kernels when lowered for CUDA and the shapes are supported, the
  reference otherwise (chosen per lowering platform, so one jitted function serves both), and
  the reference everywhere when this JAX has no Pallas Triton backend
  (:func:`pallas_kernels.triton_available`), where an explicit ``"pallas"`` raises.
* ``"dense"`` — the dense masked convolution (cuDNN / XLA), the fallback for layers whose
  sparsity is too low to pay (§5.2: 65% on the paper's GPU).

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

import pallas_kernels
from jaxprune._conv_args import canonical_padding, spatial_pair
from jaxprune.clicktrain.execution.pattern_layout import (
  PatternLayout,
  to_dense,
  to_values,
  transposed_values,
)

__all__ = ["BACKENDS", "check_backend", "pattern_conv", "pattern_conv_values"]

BACKENDS = ("reference", "pallas", "auto", "dense")
_NHWC = ("NHWC", "HWIO", "NHWC")
# Patches with the feature axis first: (Cin·kh·kw, N, OH, OW) is Xt without a transpose.
_PATCHES_T = ("NHWC", "HWIO", "CNHW")


def _patches(x: jax.Array, hw: tuple[int, int], strides, padding, numbers=_NHWC) -> jax.Array:
  """``(N, OH, OW, Cin·kh·kw)``, features ordered ``c·kh·kw + i·kw + j``.

  With ``numbers=_PATCHES_T``: ``(Cin·kh·kw, N, OH, OW)``.
  """
  return lax.conv_general_dilated_patches(
    x, hw, strides, padding, dimension_numbers=numbers, precision=lax.Precision.HIGHEST
  )


def _spmm(patches: jax.Array, values: jax.Array, columns: jax.Array) -> jax.Array:
  """``Y[..., f] = Σ_j values[f, j] · patches[..., columns[f, j]]``."""

  def body(j, acc):
    gathered = jnp.take(patches, columns[:, j], axis=-1)  # (..., Cout)
    return acc + gathered * values[:, j]

  out = jnp.zeros(patches.shape[:-1] + (values.shape[0],), jnp.result_type(patches, values))
  return lax.fori_loop(0, values.shape[1], body, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _reference_conv(x, values, columns, valid, t_entries, t_valid, hw, strides, padding):
  return _spmm(_patches(x, hw, strides, padding), values, columns).astype(x.dtype)


def _reference_fwd(x, values, columns, valid, t_entries, t_valid, hw, strides, padding):
  patches = _patches(x, hw, strides, padding)
  out = _spmm(patches, values, columns).astype(x.dtype)
  return out, (x, values, columns, valid, t_entries, t_valid)


def _reference_bwd(hw, strides, padding, residuals, dy):
  x, values, columns, valid, t_entries, t_valid = residuals
  patches_fn = lambda v: _patches(v, hw, strides, padding)
  patches, patches_vjp = jax.vjp(patches_fn, x)
  values = jnp.where(valid, values, 0)

  # Data gradient: the transposed SpMM dX_col = Wᵀ · dY, folded back into dX.
  if t_entries is not None:
    # Gathers only: filter-matrix column r collects the kept weights that read it (the
    # layout's transpose), one entry per step, as the forward pass does per filter.
    t_values = jnp.where(t_valid, values.reshape(-1)[t_entries], 0).astype(dy.dtype)
    d_patches = _spmm(dy, t_values, t_entries // values.shape[1])
  else:
    # Without the transpose: every kept weight scatters its share of dY.
    def data_body(j, d_patches):
      return d_patches.at[..., columns[:, j]].add(dy * values[:, j].astype(dy.dtype))

    d_patches = lax.fori_loop(0, values.shape[1], data_body, jnp.zeros_like(patches, dy.dtype))
  (dx,) = patches_vjp(d_patches.astype(patches.dtype))

  # Weight gradient at the kept positions only: ⟨dY[..., f], patches[..., columns[f, j]]⟩.
  reduce_axes = tuple(range(dy.ndim - 1))

  def weight_body(j, d_values):
    gathered = jnp.take(patches, columns[:, j], axis=-1)
    return d_values.at[:, j].set(jnp.sum(gathered * dy, axis=reduce_axes).astype(d_values.dtype))

  d_values = lax.fori_loop(0, values.shape[1], weight_body, jnp.zeros_like(values))
  d_values = jnp.where(valid, d_values, 0)
  return dx.astype(x.dtype), d_values, None, None, None, None


_reference_conv.defvjp(_reference_fwd, _reference_bwd)


def check_backend(backend: str) -> None:
  """Raises unless ``backend`` is one of :data:`BACKENDS` and usable in this JAX.

  Raises:
    ValueError: an unknown ``backend``, or ``"pallas"`` where this JAX has no Pallas Triton
      backend (the message says to use ``"reference"``).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "pallas":
    pallas_kernels.check_triton("backend", backend)


# ---- Pallas backend: Yt = W · Xt on the transposed, coalesced form (ClickTrain §5.2) ----


def _kernels():
  # Imported on use, after the probe: a JAX without Pallas Triton runs the other backends.
  from pallas_kernels import pattern_spmm

  return pattern_spmm


def _pallas_forward(x, values, columns, hw, strides, padding, interpret):
  xt = _patches(x, hw, strides, padding, _PATCHES_T)  # (K, N, OH, OW)
  n_oh_ow = xt.shape[1:]
  yt = _kernels().spmm(
    values, columns, xt.reshape(xt.shape[0], -1), out_dtype=x.dtype, interpret=interpret
  )
  return jnp.transpose(yt.reshape((yt.shape[0],) + n_oh_ow), (1, 2, 3, 0))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _pallas_conv(x, values, columns, valid, t_entries, t_valid, *static):
  return _pallas_fwd(x, values, columns, valid, t_entries, t_valid, *static)[0]


def _pallas_fwd(x, values, columns, valid, t_entries, t_valid, *static):
  kernel_shape, strides, padding, interpret = static
  values = jnp.where(valid, values, 0)
  y = _pallas_forward(x, values, columns, kernel_shape[:2], strides, padding, interpret)
  return y, (x, PatternLayout(columns, valid, kernel_shape, t_entries, t_valid), values)


def _pallas_bwd(kernel_shape, strides, padding, interpret, residuals, dy):
  x, layout, values = residuals
  kernels = _kernels()
  patches_fn = lambda v: _patches(v, kernel_shape[:2], strides, padding, _PATCHES_T)
  xt, patches_vjp = jax.vjp(patches_fn, x)
  dyt = jnp.transpose(dy, (3, 0, 1, 2)).reshape(dy.shape[-1], -1)  # (Cout, P)
  # Data gradient (§5.2): the same SpMM on Wᵀ, whose values are one gather of W's at the
  # fixed transposed positions; the (K, P) result folds back through the patches' VJP.
  t_filters = layout.transposed_entries // layout.width
  dxt = kernels.spmm(
    transposed_values(values, layout), t_filters, dyt, out_dtype=xt.dtype, interpret=interpret
  )
  (dx,) = patches_vjp(dxt.reshape(xt.shape))
  # Weight gradient at the kept positions only.
  d_values = kernels.kept_weight_grad(
    dyt, xt.reshape(xt.shape[0], -1), layout.columns, out_dtype=values.dtype, interpret=interpret
  )
  d_values = jnp.where(layout.valid, d_values, 0)
  return dx.astype(x.dtype), d_values, None, None, None, None


_pallas_conv.defvjp(_pallas_fwd, _pallas_bwd)


def _pallas_supported(layout: PatternLayout, x: jax.Array, hw, strides, pad) -> bool:
  kh, kw, cin, cout = layout.kernel_shape
  out = jax.eval_shape(lambda v: _patches(v, hw, strides, pad, _PATCHES_T), x)
  points = out.size // max(out.shape[0], 1)
  return layout.transposed_entries is not None and _kernels().supports(cout, cin * kh * kw, points)


def pattern_conv_values(
  x: jax.Array,
  values: jax.Array,
  layout: PatternLayout,
  *,
  strides: int | Sequence[int] = (1, 1),
  padding="SAME",
  backend: str = "reference",
) -> jax.Array:
  """Convolution with a kernel given as its ``(Cout, width)`` values on ``layout``.

  Args:
    x: ``(N, H, W, Cin)`` input.
    values: ``(Cout, layout.width)`` kept weights
      (:func:`~jaxprune.clicktrain.execution.pattern_layout.to_values`).
    layout: the kernel's :class:`~jaxprune.clicktrain.execution.pattern_layout.PatternLayout`.
    strides: conv strides.
    padding: ``"SAME"``, ``"VALID"`` or ``((top, bottom), (left, right))``.
    backend: one of :data:`BACKENDS`.

  Returns:
    ``(N, OH, OW, Cout)``, equal to the dense conv with the masked kernel.

  Raises:
    ValueError: an unknown backend (or ``"pallas"`` without Pallas's Triton backend), bad
      strides / padding, or shapes that do not match.
  """
  check_backend(backend)
  kh, kw, cin, cout = layout.kernel_shape
  if x.ndim != 4 or x.shape[-1] != cin:
    raise ValueError(f"x must be NHWC with {cin} channels, got shape {tuple(x.shape)}")
  if tuple(values.shape) != (cout, layout.width):
    raise ValueError(f"values shape {tuple(values.shape)} is not {(cout, layout.width)}")
  strides = spatial_pair(strides, "strides")
  pad = canonical_padding(padding)
  if backend == "dense":
    kernel = to_dense(values, layout)
    return lax.conv_general_dilated(
      x, kernel.astype(x.dtype), strides, pad, dimension_numbers=_NHWC
    )
  reference = lambda x_, v_: _reference_conv(
    x_,
    v_,
    layout.columns,
    layout.valid,
    layout.transposed_entries,
    layout.transposed_valid,
    (kh, kw),
    strides,
    pad,
  )
  if backend == "reference":
    return reference(x, values)
  return _pallas_or_reference(x, values, layout, backend, reference, strides, pad)


def _pallas_or_reference(x, values, layout, backend, reference, strides, pad):
  """``"pallas"``: the kernels (interpreted off CUDA); ``"auto"``: them when lowered for CUDA."""
  if layout.transposed_entries is None:
    if backend == "pallas":
      raise ValueError("layout has no transposed index arrays; build it with build_layout")
    return reference(x, values)
  if not pallas_kernels.triton_available():  # "pallas" was refused by check_backend
    return reference(x, values)
  supported = _pallas_supported(layout, x, layout.kernel_shape[:2], strides, pad)
  if backend == "auto" and not supported:
    return reference(x, values)
  if not supported:
    raise ValueError(f"x: shape {tuple(x.shape)} is too large for the Pallas kernels")
  index = (layout.columns, layout.valid, layout.transposed_entries, layout.transposed_valid)
  pallas = lambda x_, v_, interpret: _pallas_conv(
    x_, v_, *index, layout.kernel_shape, strides, pad, interpret
  )
  # Per lowering platform, so one jitted function serves both: compiled Triton on CUDA;
  # elsewhere the interpreter ("pallas") or the reference ("auto").
  default = (lambda x_, v_: pallas(x_, v_, True)) if backend == "pallas" else reference
  return lax.platform_dependent(
    x, values, cuda=lambda x_, v_: pallas(x_, v_, False), default=default
  )


def pattern_conv(
  x: jax.Array,
  kernel: jax.Array,
  layout: PatternLayout,
  *,
  strides: int | Sequence[int] = (1, 1),
  padding="SAME",
  backend: str = "reference",
) -> jax.Array:
  """Convolution of ``x`` (NHWC) with the dense HWIO ``kernel`` masked to ``layout``.

  The values are gathered from ``kernel`` at the layout's fixed positions (§5.1) and the
  product runs on them (§5.2); the gradient with respect to ``kernel`` is the kept-position
  weight gradient scattered into a dense kernel with zeros elsewhere, so any Optax optimizer
  and ClickTrain's masks compose with it unchanged. Pruned entries of ``kernel`` are never
  read: a non-finite value there does not reach the output (the dense ``kernel * mask``
  would turn it into NaN), while a non-finite input read by a kept weight propagates as in
  the dense convolution.

  Args:
    x: ``(N, H, W, Cin)`` input.
    kernel: ``(kh, kw, Cin, Cout)`` dense kernel (its pruned entries are ignored).
    layout: built once by :func:`jaxprune.clicktrain.execution.pattern_layout.build_layout`.
    strides, padding, backend: see :func:`pattern_conv_values`.

  Returns:
    ``(N, OH, OW, Cout)``.

  Example:
    >>> layout = build_layout(mask)                        # doctest: +SKIP
    >>> y = pattern_conv(x, kernel, layout, strides=2)     # doctest: +SKIP
  """
  return pattern_conv_values(
    x, to_values(kernel, layout), layout, strides=strides, padding=padding, backend=backend
  )
