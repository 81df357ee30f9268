"""Gradient-times-weight importance scores (ClickTrain §4.1).

ClickTrain estimates the importance of a weight ``w`` with gradient ``g`` as
``(g * w) ** 2`` (Molchanov et al., the first-order Taylor estimate of the
loss change when the weight is removed). A *pattern* ``p`` is a mask over one
``kh x kw`` kernel; its score is the sum of the importance of the weights it
keeps (ClickTrain Eq. 1). A *kernel* ``W[:, :, c, f]`` scores the sum of all its
weights' importance (ClickTrain Eq. 2).

Conv kernels are HWIO: ``w.shape == (kh, kw, Cin, Cout)`` and one kernel
(input channel ``c``, filter ``f``) is ``w[:, :, c, f]``. Scores come out as
``(Cin, Cout[, P])`` so that they index kernels the way the weights do.

Example::

        import jax.numpy as jnp
        from jaxprune.clicktrain import importance, patterns

        pool = patterns.library_patterns()              # (12, 3, 3)
        s = importance.pattern_scores(w, g, pool)       # (Cin, Cout, 12)
        best = jnp.argmax(s, axis=-1)                   # best pattern per kernel
        k = importance.kernel_scores(w, g)              # (Cin, Cout)

References:
  Zhang et al., "ClickTrain: Efficient and Accurate End-to-End Deep Learning Training via
  Fine-Grained Architecture-Preserving Pruning", ICS 2021. https://arxiv.org/abs/2011.10170
  Molchanov et al., "Importance Estimation for Neural Network Pruning", CVPR 2019.
  https://arxiv.org/abs/1906.10771
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["weight_importance", "pattern_scores", "kernel_scores"]


def _check_conv_pair(w: jnp.ndarray, g: jnp.ndarray) -> None:
  if jnp.ndim(w) != 4:
    raise ValueError(f"w must be a 4-D HWIO conv kernel, got shape {jnp.shape(w)}")
  if jnp.shape(g) != jnp.shape(w):
    raise ValueError(f"g must have the shape of w {jnp.shape(w)}, got {jnp.shape(g)}")


def weight_importance(w: jnp.ndarray, g: jnp.ndarray) -> jnp.ndarray:
  """Per-weight importance ``(g * w) ** 2`` (ClickTrain §4.1).

  Args:
      w: weights, any shape.
      g: gradient of the loss w.r.t. ``w``, same shape.

  Returns:
      An array of ``w``'s shape, in float32 at least.
  """
  if jnp.shape(g) != jnp.shape(w):
    raise ValueError(f"g must have the shape of w {jnp.shape(w)}, got {jnp.shape(g)}")
  dtype = jnp.promote_types(jnp.result_type(w, g), jnp.float32)
  t = jnp.asarray(g, dtype) * jnp.asarray(w, dtype)
  return t * t


def pattern_scores(w: jnp.ndarray, g: jnp.ndarray, patterns: jnp.ndarray) -> jnp.ndarray:
  """Score every pattern for every kernel (ClickTrain Eq. 1).

  ``I_p[c, f] = sum_{h, s} (g[h, s, c, f] * w[h, s, c, f] * p[h, s]) ** 2``.

  Args:
      w: HWIO conv kernel ``(kh, kw, Cin, Cout)``.
      g: its gradient, same shape.
      patterns: masks ``(P, kh, kw)`` (binary in ClickTrain; any real weights
          work, they enter squared as in Eq. 1).

  Returns:
      ``(Cin, Cout, P)`` scores.

  Raises:
      ValueError: ``w`` not 4-D, ``g`` of another shape, or ``patterns`` not
          ``(P, kh, kw)``.
  """
  _check_conv_pair(w, g)
  kh, kw = jnp.shape(w)[:2]
  if jnp.ndim(patterns) != 3 or tuple(jnp.shape(patterns)[1:]) != (kh, kw):
    raise ValueError(f"patterns must have shape (P, {kh}, {kw}), got {jnp.shape(patterns)}")
  imp = weight_importance(w, g)
  p = jnp.asarray(patterns, imp.dtype)
  # (g*w*p)^2 = (g*w)^2 * p^2: one (Cin*Cout, kh*kw) x (kh*kw, P) matmul.
  return jnp.einsum("hwio,phw->iop", imp, p * p)


def kernel_scores(w: jnp.ndarray, g: jnp.ndarray) -> jnp.ndarray:
  """Score every kernel (ClickTrain Eq. 2): ``sum_{h, s} (g * w) ** 2``.

  Args:
      w: HWIO conv kernel ``(kh, kw, Cin, Cout)``.
      g: its gradient, same shape.

  Returns:
      ``(Cin, Cout)`` scores.

  Raises:
      ValueError: ``w`` not 4-D or ``g`` of another shape.
  """
  _check_conv_pair(w, g)
  return jnp.sum(weight_importance(w, g), axis=(0, 1))
