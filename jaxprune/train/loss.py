"""Classification loss and metrics: softmax cross-entropy with label smoothing.

Labels are either integer class ids ``[B]`` or soft label distributions ``[B, C]``
(mixup, as used after ClickTrain's hard prune). Label smoothing follows Szegedy et
al. (2016): the target becomes ``(1 - eps) * y + eps / C``, which is what the SDGP
CIFAR recipe (ffcv ResNet-9, smoothing 0.1) uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _targets(labels: jax.Array, num_classes: int, label_smoothing: float) -> jax.Array:
  """Target distributions ``[B, C]`` from int or soft labels."""
  labels = jnp.asarray(labels)
  if labels.ndim == 1:
    if not isinstance(labels, jax.core.Tracer):
      bad = (labels < 0) | (labels >= num_classes)
      if bool(jnp.any(bad)):
        raise ValueError(
          f"labels: class ids must be in [0, {num_classes}) (the logits' classes), got "
          f"{labels[bad].tolist()[:5]}"
        )
    targets = jax.nn.one_hot(labels, num_classes, dtype=jnp.float32)
    # Under jit the ids are unknown: one_hot of an out-of-range id is all zeros, which would
    # give a silent zero loss; a NaN row instead shows in the logged loss and poisons the step.
    valid = (labels >= 0) & (labels < num_classes)
    targets = jnp.where(valid[:, None], targets, jnp.nan)
  elif labels.ndim == 2:
    if labels.shape[-1] != num_classes:
      raise ValueError(
        f"labels: soft labels have {labels.shape[-1]} classes, logits have {num_classes}"
      )
    targets = labels.astype(jnp.float32)
  else:
    raise ValueError(f"labels: expected shape [B] or [B, C], got {labels.shape}")
  if label_smoothing:
    targets = targets * (1.0 - label_smoothing) + label_smoothing / num_classes
  return targets


def cross_entropy_per_example(
  logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0
) -> jax.Array:
  """Per-example softmax cross-entropy ``[B]``.

  Args:
    logits: ``[B, C]`` unnormalised scores.
    labels: int class ids ``[B]`` or soft labels ``[B, C]`` (rows sum to 1).
    label_smoothing: ``eps`` in ``[0, 1)``; target = ``(1 - eps) y + eps / C``.

  Returns:
    ``[B]`` float32 losses. Under ``jax.jit`` (ids unknown when tracing) a row whose class id
    is outside ``[0, C)`` gets a NaN loss, so a data set with more classes than the model shows
    NaN in the logged loss instead of training on a silent zero loss.

  Raises:
    ValueError: if ``labels`` are concrete int ids outside ``[0, C)``, or shapes do not fit.

  Example:
    >>> cross_entropy_per_example(jnp.zeros((2, 4)), jnp.array([0, 3])).round(4)
    Array([1.3863, 1.3863], dtype=float32)
  """
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
  if logits.ndim != 2:
    raise ValueError(f"logits: expected shape [B, C], got {logits.shape}")
  targets = _targets(labels, logits.shape[-1], label_smoothing)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.sum(targets * log_probs, axis=-1)


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
  """Mean softmax cross-entropy over the batch (see :func:`cross_entropy_per_example`)."""
  return jnp.mean(cross_entropy_per_example(logits, labels, label_smoothing))


def correct_per_example(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """``[B]`` float32: 1 where argmax(logits) is the label (argmax of soft labels)."""
  true_class = labels if labels.ndim == 1 else jnp.argmax(labels, axis=-1)
  return (jnp.argmax(logits, axis=-1) == true_class).astype(jnp.float32)


def accuracy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Fraction of examples whose top-1 prediction is the (argmax) label."""
  return jnp.mean(correct_per_example(logits, labels))
