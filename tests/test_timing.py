"""``jaxprune.timing.median_call_ms``: one warm-up call, then ``repeats`` timed calls."""

import pytest

from jaxprune.timing import median_call_ms


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
