"""SDGP as a :class:`jaxprune.methods.Method`: the registry's ``sdgp``.

References:
  McDanel, Dinh and Magallanes, "Accelerating DNN Training with Structured Data Gradient
  Pruning", arXiv 2022. https://arxiv.org/abs/2202.00774
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxprune import models
from jaxprune.method_api import Method
from jaxprune.sdgp.conv import SDGPConversion
from jaxprune.sdgp.prune import SDGPSettings
from pallas_kernels import nm_math

__all__ = ["PAPER_MODELS", "method", "paper_method", "paper_model"]

# The networks of the released configs: the 2x-wide ffcv ResNet-9 on CIFAR-10 and torchvision's
# ResNet-50 with BlurPool (``use_blurpool: 1`` in every ImageNet config) on ImageNet.
PAPER_MODELS = {
  "cifar10": ("sdgp-resnet9", {}),
  "imagenet": ("imagenet-resnet50", {"blurpool": True}),
}


def method(
  *,
  n: int = 2,
  m: int = 4,
  method: str = "rescaled_magnitude",
  min_in_channels: int = 4,
  seed: int = 0,
  backend: str = "auto",
  reinit: bool = False,
  rescale_eps: float | None = None,
  layers: tuple[str, ...] = ("conv",),
) -> Method:
  """SDGP (N:M pruning of each conv's output data gradient) as a method.

  ``convert`` is one :class:`jaxprune.sdgp.SDGPConversion` (what
  :func:`jaxprune.sdgp.convert_model` applies), built and checked here; the optimizer is the
  user's, unchanged (the weight gradient stays dense). The default is the paper's best, rescaled
  magnitude 2:4 (Table I).

  Args:
    n, m: keep ``n`` of every ``m`` consecutive channels of the output gradient.
    method: ``"random"``, ``"magnitude"``, ``"rescaled_magnitude"`` or ``"mvue"``.
    min_in_channels, seed, backend, reinit: as :func:`jaxprune.sdgp.convert_model`
      (``reinit=True``: the released code's Kaiming-uniform re-initialisation; off here,
      on in :func:`paper_method`). ``backend="auto"`` runs, per lowering platform, the N:M
      backend that made the train step faster there (:data:`jaxprune.sdgp.MEASURED_FASTER`:
      the pure-JAX reference on CUDA, where it beat the Pallas kernel on an H100);
      ``"pallas"`` forces the kernel.
    rescale_eps: ``rescaled_magnitude``'s ε, as :func:`jaxprune.sdgp.nm_prune`: ``None`` (the
      ε-free ratio, whose gradients scale exactly with the loss, so a data-parallel step
      equals the single-device one) or the released code's ``1e-4``.
    layers: as :func:`jaxprune.sdgp.convert_model` (``("conv", "linear")``: a transformer's
      dense projections too, beyond the paper).

  Returns:
    A :class:`jaxprune.methods.Method` named ``"sdgp"``.

  Raises:
    ValueError: bad ``n``, ``m``, ``method``, ``backend``, ``reinit`` or ``rescale_eps`` (checked
      here, before
      any model is seen).

  Example:
    >>> from jaxprune import sdgp
    >>> m = sdgp.method(n=2, m=4, method="mvue")
  """
  settings = SDGPSettings(n, m, method, backend, rescale_eps)
  conversion = SDGPConversion(settings, min_in_channels, seed, reinit, layers)
  config = {
    "n": n,
    "m": m,
    "method": method,
    "min_in_channels": min_in_channels,
    "seed": seed,
    "backend": backend,
    "reinit": reinit,
  }
  if rescale_eps is not None:  # recorded only when set: earlier runs' configs stay as they were
    config["rescale_eps"] = rescale_eps
  if conversion.layers != ("conv",):
    config["layers"] = list(conversion.layers)
  return Method(name="sdgp", convert=conversion, config=config)


def _check_dataset(dataset: str) -> None:
  if dataset not in PAPER_MODELS:
    raise ValueError(f"dataset must be one of {sorted(PAPER_MODELS)}, got {dataset!r}")


def paper_method(
  row: str = "rescaled_magnitude",
  *,
  dataset: str = "cifar10",
  n: int = 2,
  m: int = 4,
  seed: int = 0,
  backend: str = "auto",
  rescale_eps: float | None = nm_math.RESCALE_EPS,
) -> Method:
  """One row of SDGP's Table I / Fig. 8 exactly as the authors' released configs run it.

  The released converter builds every converted conv afresh (Kaiming-uniform, ReLU gain,
  U(±√(6 / fan_in)), bias zero), so ``reinit=True`` for every converted model. The CIFAR
  configs convert the dense baseline too, as a 4:4 ``"magnitude"`` (their ``max``) SDGP
  model — pruning 4 of 4 is a no-op, but the re-initialisation is not, so every released
  CIFAR number, the dense one included, starts from that init. The ImageNet script converts
  only when ``n < m``: its dense ResNet-50 keeps the model's own init.

  Args:
    row: ``"dense"`` or an N:M method (``"random"``, ``"magnitude"``,
      ``"rescaled_magnitude"``, ``"mvue"``).
    dataset: ``"cifar10"`` or ``"imagenet"`` (its network: :data:`PAPER_MODELS`,
      :func:`paper_model`).
    n, m: the N:M setting of the pruned rows (Table I: 2:4; Fig. 8 sweeps it).
    seed, backend: as :func:`jaxprune.sdgp.convert_model` (``"auto"``: see :func:`method`).
    rescale_eps: the ``"rescaled_magnitude"`` row's ε; default the released code's ``1e-4``
      (:data:`jaxprune.sdgp.RESCALE_EPS`), unlike :func:`method`'s ε-free default, because
      this function reproduces the released runs (on one device, where the loss's scale is
      fixed). ``None`` gives the scale-invariant rescale. Ignored by the other rows.

  Returns:
    A :class:`jaxprune.methods.Method`, named ``"dense"`` for the dense row.

  Raises:
    ValueError: unknown ``dataset`` or ``row``, bad ``n`` / ``m``.

  Example:
    >>> dense = paper_method("dense")             # 4:4 magnitude, re-initialised
    >>> rescaled = paper_method("rescaled_magnitude", n=2, m=4)
  """
  _check_dataset(dataset)
  if row != "dense" and row not in nm_math.METHODS:
    raise ValueError(f"row must be 'dense' or one of {nm_math.METHODS}, got {row!r}")
  common = {"seed": seed, "backend": backend, "reinit": True}
  if row != "dense":
    eps = rescale_eps if row == "rescaled_magnitude" else None
    return method(n=n, m=m, method=row, rescale_eps=eps, **common)
  if dataset == "imagenet":
    return Method(name="dense")
  return dataclasses.replace(method(n=4, m=4, method="magnitude", **common), name="dense")


def paper_model(dataset: str, *, num_classes: int, rngs: nnx.Rngs, **overrides) -> nnx.Module:
  """The released configs' network for ``dataset`` (:data:`PAPER_MODELS`), unconverted.

  On ImageNet that is ``imagenet-resnet50`` with ``blurpool=True``: a binomial blur before
  every strided conv but the stem, where the released ``apply_blurpool`` puts it (strided
  convs with at least 16 input channels), applied before SDGP's conversion as there.

  Args:
    dataset: ``"cifar10"`` or ``"imagenet"``.
    num_classes, rngs: as :func:`jaxprune.models.create`.
    **overrides: further keywords of :func:`jaxprune.models.create` (e.g.
      ``width_multiplier``); they win over the preset's.

  Raises:
    ValueError: unknown ``dataset``, or as :func:`jaxprune.models.create`.
  """
  _check_dataset(dataset)
  name, preset = PAPER_MODELS[dataset]
  return models.create(name, num_classes=num_classes, rngs=rngs, **{**preset, **overrides})
