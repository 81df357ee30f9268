"""The plumbing every experiment wing shares.

- :mod:`~experiments.common.budgets`: the named recipes of every paper table (``paper``,
  ``cpu``), typed and frozen, and the results folder each table writes to;
- :mod:`~experiments.common.cli`: the command-line flags the commands share (output folder,
  ``--publish``, ``--resume``, ``--dtype``, the table arguments) and the command a page states;
- :mod:`~experiments.common.run_options`: how a table command runs its trainings (loader,
  eval and checkpoint cadence, time box, resume), typed as ``RunOptions``;
- :mod:`~experiments.common.rows`: one row's training, the pipeline every table command shares
  (``run_row`` of a ``RowSpec``);
- :mod:`~experiments.common.pages`: where results go and the results page;
- :mod:`~experiments.common.machine`: the machine a page names;
- :mod:`~experiments.common.masks`: the synthetic pruned states the benches time
  (ClickTrain-like masks, PruneTrain-like dead channels);
- :mod:`~experiments.common.compile_cache` and :mod:`~experiments.common.op_profile`.

Nothing here imports a wing; the wings import from here.
"""
