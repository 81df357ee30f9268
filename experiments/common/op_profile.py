"""Where a compiled XLA step spends its time, by kind of op, from a profiler trace.

A step time that falls more slowly than the FLOPs after a reconfiguration can be the
convolutions themselves running less efficiently at small widths, or the ops whose cost is
linear in the width (elementwise, reductions, layout copies) taking a larger share. The
profiler's trace names each executed op after its instruction in the compiled HLO; the HLO
says what the instruction computes, so every op's time can be put in one of three kinds:

- ``"convolution / dot"``: the op (or the fusion it calls) contains a convolution or a dot;
- ``"transpose / copy"``: otherwise, it transposes or copies (layout changes, e.g. the
  batch-minor operands XLA:CPU builds for a weight-gradient convolution);
- ``"elementwise / reduction"``: everything else (BatchNorm, ReLU, residual adds, the
  optimizer update, the loss).

Summed op durations are op-seconds: ops that run concurrently on different threads add up,
so the total can differ from the wall time; the shares are what matters.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax

KINDS = ("convolution / dot", "transpose / copy", "elementwise / reduction")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")


def _own_kind(text: str) -> str | None:
  if re.search(r"\b(?:convolution|dot)\(", text):
    return KINDS[0]
  if re.search(r"\b(?:transpose|copy)\(", text):
    return KINDS[1]
  return None


def op_kinds(hlo_text: str) -> dict[str, str]:
  """Kind (one of :data:`KINDS`) of every instruction of the entry computation.

  Args:
    hlo_text: the compiled module's text (``jax.jit(f).lower(...).compile().as_text()``).

  Returns:
    instruction name -> kind. A fusion or call takes the kind of what it calls
    (transitively): a convolution or dot anywhere inside makes it ``"convolution / dot"``.
  """
  bodies: dict[str, list[str]] = {}
  entry = None
  current = None
  for line in hlo_text.splitlines():
    if line.startswith((" ", "\t")) and current is not None:
      match = _INSTRUCTION.match(line)
      if match:
        bodies[current].append(match.group(0))
      continue
    match = _COMPUTATION.match(line)
    if match:
      current = match.group(1)
      bodies[current] = []
      if line.startswith("ENTRY"):
        entry = current
    elif line.startswith("}"):
      current = None
  if entry is None:
    raise ValueError("hlo_text: no ENTRY computation found")

  cache: dict[str, str | None] = {}

  def computation_kind(name: str) -> str | None:
    if name not in cache:
      cache[name] = None  # guards against cycles
      kinds = {instruction_kind(line) for line in bodies.get(name, [])}
      cache[name] = next((kind for kind in KINDS[:2] if kind in kinds), None)
    return cache[name]

  def instruction_kind(line: str) -> str | None:
    own = _own_kind(line.split("=", 1)[1])
    called = [computation_kind(name) for name in _CALLS.findall(line)]
    return next((kind for kind in KINDS[:2] if kind == own or kind in called), None)

  result = {}
  for line in bodies[entry]:
    name = _INSTRUCTION.match(line).group(1)
    result[name] = instruction_kind(line) or KINDS[2]
  return result


def op_seconds_by_kind(run: Callable[[], object], hlo_text: str, steps: int) -> dict[str, float]:
  """Op-seconds per call of ``run`` in each kind of op, from a ``jax.profiler`` trace.

  Args:
    run: executes the compiled step once (blocking until it is done).
    hlo_text: that step's compiled HLO text, whose instruction names the trace uses.
    steps: calls of ``run`` to trace.

  Returns:
    ``{kind: op-seconds per call}`` for every kind of :data:`KINDS`.
  """
  if steps < 1:
    raise ValueError(f"steps must be >= 1, got {steps}")
  kinds = op_kinds(hlo_text)
  totals = collections.Counter({kind: 0.0 for kind in KINDS})
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        jax.block_until_ready(run())
    traces = glob.glob(str(Path(trace_dir) / "**" / "perfetto_trace.json.gz"), recursive=True)
    if not traces:
      raise RuntimeError("jax.profiler wrote no perfetto trace")
    with gzip.open(traces[0]) as handle:
      trace = json.load(handle)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  for event in events:
    kind = kinds.get(event.get("name"))
    if kind is not None and event.get("ph") == "X":
      totals[kind] += event.get("dur", 0) * 1e-6
  return {kind: totals[kind] / steps for kind in KINDS}
