"""experiments/prunetrain/compile_bench.py: the batch search it measures against."""

import pytest

from experiments.prunetrain import compile_bench as bench
from jaxprune import prunetrain as pt


@pytest.mark.parametrize("budget", [1000, 2000, 4321, 10_000])
def test_the_baseline_is_the_search_it_replaced(budget):
  memory_of = lambda b: 500 + 10 * b
  want = max(b for b in range(64, 513, 32) if b == 64 or memory_of(b) <= budget)
  assert bench._doubling_then_bisection(memory_of, 64, budget, max_batch_size=512) == want
  assert pt.grow_batch_size(memory_of, 64, budget, max_batch_size=512) == want
