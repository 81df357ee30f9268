"""When :meth:`jaxprune.train.Trainer.fit` stops before its epochs for ``max_seconds``."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["TimeBox"]


class TimeBox:
  """When :meth:`Trainer.fit` stops before its epochs for ``max_seconds``.

  An epoch's cost is its training and hooks plus, when it is evaluated, an evaluation. The
  first epoch and the first evaluation of the call also compile, so they only bound the next
  epoch's cost; the remaining epochs (``must_finish``) are estimated from the latest later
  epoch and evaluation, once there are such.
  """

  def __init__(
    self,
    max_seconds: float | None,
    must_finish: bool,
    eval_every: int,
    epochs: int,
    clock: Callable[[], float] = time.perf_counter,
  ):
    self.max_seconds, self.must_finish = max_seconds, must_finish
    self.eval_every, self.epochs = eval_every, epochs
    self.clock = clock
    self.start = clock()
    self.first_s: float | None = None  # the call's first epoch, compilation included
    self.steady_s: float | None = None  # the latest epoch after it
    self.first_eval_s: float | None = None  # the call's first evaluation, compilation included
    self.eval_s: float | None = None  # the latest evaluation after it

  def evaluates(self, epoch: int) -> bool:
    """Whether the epoch that ends at ``epoch`` completed epochs is evaluated."""
    return epoch % self.eval_every == 0 or epoch == self.epochs

  def epoch_done(self, seconds: float, eval_s: float) -> None:
    if self.first_s is None:
      self.first_s = seconds - eval_s
    else:
      self.steady_s = seconds - eval_s
    if eval_s and self.first_eval_s is None:
      self.first_eval_s = eval_s
    elif eval_s:
      self.eval_s = eval_s

  def _cost(self, first: int, last: int, per_epoch: float, per_eval: float) -> float:
    """Estimated seconds of epochs ``first+1 .. last`` (completed counts)."""
    evals = sum(self.evaluates(e) for e in range(first + 1, last + 1))
    return (last - first) * per_epoch + evals * per_eval

  def stop_reason(self, epoch: int) -> str | None:
    if self.max_seconds is None or self.first_s is None:
      return None
    spent = self.clock() - self.start
    whole = self.must_finish and self.steady_s is not None
    if whole:
      # The remaining epochs at the latest epoch's cost, and their evaluations at the latest
      # one's after the first (which compiled; until a second, evaluations count as free).
      need = self._cost(epoch, self.epochs, self.steady_s, self.eval_s or 0.0)
    else:  # the next epoch, bounded by what the first epoch and evaluation took
      per_epoch = self.steady_s if self.steady_s is not None else self.first_s
      per_eval = self.eval_s if self.eval_s is not None else (self.first_eval_s or 0.0)
      need = self._cost(epoch, epoch + 1, per_epoch, per_eval)
    if spent + need <= self.max_seconds:
      return None
    what = f"the remaining {self.epochs - epoch} epochs" if whole else "the next epoch"
    return (
      f"max_seconds={self.max_seconds:g}: {what} would end about {spent + need:.0f} s after "
      f"fit began ({spent:.0f} s spent)"
    )
