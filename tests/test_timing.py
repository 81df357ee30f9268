"""``jaxprune.timing``: warm-up calls, then the timed calls, counted."""

import pytest

import time

import jax.numpy as jnp

from jaxprune.timing import mean_call_s, median_call_ms


def test_median_call_ms_counts_the_calls_and_returns_milliseconds():
  calls = []

  def fn(a, b):
    calls.append((a, b))
    return a + b

  ms = median_call_ms(fn, 1, 2, repeats=3)
  assert calls == [(1, 2)] * 4  # warm-up + 3 timed
  assert isinstance(ms, float) and ms >= 0
  with pytest.raises(ValueError, match="^repeats must be >= 1"):
    median_call_ms(fn, 1, 2, repeats=0)
  with pytest.raises(ValueError, match="^warmup must be >= 0"):
    median_call_ms(fn, 1, 2, repeats=1, warmup=-1)
  calls.clear()
  median_call_ms(fn, 1, 2, repeats=2, warmup=3)
  assert len(calls) == 5


def test_mean_call_s_issues_the_calls_back_to_back_and_waits_for_the_last():
  calls = []

  def step():
    calls.append(time.perf_counter())
    time.sleep(0.01)
    return jnp.float32(len(calls))

  seconds = mean_call_s(step, calls=4, warmup=2)
  assert len(calls) == 6
  # each timed call sleeps 10 ms: the mean is at least that, and not the warm-ups' too
  assert 0.01 <= seconds < (calls[-1] - calls[0]) + 0.01
  with pytest.raises(ValueError, match="^calls must be >= 1"):
    mean_call_s(step, calls=0)
  with pytest.raises(ValueError, match="^warmup must be >= 0"):
    mean_call_s(step, calls=1, warmup=-1)
