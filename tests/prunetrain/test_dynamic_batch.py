"""The dynamic mini-batch's search (PruneTrain §4.3): an affine fit of the step's memory and
one check, instead of a probe (one compilation) per doubling and bisection step."""

import math

import pytest
from flax import nnx

from jaxprune import prunetrain as pt
from jaxprune import train
from jaxprune.train import _batch_growth

# Constant and per-image bytes of a planted step memory, in the range of ResNet-32 at half
# width on the CPU (about 61.5 MB per 32 images).
_BASE, _PER_IMAGE = 2_500_000, 1_921_150


def _exhaustive(memory_of, batch, budget, granularity, limit):
  fitting = [b for b in range(batch, limit + 1, granularity) if memory_of(b) <= budget]
  return max(fitting, default=batch)


def _counted(memory_of):
  calls = []

  def probe(batch):
    calls.append(batch)
    return memory_of(batch)

  return probe, calls


_PLANTED = {
  "affine": lambda b: _BASE + _PER_IMAGE * b,
  # Off the line by up to a few kB: buffer padding, page rounding.
  "nearly_affine": lambda b: math.ceil((_BASE + _PER_IMAGE * b + 3000 * (b % 7)) / 4096) * 4096,
}


def _budgets(memory_of, batch, *, clear_of=0):
  """Budgets from the current batch's memory to about 8x it, at least ``clear_of`` bytes
  from the memory of every multiple of 32 (0: some fall on one)."""
  low, top = memory_of(batch), memory_of(8 * batch)
  sizes = [memory_of(b) for b in range(batch, 2048 + 1, 32)]
  budgets = [low + (top - low) * i // 23 for i in range(24)] + [memory_of(5 * batch)]
  return [b for b in budgets if min(abs(b - size) for size in sizes) >= clear_of]


@pytest.mark.parametrize(("name", "clear_of"), [("affine", 0), ("nearly_affine", 65_536)])
@pytest.mark.parametrize("batch", [32, 64, 128])
def test_fit_picks_the_exhaustive_searchs_batch_in_three_probes(name, clear_of, batch):
  memory_of = _PLANTED[name]
  budgets = _budgets(memory_of, batch, clear_of=clear_of)
  assert len(budgets) >= 20
  for budget in budgets:
    probe, calls = _counted(memory_of)
    got = pt.grow_batch_size(probe, batch, budget, granularity=32, max_batch_size=2048)
    assert got == _exhaustive(memory_of, batch, budget, 32, 2048), budget
    assert len(calls) <= 3, (budget, calls)
    assert len(set(calls)) == len(calls)  # no size probed twice


def test_budget_on_a_nearly_affine_size_costs_at_most_two_more_probes():
  # The jitter hides which side of the line such a size is: probes settle it.
  memory_of = _PLANTED["nearly_affine"]
  for batch in (32, 64, 128):
    for budget in [memory_of(b) for b in range(batch, 8 * batch, 32)]:
      probe, calls = _counted(memory_of)
      got = pt.grow_batch_size(probe, batch, budget, granularity=32, max_batch_size=2048)
      assert got == _exhaustive(memory_of, batch, budget, 32, 2048)
      assert len(calls) <= 5


def test_fit_steps_down_once_for_slightly_convex_memory():
  memory_of = lambda b: _BASE + _PER_IMAGE * b + b * b // 2
  for batch in (32, 128):
    for budget in _budgets(memory_of, batch):
      probe, calls = _counted(memory_of)
      got = pt.grow_batch_size(probe, batch, budget, granularity=32, max_batch_size=2048)
      assert got == _exhaustive(memory_of, batch, budget, 32, 2048)
      assert len(calls) <= 4


@pytest.mark.parametrize("batch", [32, 96])
def test_far_from_affine_memory_falls_back_to_the_exact_search(batch):
  # A step at batch 512 (e.g. XLA switching algorithms): the line is wrong past it.
  memory_of = lambda b: _BASE + _PER_IMAGE * b + (400_000_000 if b >= 512 else 0)
  for budget in _budgets(memory_of, batch):
    got = pt.grow_batch_size(memory_of, batch, budget, granularity=32, max_batch_size=2048)
    assert got == _exhaustive(memory_of, batch, budget, 32, 2048)


def test_current_batch_over_budget_or_at_the_cap_is_kept():
  memory_of = _PLANTED["affine"]
  assert pt.grow_batch_size(memory_of, 64, memory_of(64) - 1, max_batch_size=2048) == 64
  probe, calls = _counted(memory_of)
  assert pt.grow_batch_size(probe, 64, 10**12, max_batch_size=90) == 64 and not calls
  assert pt.grow_batch_size(memory_of, 64, 10**12, max_batch_size=2048) == 2048


class _TinyNet(nnx.Module):
  """Conv and linear head: a real compiled step, small enough to compile quickly."""

  def __init__(self, rngs):
    self.conv = nnx.Conv(3, 4, (3, 3), rngs=rngs)
    self.head = nnx.Linear(4, 10, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.conv(x)).mean((1, 2)))


@pytest.fixture(scope="module")
def small_trainer():
  return train.Trainer(_TinyNet(nnx.Rngs(0)), train.sgd(0.1, momentum=0.9), progress=False)


def test_dynamic_batch_compiles_at_most_three_probes(monkeypatch, small_trainer):
  """Through the trainer's memory probe (planted: each call stands for one compilation)."""
  probe, calls = _counted(_PLANTED["nearly_affine"])
  monkeypatch.setattr(_batch_growth, "train_step_memory", lambda *args: {"total": probe(args[-1])})
  trainer = small_trainer
  monkeypatch.setattr(trainer._batches, "batch_size", 64)  # (restored for the next test)
  monkeypatch.setattr(trainer._batches, "pending", None)
  policy = pt.DynamicBatch((6, 6, 3), granularity=32, max_batch_size=4096)
  policy.budget_bytes = _PLANTED["nearly_affine"](300)
  assert policy.grow(trainer) == 288
  assert len(calls) <= 3
  assert trainer._batches.pending == (288, True)  # LR scaled with it (§4.3)


def test_real_step_memory_of_the_chosen_batch_is_within_budget(small_trainer):
  trainer = small_trainer
  image_shape = (8, 8, 3)
  memory = lambda batch: trainer.step_memory(batch, image_shape)["total"]
  budget = (memory(16) + memory(64)) // 2  # between two multiples of 8, whichever they are
  chosen = pt.largest_batch_size(trainer, budget, image_shape, granularity=8, limit=256)
  assert 16 <= chosen < 64
  assert memory(chosen) <= budget < memory(chosen + 8)
