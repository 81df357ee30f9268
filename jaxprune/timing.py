"""Wall-clock timing of jitted calls, shared by the paper packages' measurements.

ClickTrain's sparse execution times each layer both ways before choosing; SDGP's
``time_backends`` times its two N:M backends. Both use :func:`median_call_ms`, which lives
here, below the paper packages, so neither imports the other. :func:`interleaved_times` times
several calls in turn, for measurements on a shared machine (SDGP's time model).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax

__all__ = ["interleaved_times", "median_call_ms"]


def median_call_ms(fn, *args, repeats: int) -> float:
  """Median wall-clock milliseconds of ``fn(*args)`` over ``repeats`` calls after a warm-up.

  The warm-up call compiles (for a jitted ``fn``) and is not counted; every call waits for its
  result (``jax.block_until_ready``), so asynchronous dispatch does not hide device time.

  Args:
    fn: the function to time, usually ``jax.jit``-ed.
    *args: its arguments.
    repeats: timed calls, at least 1.

  Returns:
    The median of the timed calls, in milliseconds.

  Raises:
    ValueError: ``repeats < 1``.
  """
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats!r}")
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def interleaved_times(
  jobs: Mapping[Hashable, tuple[Callable, Sequence[Any]]], rounds: int
) -> dict[Hashable, float]:
  """Minimum seconds of each job over ``rounds`` round-robin passes.

  On a shared machine the load drifts over seconds; running the jobs in turn within every
  round exposes each to the same drift, and the minimum estimates the undisturbed time.
  """
  for fn, args in jobs.values():
    jax.block_until_ready(fn(*args))  # compile + warm up
  best = {name: float("inf") for name in jobs}
  for _ in range(rounds):
    for name, (fn, args) in jobs.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - start)
  return best
