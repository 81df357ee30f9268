"""experiments/prunetrain_compile_bench.py: its baseline search and its dead channels."""

import pytest

from experiments import prunetrain_compile_bench as bench
from jaxprune import prunetrain as pt


@pytest.mark.parametrize("budget", [1000, 2000, 4321, 10_000])
def test_the_baseline_is_the_search_it_replaced(budget):
  memory_of = lambda b: 500 + 10 * b
  want = max(b for b in range(64, 513, 32) if b == 64 or memory_of(b) <= budget)
  assert bench._doubling_then_bisection(memory_of, 64, budget, max_batch_size=512) == want
  assert pt.grow_batch_size(memory_of, 64, budget, max_batch_size=512) == want


def test_dead_channels_are_what_reconfigure_removes(tiny_resnet):
  model = tiny_resnet()
  tensors = pt.channel_graph(model)
  bench._kill_channels(model, 0.5, pt.channel_graph)
  _, _, report = pt.reconfigure(model, None, count_flops=False)
  want = {layer.name: t.width // 2 for t in tensors for layer in t.writers}
  assert {name: report.channels_removed[name] for name in want} == want
  assert min(want.values()) > 0
