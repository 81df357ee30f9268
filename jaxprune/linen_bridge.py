"""Linen modules inside an NNX model (``flax.nnx.bridge.ToNNX``): what the library can do with them.

Flax's route for Linen users is ``nnx.bridge.ToNNX(linen_module)``: the Linen module's variables
become NNX variables of one wrapper module, and its layers stay Linen. What that means here:

* The optimizer transforms see parameters only, so ClickTrain's and PruneTrain's group lasso
  work on a bridged model as on any other (Linen's ``Conv_0`` is the stem's name the shape rule
  knows).
* The :class:`~jaxprune.train.Trainer` trains a bridged model whose variables are parameters
  only. A Linen ``BatchNorm`` keeps ``batch_stats``, which a bridged call updates only when it is
  given ``mutable=``; the Trainer calls ``model(x)``, so Flax would stop the first step with
  "collection batch_stats is immutable". Such a model is refused when the Trainer is built.
* PruneTrain's reconfiguration rebuilds NNX layers at new widths; a Linen module's widths are its
  dataclass fields, which the surgery does not rebuild, so a bridged model is refused before any
  step (the callback's fit-start check) or call.
* SDGP replaces ``nnx.Conv`` layers; it cannot reach a Linen ``nn.Conv``. Inside a Linen module
  the pruned backward is :func:`jaxprune.sdgp.sdgp_conv`, a function any module can call.

Each refusal is a ``ValueError`` that names the bridge's path and says what works instead.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from flax.nnx import bridge

__all__ = ["bridged_modules", "refuse_bridged"]


def bridged_modules(model: Any) -> dict[str, tuple[str, ...]]:
  """Every ``nnx.bridge.ToNNX`` inside ``model``: its path -> its non-parameter collections.

  Args:
    model: any NNX module.

  Returns:
    ``{path: collections}``, e.g. ``{"backbone": ("BatchStat",)}`` (Linen's ``batch_stats``) (``"(the model)"`` for the
    model itself); empty for a model without Linen modules.
  """
  found: dict[str, tuple[str, ...]] = {}
  for path, module in nnx.iter_graph(model):
    if isinstance(module, bridge.ToNNX):
      # The Linen collections other than params, as their NNX variable types (BatchStat for
      # batch_stats); the bridge's own RNG counters are not the model's state.
      collections = sorted(
        {
          type(v).__name__
          for _, v in nnx.iter_graph(module)
          if isinstance(v, nnx.Variable) and not isinstance(v, (nnx.Param, nnx.RngState))
        }
      )
      found["/".join(map(str, path)) or "(the model)"] = tuple(collections)
  return found


def refuse_bridged(model: Any, *, what: str, instead: str, only_stateful: bool = False) -> None:
  """Raises a named ``ValueError`` when ``model`` holds a Linen module through the bridge.

  Args:
    model: the model about to be used.
    what: what cannot be done with a bridged Linen module, and why.
    instead: what works instead.
    only_stateful: refuse only bridges that keep non-parameter collections (``batch_stats``).

  Raises:
    ValueError: the bridge's path, ``what`` and ``instead``.
  """
  found = bridged_modules(model)
  if only_stateful:
    found = {path: kept for path, kept in found.items() if kept}
  if not found:
    return
  where = ", ".join(
    f"{path}" + (f" (keeps {', '.join(kept)})" if kept else "") for path, kept in found.items()
  )
  raise ValueError(
    f"model: {type(model).__name__} holds a Linen module through nnx.bridge.ToNNX at {where}; "
    f"{what}. {instead}"
  )
