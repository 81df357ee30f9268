"""Learning-rate rewinding after a prune (train.schedules.with_rewind) against a plain loop."""

import numpy as np
import pytest

from jaxprune.train.schedules import step_schedule, triangular_schedule, with_rewind

SPE = 10


def _reference(base, step, prune, rewind, total):
  """The LR a run with rewinding applies at ``step``: the schedule until the prune, then the
  stretch from ``rewind`` to ``total`` epochs replayed over the remaining epochs."""
  if step < prune * SPE:
    return base(step)
  done = (step - prune * SPE) / ((total - prune) * SPE)  # share of the healing epochs done
  return base(rewind * SPE + done * (total - rewind) * SPE)


@pytest.mark.parametrize(
  "base",
  [step_schedule(0.1, SPE, [3, 6]), triangular_schedule(0.4, SPE, peak_epoch=1, total_epochs=8)],
)
@pytest.mark.parametrize(("prune", "rewind"), [(4, 0), (4, 2), (5, 5)])
def test_rewound_schedule_replays_the_schedule_from_the_rewind_epoch(base, prune, rewind):
  total = 8
  sched = with_rewind(base, SPE, prune_epoch=prune, rewind_epoch=rewind, total_epochs=total)
  for step in range(total * SPE + 1):
    want = float(_reference(lambda s: float(base(s)), step, prune, rewind, total))
    assert float(sched(step)) == pytest.approx(want, rel=1e-6, abs=1e-9), step
  # The first healing step takes the rewind epoch's LR; the run ends on the schedule's end.
  assert float(sched(prune * SPE)) == pytest.approx(float(base(rewind * SPE)))
  assert float(sched(total * SPE)) == pytest.approx(float(base(total * SPE)))
  # rewind == prune: the schedule unchanged.
  if rewind == prune:
    np.testing.assert_allclose(
      [float(sched(s)) for s in range(0, 81, 7)], [float(base(s)) for s in range(0, 81, 7)]
    )


@pytest.mark.parametrize(
  ("kwargs", "says"),
  [
    ({"prune_epoch": 4, "rewind_epoch": 5, "total_epochs": 8}, "rewind_epoch"),
    ({"prune_epoch": 8, "rewind_epoch": 0, "total_epochs": 8}, "total_epochs"),
    ({"prune_epoch": -1, "rewind_epoch": 0, "total_epochs": 8}, "prune_epoch"),
    ({"prune_epoch": 4, "rewind_epoch": 1.5, "total_epochs": 8}, "rewind_epoch"),
  ],
)
def test_bad_rewind_epochs_are_named(kwargs, says):
  with pytest.raises(ValueError, match=says):
    with_rewind(0.1, SPE, **kwargs)
