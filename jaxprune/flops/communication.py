"""Gradient all-reduce volume per device and step (PruneTrain §5 Fig. 11, ClickTrain §5.3).

:func:`allreduce_bytes` applies the ring all-reduce model to the weight gradients, counting only
the kept entries when masks are given (ClickTrain's sparse all-reduce).
:func:`compiled_allreduces` reads the same volume from what XLA will actually run: every
all-reduce instruction of a compiled step's HLO, its operands' bytes, and the parameter each
operand reduces (named by :mod:`jaxprune.distributed`'s per-leaf scopes).
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import numpy as np

from jaxprune.distributed import SCOPE_PREFIX
from jaxprune.flops.sparsity import _mask_table, _shape
from jaxprune.paths import flatten_with_paths

__all__ = ["AllReduce", "CompiledAllReduces", "allreduce_bytes", "compiled_allreduces"]


def _dtype(leaf: Any) -> np.dtype:
  return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def allreduce_bytes(params: Any, num_devices: int, masks: Any = None) -> float:
  """Bytes each device sends per step to all-reduce the weight gradients (ring all-reduce).

  PruneTrain §5 (Fig. 11) models communication with ring all-reduce: each of ``p`` devices
  sends (and receives) ``2 (p − 1) / p × gradient bytes``. With ``masks`` only the kept
  gradient entries are reduced (ClickTrain §5.3's sparse all-reduce; the fixed positions are
  known to every device, so no index traffic is counted).

  Args:
    params: the parameter pytree (every leaf is a gradient that is reduced).
    num_devices: ``p`` ≥ 1; one device communicates nothing.
    masks: optional masks (see :func:`layer_flops`).

  Returns:
    Bytes per device per step.
  """
  if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)):
    raise ValueError(f"num_devices must be an int, got {num_devices!r}")
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  leaves = flatten_with_paths(params)
  mask_by_path = _mask_table(masks, dict(leaves))
  gradient_bytes = 0
  for path, leaf in leaves:
    itemsize = _dtype(leaf).itemsize
    entries = (
      int(np.count_nonzero(mask_by_path[path])) if path in mask_by_path else math.prod(_shape(leaf))
    )
    gradient_bytes += entries * itemsize
  return 2.0 * (num_devices - 1) / num_devices * gradient_bytes


# Bytes per element of the HLO primitive types a gradient can have.
_HLO_ITEMSIZE = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
  "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
  "s32": 4, "u32": 4, "f32": 4,
  "s64": 8, "u64": 8, "f64": 8, "c64": 8,
  "c128": 16,
}  # fmt: skip
# ``%name = <shape> all-reduce(`` or the asynchronous ``all-reduce-start(`` (GPU); the matching
# ``all-reduce-done`` moves nothing new and is not counted.
_ALLREDUCE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s*all-reduce(?:-start)?\(")
_GET_ELEMENT = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=.*?get-tuple-element\(%?([\w.\-]+)\),\s*index=(\d+)"
)
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z\d]*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SCOPE = re.compile(re.escape(SCOPE_PREFIX) + r"\[([^\]]*)\]")
_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


class AllReduce(NamedTuple):
  """One all-reduce instruction of a compiled program.

  Attributes:
    name: the HLO instruction name.
    shapes: ``(dtype, dims)`` of each operand (XLA combines small all-reduces into one with
      several operands).
    paths: the parameter path each operand reduces (``"conv1/kernel"``), from the
      ``allreduce[path]`` scope of :mod:`jaxprune.distributed`; None for an operand reduced
      elsewhere (a ``psum`` the step wrote itself, or one ``shard_map`` inserted).
    group_size: devices in each replica group (``p``); None when the text does not say.
  """

  name: str
  shapes: tuple[tuple[str, tuple[int, ...]], ...]
  paths: tuple[str | None, ...]
  group_size: int | None

  @property
  def operand_bytes(self) -> tuple[int, ...]:
    return tuple(_HLO_ITEMSIZE[dtype] * math.prod(dims) for dtype, dims in self.shapes)

  @property
  def bytes(self) -> int:
    """Payload: the bytes of the operands (the gradient entries that are reduced)."""
    return sum(self.operand_bytes)


class CompiledAllReduces(NamedTuple):
  """Every all-reduce of a compiled program (see :func:`compiled_allreduces`).

  Attributes:
    ops: the :class:`AllReduce` instructions, in program order.
    total_bytes: payload bytes of all of them, per execution of the program.
    by_path: payload bytes per parameter path (``None``: operands no scope names).
    ring_bytes_per_device: ``Σ 2 (p − 1) / p × bytes`` over the ops: what each device sends
      under the ring all-reduce model of :func:`allreduce_bytes`.
  """

  ops: tuple[AllReduce, ...]
  total_bytes: int
  by_path: dict[str | None, int]
  ring_bytes_per_device: float


def _group_size(line: str) -> int | None:
  if match := _GROUPS.search(line):
    groups = re.findall(r"\{([\d,]*)\}", match.group(1))
    return len(groups[0].split(",")) if groups and groups[0] else None
  if match := _IOTA_GROUPS.search(line):
    return int(match.group(2))
  return None


def _path_of(line: str) -> str | None:
  op_name = _OP_NAME.search(line)
  scopes = _SCOPE.findall(op_name.group(1)) if op_name else []
  return scopes[-1] if len(set(scopes)) == 1 else None


def compiled_allreduces(compiled: Any) -> CompiledAllReduces:
  """The all-reduces of a compiled step and the bytes each carries, read from its HLO.

  Reads what XLA will run, after its own passes (e.g. the all-reduce combiner, which merges
  the per-leaf reductions into a few multi-operand instructions), so it shows whether a
  sparse reduction really sends only the kept entries (ClickTrain §5.3) and whether anything
  else all-reduces the dense gradient too. Each operand is mapped to the parameter it
  reduces through the per-leaf scopes of :mod:`jaxprune.distributed`.

  An instruction inside a loop body is counted once, not once per iteration.

  Args:
    compiled: a compiled program (``jax.jit(step).lower(...).compile()``, anything with
      ``as_text()``) or its HLO text.

  Returns:
    :class:`CompiledAllReduces`.

  Raises:
    ValueError: ``compiled`` is neither text nor has ``as_text()``, or an all-reduce has an
      element type this module has no size for.

  Example:
    >>> hlo = jax.jit(mapped_step).lower(params, batch).compile()  # doctest: +SKIP
    >>> compiled_allreduces(hlo).by_path["conv1/kernel"]  # doctest: +SKIP
    2304
  """
  if isinstance(compiled, str):
    text = compiled
  elif callable(getattr(compiled, "as_text", None)):
    text = compiled.as_text()
  else:
    raise ValueError(
      f"compiled must be HLO text or a compiled program with as_text(), got {type(compiled)}"
    )
  lines = text.splitlines()
  # Operands of a multi-operand all-reduce are named on the get-tuple-element that unpacks them.
  element_paths: dict[tuple[str, int], str | None] = {}
  for line in lines:
    if "get-tuple-element(" in line and (match := _GET_ELEMENT.match(line)):
      element_paths[(match.group(1), int(match.group(2)))] = _path_of(line)
  ops = []
  for line in lines:
    match = _ALLREDUCE.match(line)
    if match is None:
      continue
    name, shape = match.groups()
    shapes = []
    for dtype, dims in _ARRAY.findall(shape):
      if dtype not in _HLO_ITEMSIZE:
        raise ValueError(f"compiled: all-reduce {name} has element type {dtype!r} of unknown size")
      shapes.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    if shape.startswith("("):
      paths = tuple(element_paths.get((name, i)) for i in range(len(shapes)))
    else:
      paths = (_path_of(line),) * len(shapes)
    ops.append(AllReduce(name, tuple(shapes), paths, _group_size(line)))
  by_path: dict[str | None, int] = {}
  ring = 0.0
  for op in ops:
    for path, size in zip(op.paths, op.operand_bytes):
      by_path[path] = by_path.get(path, 0) + size
    p = op.group_size or 1
    ring += 2.0 * (p - 1) / p * op.bytes
  return CompiledAllReduces(tuple(ops), sum(op.bytes for op in ops), by_path, ring)
