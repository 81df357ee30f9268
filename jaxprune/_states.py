"""Looking inside optimizer states: NNX Variables to arrays, and states of a given type.

An Optax state is a pytree whose nodes are the NamedTuples of its transforms, nested in
``optax.chain`` tuples and in wrappers' states (``PruneTrainState.inner``); an
``nnx.Optimizer`` keeps it as ``.opt_state`` with every array in an NNX Variable. The
read-outs of every method find their state here, whatever it is wrapped in.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxprune.paths import path_string

__all__ = ["as_pure", "find_states", "named_leaves"]


def as_pure(tree: Any) -> Any:
  """An NNX ``State`` / tree of Variables -> the same tree of plain arrays; anything else as is.

  An ``nnx.Optimizer`` becomes its pure ``opt_state``.
  """
  try:
    from flax import nnx
  except ImportError:  # pragma: no cover
    return tree
  if isinstance(tree, nnx.Optimizer):
    tree = tree.opt_state
  has_variables = any(
    isinstance(x, nnx.Variable)
    for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )
  return nnx.as_pure(tree) if has_variables or isinstance(tree, nnx.State) else tree


def named_leaves(tree: Any) -> dict[str, Any]:
  """``{path_string: leaf}`` of :func:`as_pure` ``(tree)``, ``None`` leaves kept.

  The same parameter gets the same name in an NNX ``State`` (pure or of Variables) and in a
  plain dict, so trees of those different containers can be matched leaf by leaf.
  """
  flat = jax.tree_util.tree_flatten_with_path(as_pure(tree), is_leaf=lambda x: x is None)[0]
  return {path_string(p): leaf for p, leaf in flat}


def find_states(opt_state: Any, state_type: type | tuple[type, ...]) -> list[Any]:
  """Every node of ``opt_state`` that is a ``state_type``, in flatten order.

  ``opt_state`` is made pure with :func:`as_pure`; a found state is not searched further.
  """
  tree = as_pure(opt_state)
  return [
    x
    for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, state_type))
    if isinstance(x, state_type)
  ]
