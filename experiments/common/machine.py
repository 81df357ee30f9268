"""One description of the machine a result was measured on, for every results file."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import numpy as np


def cpu_description() -> str:
  """CPU model, logical CPUs, Python / NumPy versions and OS (no JAX import needed)."""
  cpu = platform.processor() or platform.machine()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return (
    f"{cpu}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}, "
    f"NumPy {np.__version__}, {platform.system()} {platform.machine()}"
  )


def machine_description() -> str:
  """:func:`cpu_description` plus the JAX version and the devices it runs on."""
  import jax

  devices = ", ".join(sorted({d.device_kind for d in jax.devices()}))
  return f"{cpu_description()}; JAX {jax.__version__} on {jax.device_count()}x {devices}"


def host_steal_seconds() -> float | None:
  """CPU seconds the hypervisor has taken from this machine's CPUs since boot (all CPUs).

  ``/proc/stat``'s steal column; None where it is not available.  On a shared virtual
  machine, steal time stretches wall-clock measurements without changing the work done, so
  result files report it beside wall time.
  """
  try:
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")
  except (OSError, IndexError, ValueError):
    return None


def steal_since(start: float | None) -> float | None:
  """Host steal seconds since ``start`` (a :func:`host_steal_seconds` reading), or None
  where either reading is unavailable."""
  end = host_steal_seconds()
  return None if start is None or end is None else end - start
