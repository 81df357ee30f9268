"""Model registry: ``create(name, *, num_classes, rngs)`` and ``available()``.

Names are ``"<family>-<arch>"``; the family is the paper whose definition the model follows
(docs/design.md): PruneTrain and ClickTrain use different networks under the same name, e.g.
``prunetrain-resnet32`` (0.47 M parameters) vs ``clicktrain-resnet32`` (20.1 M).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprune.models.resnet import (
  ResNet,
  clicktrain_resnet_spec,
  imagenet_resnet_spec,
  prunetrain_resnet_spec,
)
from jaxprune.models.resnet9 import ResNet9, sdgp_resnet9_spec
from jaxprune.models.vgg import VGG, clicktrain_vgg_spec, prunetrain_vgg_spec

__all__ = ["available", "create", "default_spec", "param_count"]

# name -> (model class, zero-argument spec factory)
_REGISTRY: dict[str, tuple[type[nnx.Module], Callable[[], Any]]] = {
  **{
    f"prunetrain-resnet{d}": (ResNet, lambda d=d: prunetrain_resnet_spec(d))
    for d in (20, 32, 56, 50)
  },
  **{f"prunetrain-vgg{d}": (VGG, lambda d=d: prunetrain_vgg_spec(d)) for d in (11, 13)},
  **{
    f"clicktrain-resnet{d}": (ResNet, lambda d=d: clicktrain_resnet_spec(d))
    for d in (18, 32, 34, 50)
  },
  **{f"clicktrain-vgg{d}": (VGG, lambda d=d: clicktrain_vgg_spec(d)) for d in (11, 13, 16)},
  "sdgp-resnet9": (ResNet9, sdgp_resnet9_spec),
  **{f"imagenet-resnet{d}": (ResNet, lambda d=d: imagenet_resnet_spec(d)) for d in (18, 50)},
}


def available() -> list[str]:
  """Registered model names, sorted."""
  return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[type[nnx.Module], Callable[[], Any]]:
  if name not in _REGISTRY:
    raise ValueError(f"unknown model name {name!r}; available: {', '.join(available())}")
  return _REGISTRY[name]


def default_spec(name: str) -> Any:
  """The width spec of registered model ``name``.

  A ``ResNetSpec``, ``VGGSpec`` or ``ResNet9Spec``.
  """
  return _lookup(name)[1]()


def create(
  name: str,
  *,
  num_classes: int,
  rngs: nnx.Rngs,
  width_multiplier: float = 1.0,
  spec: Any = None,
  dtype: jax.typing.DTypeLike | None = None,
  param_dtype: jax.typing.DTypeLike = jnp.float32,
  **spec_overrides: Any,
) -> nnx.Module:
  """Builds a registered model.

  Args:
    name: one of ``available()``, e.g. ``"prunetrain-resnet32"``.
    num_classes: number of output logits.
    rngs: NNX random streams (``nnx.Rngs(seed)``); a ``dropout`` stream is used by VGGs if
      present, else the default one.
    width_multiplier: scale every width by this factor (rounded, at least 1), for narrower
      models on small compute budgets.
    spec: a full spec replacing the registered one (e.g. a pruned model's ``model.spec``).
    dtype: compute dtype of the convs, dense layers and activations, as Flax's ``dtype``
      (``None``: float32, the inputs' and parameters' dtype; ``jnp.bfloat16`` for mixed
      precision). BatchNorm normalises in float32 and the logits are float32 whatever it is.
    param_dtype: dtype the parameters are stored in (BatchNorm statistics are float32).
    **spec_overrides: fields of the spec to replace, e.g. ``in_channels=1``.

  Returns:
    The model, in training mode (call ``model.eval()`` for inference).

  Raises:
    ValueError: unknown ``name`` (the message lists the available ones), an unknown spec
      field, an invalid spec, ``rngs`` that is not an ``nnx.Rngs``, or a ``dtype`` /
      ``param_dtype`` that is not a floating-point dtype.

  Example:
    >>> model = create("prunetrain-resnet32", num_classes=10, rngs=nnx.Rngs(0))
    >>> half = create("clicktrain-vgg11", num_classes=100, rngs=nnx.Rngs(0),
    ...               width_multiplier=0.5)
    >>> mixed = create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  """
  # Caught here: a missing Rngs otherwise fails deep inside the first Flax layer.
  if not isinstance(rngs, nnx.Rngs):
    raise ValueError(f"rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {rngs!r}")
  model_class, spec_factory = _lookup(name)
  if spec is None:
    spec = spec_factory()
  if width_multiplier != 1.0:
    spec = spec.scaled(width_multiplier)
  if spec_overrides:
    fields = {f.name for f in dataclasses.fields(spec)}
    unknown = sorted(set(spec_overrides) - fields)
    if unknown:
      raise ValueError(f"unknown spec field(s) {unknown} for {name!r}; fields: {sorted(fields)}")
    spec = dataclasses.replace(spec, **spec_overrides)
  return model_class(spec, num_classes=num_classes, rngs=rngs, dtype=dtype, param_dtype=param_dtype)


def param_count(model: nnx.Module) -> int:
  """Number of trainable parameters (``nnx.Param`` entries).

  Conv/linear weights, biases, BN γ/β; not BN running statistics. Works on abstract models from
  ``nnx.eval_shape``.

  Example:
    >>> abstract = nnx.eval_shape(lambda: create("imagenet-resnet50", num_classes=1000,
    ...                                          rngs=nnx.Rngs(0)))
    >>> param_count(abstract)
    25557032
  """
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in leaves)
