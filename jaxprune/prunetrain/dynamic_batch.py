"""PruneTrain's dynamic mini-batch (§4.3): grow the batch into the memory a reconfiguration freed.

After a reconfiguration the smaller model's training step needs less memory than the dense
one did. PruneTrain grows the mini-batch, in steps of 32, while the step still fits the memory
the dense model used, and scales the learning rate by the same ratio (linear scaling rule), so
the smaller model keeps the device busy. The memory is XLA's analysis of the compiled step
(:meth:`jaxprune.train.Trainer.step_memory`); the trainer only provides the generic setters
(:meth:`~jaxprune.train.Trainer.set_batch_size`, which also rescales the LR and keeps the
schedule's epoch milestones in place). The authors' released code lacks this part; the paper
defines it.

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxprune.train import TrainerLike

__all__ = ["DynamicBatch", "grow_batch_size", "largest_batch_size"]

# A budget within this fraction of one step's memory of the next size's predicted memory is
# too close to call from the fit (measured steps stray from the line by about 1e-5 of a step:
# see grow_batch_size): the next size is probed.
_CLOSE_CALL = 1e-3


def grow_batch_size(
  memory_of: Callable[[int], int],
  batch_size: int,
  budget: int,
  *,
  granularity: int = 32,
  max_batch_size: int | None = None,
) -> int:
  """The largest ``batch_size + k·granularity`` (``k >= 0``) whose step fits ``budget``.

  PruneTrain §4.3 grows the mini-batch, in steps of 32, into the memory a reconfiguration
  freed.  Each probe of ``memory_of`` compiles the step (seconds for a ResNet on a CPU), so
  the search spends as few as it can: the compiled step's memory is affine in the batch size
  to within bytes (its buffers scale with the batch; ResNet-32 at half width on the CPU:
  61 476 480 to 61 476 992 bytes per 32 images from batch 128 to 1024), so two probes, one
  step above the current batch and at about twice it, fit ``memory = a + b·batch``, the fit
  gives the largest ``k`` whose step fits, and a third probe checks that batch (the current
  batch is not probed: it fits, since the step only shrank; when the first step does not
  fit, that one probe settles it).  It is kept when it fits and the
  line through the check, lowered by a margin (twice how far the check fell off the first
  line, at least 0.1% of one step), puts the next multiple over the budget (otherwise one
  probe of the next multiple settles it); one step down follows a check that
  does not fit (a slightly convex memory overshoots by one).
  What the fit leaves open (memory far from affine) is settled by the exact search the fit
  replaced: doubling ``k`` from the largest size known to fit, then bisecting.  For affine
  memory the answer is the exhaustive search's in 3 probes (2 when the fit lands on a probed
  size, 1 when nothing larger fits); for any non-decreasing memory the chosen step was probed
  and fits, and the train step later compiled at that size is the probe's program (JAX keeps
  it), so only the other probes are extra compilations.

  Args:
    memory_of: ``batch_size -> bytes`` of the compiled training step (non-decreasing).
    batch_size: current batch size (kept if nothing larger fits).
    budget: bytes the step may use.
    granularity: batch-size step (paper: 32).
    max_batch_size: upper bound (e.g. the training-set size); ``None`` = no bound.

  Returns:
    The new batch size (``>= batch_size``).

  Raises:
    ValueError: non-positive ``granularity`` or ``batch_size``.

  Example:
    >>> grow_batch_size(lambda b: 500 + 10 * b, 64, 3000, max_batch_size=512)
    224
  """
  if granularity < 1:
    raise ValueError(f"granularity must be >= 1, got {granularity}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  limit = max_batch_size if max_batch_size is not None else 1 << 30
  max_steps = (limit - batch_size) // granularity
  if max_steps < 1:
    return batch_size
  search = _Search(lambda k: memory_of(batch_size + k * granularity), budget, max_steps)
  # The current batch is not probed (it fits: the step only shrank); the first growth step
  # is, and when it does not fit nothing larger does.
  if search.fits(1) and max_steps > 1:
    search.fit_affine(second=min(max_steps, max(2, batch_size // granularity)))
  return batch_size + search.exact() * granularity


class _Search:
  """The steps ``k`` probed so far, with ``low`` (the largest known to fit) and ``high`` (the
  smallest known not to, or the cap plus one): the answer lies in ``[low, high)``.

  Args:
    memory_of: ``k -> bytes`` of the step at ``batch_size + k·granularity``.
    budget: bytes the step may use.
    max_steps: the largest ``k`` allowed.
  """

  def __init__(self, memory_of: Callable[[int], int], budget: int, max_steps: int):
    self._memory_of, self.budget = memory_of, budget
    self.probed: dict[int, int] = {}
    self.low, self.high = 0, max_steps + 1

  def memory(self, k: int) -> int:
    if k not in self.probed:
      self.probed[k] = self._memory_of(k)
    return self.probed[k]

  def fits(self, k: int) -> bool:
    fits = self.memory(k) <= self.budget
    if fits:
      self.low = max(self.low, k)
    else:
      self.high = min(self.high, k)
    return fits

  def fit_affine(self, second: int) -> None:
    """Narrows ``[low, high)`` from a line through two probes and one probe it picks.

    The line goes through the probes at 1 and ``second``; one probe is at the batch the line picks
    (and one step below it if that one does not fit).
    """
    first = self.memory(1)
    self.fits(second)
    slope = (self.memory(second) - first) / (second - 1)
    line = lambda k: first + slope * (k - 1)
    guess = self.high - 1 if slope <= 0 else 1 + int((self.budget - first) // slope)
    guess = min(max(guess, self.low), self.high - 1)
    if self.fits(guess):
      # The next size, from the check along the slope nearest it, less a margin: twice how
      # far the check fell off the first line, and at least a fixed sliver of one step.
      nearest = max((k for k in self.probed if k < guess), default=second)
      near_slope = (self.memory(guess) - self.memory(nearest)) / (guess - nearest)
      margin = max(2 * abs(self.memory(guess) - line(guess)), _CLOSE_CALL * near_slope)
      if self.memory(guess) + near_slope - margin > self.budget:
        self.high = min(self.high, guess + 1)
      elif guess + 1 < self.high:  # too close to call: one step up
        self.fits(guess + 1)
    elif guess - 1 > self.low:
      self.fits(guess - 1)

  def exact(self) -> int:
    """The largest fitting ``k`` in ``[low, high)``.

    Doubling up from ``low``, then bisecting (nothing to probe when the fit closed the interval).
    """
    step = 1
    while self.low + step < self.high and self.fits(self.low + step):
      step *= 2
    while self.high - self.low > 1:
      self.fits((self.low + self.high) // 2)
    return self.low


def largest_batch_size(
  trainer: TrainerLike,
  budget_bytes: int,
  image_shape: Sequence[int],
  *,
  granularity: int = 32,
  limit: int = 8192,
) -> int:
  """Largest multiple of ``granularity`` whose compiled train step fits ``budget_bytes``.

  The multiple is at most ``limit``, and the train step is that of ``trainer``'s current model
  (searched by :func:`grow_batch_size`; each probe compiles the step, about 3 in all).

  Args:
    trainer: a :class:`jaxprune.train.Trainer` (anything with ``step_memory``).
    budget_bytes: bytes the step may use.
    image_shape: one example's shape, e.g. ``(32, 32, 3)``.
    granularity: batch-size step (paper: 32).
    limit: largest batch size considered.

  Returns:
    The batch size.

  Raises:
    ValueError: bad arguments, or not even ``granularity`` examples fit the budget.
  """
  if granularity < 1 or limit < granularity:
    raise ValueError(f"granularity must be in [1, limit], got {granularity} (limit {limit})")
  memory_of = lambda batch: trainer.step_memory(batch, tuple(image_shape))["total"]
  if memory_of(granularity) > budget_bytes:
    raise ValueError(
      f"budget_bytes {budget_bytes} is below the step's memory at batch {granularity}"
    )
  return grow_batch_size(
    memory_of, granularity, budget_bytes, granularity=granularity, max_batch_size=limit
  )


class DynamicBatch:
  """The §4.3 policy around reconfigurations inside a :class:`jaxprune.train.Trainer`.

  Call :meth:`measure_budget` before a reconfiguration (the first call records what the
  dense model's step needs at the current batch size: the budget) and :meth:`grow` after the
  new model is installed: the batch grows by multiples of ``granularity`` while the new step
  fits the budget, and the trainer scales the LR by the same ratio from the next epoch on.
  :class:`jaxprune.prunetrain.PruneTrainCallback` does both; the budget is part of its
  checkpointed state (:meth:`state_dict`).

  Args:
    image_shape: one training example's shape, e.g. ``(32, 32, 3)``.
    granularity: batch-size step (paper: 32).
    max_batch_size: upper bound (e.g. the training-set size); ``None`` = none.

  Raises:
    ValueError: ``granularity`` < 1 or above ``max_batch_size``.

  Example:
    >>> policy = DynamicBatch((32, 32, 3))
    >>> policy.measure_budget(trainer)  # doctest: +SKIP
    >>> trainer.replace(smaller_model, sliced_opt_state)  # doctest: +SKIP
    >>> policy.grow(trainer)  # doctest: +SKIP
    192
  """

  def __init__(
    self,
    image_shape: Sequence[int],
    *,
    granularity: int = 32,
    max_batch_size: int | None = None,
  ):
    if granularity < 1 or (max_batch_size is not None and max_batch_size < granularity):
      raise ValueError(f"granularity must be in [1, max_batch_size], got {granularity}")
    self.image_shape = tuple(image_shape)
    self.granularity = granularity
    self.max_batch_size = max_batch_size
    self.budget_bytes: int | None = None

  def _memory(self, trainer: TrainerLike, batch_size: int) -> int:
    return trainer.step_memory(batch_size, self.image_shape)["total"]

  def measure_budget(self, trainer: TrainerLike) -> int | None:
    """Records the budget the first time; returns it.

    The budget is the step's memory at the trainer's batch size (``None`` while the trainer has no
    batch size yet).
    """
    if self.budget_bytes is None and trainer.batch_size:
      self.budget_bytes = self._memory(trainer, trainer.batch_size)
    return self.budget_bytes

  def grow(self, trainer: TrainerLike) -> int:
    """Grows the batch to the largest whose step fits the budget; returns its size.

    Asks ``trainer`` for the largest batch whose step fits the budget, with the LR scaled by the
    same ratio (both from the next epoch). The search (:func:`grow_batch_size`) compiles the new
    step about 3 times: two sizes fit the step's affine memory, a third checks the batch the fit
    picks. Under data parallelism (``trainer.num_devices > 1``) the batch is the global one and
    grows in steps of ``lcm(granularity, num_devices)``, so it stays a multiple of the device count.

    Raises:
      ValueError: no budget was measured.
    """
    if self.budget_bytes is None:
      raise ValueError("budget_bytes: call measure_budget before the first reconfiguration")
    batch = trainer.batch_size
    # Data parallel: the batch is the global one and must stay a multiple of the devices
    # (the memory probed is one device's, holding its shard).
    granularity = math.lcm(self.granularity, int(getattr(trainer, "num_devices", 1)))
    new_batch = grow_batch_size(
      lambda size: self._memory(trainer, size),
      batch,
      self.budget_bytes,
      granularity=granularity,
      max_batch_size=self.max_batch_size,
    )
    if new_batch > batch:
      trainer.set_batch_size(new_batch, scale_lr=True)  # linear LR scaling (§4.3)
    return new_batch

  def state_dict(self) -> dict[str, Any]:
    return {"budget_bytes": self.budget_bytes}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    self.budget_bytes = state.get("budget_bytes")
