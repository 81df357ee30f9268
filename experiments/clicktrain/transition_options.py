"""The Table 1 command's options beyond the paper for the way into the pruned structure.

The group lasso's ramp, the soft prune's window, learning-rate rewinding and the hard prune's
epoch at the ``cpu`` budget (the regularize stage's share of the run): their flags, their checks
and the mark each leaves on a run's name (``-rampc``, ``-win2``, ``-rw3``, ``-hp9``), so runs
with and without them sit side by side on the aligned page.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "check", "suffix"]


def add_arguments(p: argparse.ArgumentParser) -> None:
  """Adds ``--group-lasso-ramp``, ``--prune-window-epochs``, ``--lr-rewind-epoch`` and
  ``--hard-prune-epoch`` to ``p``."""
  p.add_argument(
    "--group-lasso-ramp",
    default="constant",
    choices=["constant", "linear", "cubic"],
    help="beyond the paper: λ held over the regularize stage (the paper) or grown from 0 "
    "linearly / cubically (saved with the suffix -ramp<l|c>)",
  )
  p.add_argument(
    "--prune-window-epochs",
    type=int,
    default=0,
    help="beyond the paper: a soft hard prune, the dropped weights decaying to zero over this "
    "many epochs before it (saved with the suffix -win<N>)",
  )
  p.add_argument(
    "--lr-rewind-epoch",
    type=int,
    default=None,
    help="beyond the paper: after the hard prune the LR schedule replays from this epoch to its "
    "end over the remaining epochs (learning-rate rewinding; saved with the suffix -rw<E>)",
  )
  p.add_argument(
    "--hard-prune-epoch",
    type=int,
    default=None,
    help="reduced budgets: the hard prune after this many epochs instead of at the budget's share "
    "of the run, so the regularize stage gets another share (saved with the suffix -hp<E>)",
  )


def check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
  """Stops the command (``p.error``) on a bad transition option, named."""
  if a.prune_window_epochs < 0:
    p.error("--prune-window-epochs must be >= 0")
  if a.hard_prune_epoch is not None:
    if a.recipe.hard_prune_fraction is None:
      p.error(f"--hard-prune-epoch: the {a.budget} budget prunes at each row's Table 1 epoch")
    if not 4 <= a.hard_prune_epoch < a.recipe.epochs:
      p.error(
        f"--hard-prune-epoch must be in [4, {a.recipe.epochs - 1}] (after warm-up, pool "
        f"generation, finalization and one regularized epoch; before the run's end), got "
        f"{a.hard_prune_epoch}"
      )


def suffix(a: argparse.Namespace) -> str:
  """The run name's mark of the options set (empty without them)."""
  marks = []
  if a.group_lasso_ramp != "constant":
    marks.append(f"ramp{a.group_lasso_ramp[0]}")
  if a.prune_window_epochs:
    marks.append(f"win{a.prune_window_epochs}")
  if a.lr_rewind_epoch is not None:
    marks.append(f"rw{a.lr_rewind_epoch}")
  if a.hard_prune_epoch is not None:
    marks.append(f"hp{a.hard_prune_epoch}")
  return "".join(f"-{m}" for m in marks)
