"""Wall-clock timing of jitted calls, shared by the paper packages' measurements.

ClickTrain's sparse execution times each layer both ways before choosing; SDGP's
``time_backends`` times its two N:M backends. Both use :func:`median_call_ms`, which lives
here, below the paper packages, so neither imports the other. :func:`mean_call_s` times calls
issued back to back, as a training loop issues its steps; :func:`interleaved_times` times
several calls in turn, for measurements on a shared machine (SDGP's time model). The
experiments' benches time their steps with these too.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax

__all__ = ["interleaved_times", "mean_call_s", "median_call_ms"]


def median_call_ms(fn, *args, repeats: int, warmup: int = 1) -> float:
  """Median wall-clock milliseconds of ``fn(*args)`` over ``repeats`` calls after ``warmup``.

  The warm-up calls compile (for a jitted ``fn``) and are not counted; every call waits for its
  result (``jax.block_until_ready``), so asynchronous dispatch does not hide device time.

  Args:
    fn: the function to time, usually ``jax.jit``-ed; a step that carries its own state
      (``def step(): state[:] = train(*state, x, y)``) is called with no arguments.
    *args: its arguments.
    repeats: timed calls, at least 1.
    warmup: untimed calls first, at least 0.

  Returns:
    The median of the timed calls, in milliseconds.

  Raises:
    ValueError: ``repeats < 1`` or ``warmup < 0``.
  """
  _check_counts(repeats=repeats, warmup=warmup)
  for _ in range(warmup):  # compile and warm up
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def mean_call_s(fn, *args, calls: int, warmup: int = 1) -> float:
  """Mean wall-clock seconds per call of ``calls`` calls of ``fn(*args)`` issued back to back.

  Only the last result is waited for, so the host issues each call while the device runs the
  one before, as a training loop does: this is a step's throughput, where
  :func:`median_call_ms` is its latency.

  Args:
    fn: the function to time, as for :func:`median_call_ms`.
    *args: its arguments.
    calls: timed calls, at least 1.
    warmup: untimed calls first (each waited for), at least 0.

  Returns:
    Seconds per call.

  Raises:
    ValueError: ``calls < 1`` or ``warmup < 0``.
  """
  _check_counts(calls=calls, warmup=warmup)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  start = time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def _check_counts(*, warmup: int, **timed: int) -> None:
  for name, count in timed.items():
    if count < 1:
      raise ValueError(f"{name} must be >= 1, got {count!r}")
  if warmup < 0:
    raise ValueError(f"warmup must be >= 0, got {warmup!r}")


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
