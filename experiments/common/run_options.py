"""How a table command runs its trainings: which loader, how often it evaluates and saves, and
the time box of one command.

Every table command takes these flags (:func:`add_arguments`), so a paper-budget row fits the
time a GPU gives one command:

- ``--loader {auto,host,device}``: ``device`` keeps the uint8 data set on the accelerator and
  augments there, inside the train step (:class:`jaxprune.data.DeviceLoader`); ``host`` is the
  NumPy :class:`jaxprune.data.Loader`. ``auto``: device on an accelerator, host on a CPU.
- ``--steps-per-dispatch K``: train steps fused into one device call (device loader only;
  default 13 on an accelerator, 1 on a CPU).
- ``--eval-every N`` / ``--checkpoint-every N``: at the ``paper`` budget on an accelerator the
  defaults are 10 and 0 (a checkpoint only when the run stops or ends: a ClickTrain state is
  165-407 MiB), at ``fit`` 8 and 1, elsewhere 1 and 1. The last epoch is always evaluated.
- ``--compile-cache {auto,on,off}``: JAX's persistent compilation cache
  (:mod:`experiments.common.compile_cache`), on by default on an accelerator.
- ``--max-seconds S``: the whole command stops, checkpointed, before an epoch that would end
  past ``S`` seconds after it began; ``--resume`` continues it. ``--must-finish``: a run
  stops as soon as it cannot end inside the box (for a window whose partial runs are lost).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from experiments.common import budgets, pages

LOADERS = ("auto", "host", "device")
# Steps per device call on an accelerator, as a lax.scan. Measured on an H200 (VGG-11, batch
# 128, benchmarks/device_loader_*_gpu.md): 13 steps per call trained ClickTrain at 59.1k
# images/s against 22.7k at one step per call (its stage machine's conditionals make each call
# wait on the device) and 15.9k on the host loader; dense 77.9k against 71.2k and 70.4k. On a
# CPU one step per call: XLA:CPU ran a train step inside a scan several times slower.
ACCELERATOR_STEPS_PER_DISPATCH = 13
# Evaluation cadence of the `fit` budget's runs (budgets.FIT_EPOCHS is 4 times a multiple of it).
FIT_EVAL_EVERY = 8


@dataclasses.dataclass(frozen=True)
class RunOptions:
  """How one table command runs its trainings: the flags of :func:`add_arguments` with their
  defaults filled in (:func:`resolve`), ``--resume``, and when the command's time box began.

  Attributes:
    loader: ``"host"`` or ``"device"``.
    steps_per_dispatch: train steps per device call (device loader).
    eval_every: evaluate every N epochs (the last always).
    checkpoint_every: checkpoint every N epochs; 0: only when a run stops or ends.
    max_seconds: the command's time box, or None.
    must_finish: stop a run as soon as it cannot end inside the box.
    compile_cache: ``"auto"``, ``"off"``, or the folder of the enabled cache.
    resume: continue each run from its latest checkpoint.
    started: ``time.perf_counter()`` when the options were resolved: ``--max-seconds`` counts
      from here (kept out of comparisons and of what a run saves).
  """

  loader: str
  steps_per_dispatch: int
  eval_every: int
  checkpoint_every: int
  max_seconds: float | None = None
  must_finish: bool = False
  compile_cache: str = "off"
  resume: bool = False
  started: float = dataclasses.field(default_factory=time.perf_counter, compare=False, repr=False)

  def as_flags(self) -> dict[str, Any]:
    """The resolved flags by their argument names (``resume`` and the clock left out), as a
    command that saves its arguments records them."""
    flags = dataclasses.asdict(self)
    del flags["resume"], flags["started"]
    return flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """The flags of this module (see the module docstring)."""
  parser.add_argument(
    "--loader",
    choices=LOADERS,
    default="auto",
    help="device: data set and augmentation on the accelerator; host: NumPy loader; auto: "
    "device on an accelerator, host on a CPU",
  )
  parser.add_argument(
    "--steps-per-dispatch",
    type=int,
    default=None,
    help="train steps per device call with the device loader, as a lax.scan (default 13 on "
    "an accelerator, 1 on a CPU; rounded to a divisor of the epoch's steps)",
  )
  parser.add_argument(
    "--eval-every",
    type=int,
    default=None,
    help="evaluate every N epochs (the last always); default 10 at the paper budget on an "
    "accelerator, else 1",
  )
  parser.add_argument(
    "--checkpoint-every",
    type=int,
    default=None,
    help="checkpoint every N epochs; 0: only when the run stops or ends (default 0 at the "
    "paper budget on an accelerator, else 1)",
  )
  parser.add_argument(
    "--max-seconds",
    type=float,
    default=None,
    help="time box of the whole command: stop, checkpointed, before an epoch that would end "
    "past it (--resume continues)",
  )
  parser.add_argument(
    "--compile-cache",
    choices=("auto", "on", "off"),
    default="auto",
    help="JAX's persistent compilation cache (runs/jax_cache, or $JAXPRUNE_COMPILE_CACHE): a "
    "program compiled once is read back by later runs; auto: on on an accelerator",
  )
  parser.add_argument(
    "--must-finish",
    action="store_true",
    help="with --max-seconds: stop a run as soon as its remaining epochs cannot end in the box",
  )


def on_accelerator() -> bool:
  """Whether JAX's default backend is an accelerator (not the CPU)."""
  import jax

  return jax.default_backend() != "cpu"


def resolve(args: argparse.Namespace, budget: str) -> RunOptions:
  """The run options of ``args`` (the flags of :func:`add_arguments`, and ``--resume`` where
  the command has it), with the defaults that depend on ``budget`` and the backend filled in;
  the command's clock (``--max-seconds``) starts here. ``args`` is left as it is.

  Raises:
    ValueError: a negative or zero value, or ``--must-finish`` without ``--max-seconds``
      (named).
  """
  accelerator = on_accelerator()
  long_run = accelerator and budget == "paper"
  loader = args.loader
  if loader == "auto":
    loader = "device" if accelerator else "host"
  chosen = {
    "steps_per_dispatch": args.steps_per_dispatch,
    "eval_every": args.eval_every,
    "checkpoint_every": args.checkpoint_every,
  }
  defaults = {
    "steps_per_dispatch": ACCELERATOR_STEPS_PER_DISPATCH if accelerator else 1,
    # At `fit` the full test set costs two fifths of an epoch of 2 560 images on a CPU: every
    # FIT_EVAL_EVERY epochs (the last quarter's first epoch is one of them).
    "eval_every": 10 if long_run else FIT_EVAL_EVERY if budget == "fit" else 1,
    "checkpoint_every": 0 if long_run else 1,
  }
  least = {"steps_per_dispatch": 1, "eval_every": 1, "checkpoint_every": 0}
  for name, value in chosen.items():
    chosen[name] = defaults[name] if value is None else value
    if chosen[name] < least[name]:
      raise ValueError(f"--{name.replace('_', '-')} must be >= {least[name]}, got {chosen[name]}")
  if args.max_seconds is not None and args.max_seconds <= 0:
    raise ValueError(f"--max-seconds must be positive, got {args.max_seconds}")
  if args.must_finish and args.max_seconds is None:
    raise ValueError("--must-finish needs --max-seconds")
  cache = args.compile_cache
  if cache == "on" or (cache == "auto" and accelerator):
    from experiments.common import compile_cache

    cache = str(compile_cache.enable())
  return RunOptions(
    loader=loader,
    **chosen,
    max_seconds=args.max_seconds,
    must_finish=args.must_finish,
    compile_cache=cache,
    resume=bool(getattr(args, "resume", False)),
  )


# The flags of add_arguments, by their attribute names: RunOptions holds them resolved.
_OPTION_FLAGS = frozenset(field.name for field in dataclasses.fields(RunOptions)) - {
  "resume",
  "started",
}


def table_args(args: argparse.Namespace, table: str) -> argparse.Namespace:
  """A table command's parsed arguments with its two typed parts beside the flags:
  ``recipe``, the budget ``args.budget`` of ``table`` (:func:`budgets.get_budget`), and
  ``options``, the resolved run options (:func:`resolve`), which replace the unresolved flags
  (``loader="auto"``, ...). Returns a new namespace; ``args`` is left as it is."""
  flags = {k: v for k, v in vars(args).items() if k not in _OPTION_FLAGS}
  return argparse.Namespace(
    **flags,
    recipe=budgets.get_budget(table, args.budget),
    options=resolve(args, args.budget),
  )


def train_loader(
  options: RunOptions, dataset: Any, batch_size: int, augment: str, seed: int
) -> Any:
  """The training loader of ``options.loader`` (shuffled by ``seed``, last partial batch
  dropped)."""
  from jaxprune import data

  if options.loader == "device":
    return data.DeviceLoader(
      dataset,
      batch_size,
      shuffle=True,
      seed=seed,
      augment=augment,
      drop_last=True,
      steps_per_dispatch=options.steps_per_dispatch,
    )
  return data.Loader(dataset, batch_size, shuffle=True, seed=seed, augment=augment, drop_last=True)


def test_loader(options: RunOptions, dataset: Any, batch_size: int) -> Any:
  """The evaluation loader of ``options.loader`` (data set order, every example)."""
  from jaxprune import data

  make = data.DeviceLoader if options.loader == "device" else data.Loader
  return make(dataset, batch_size, shuffle=False, drop_last=False)


def trainer_kwargs(options: RunOptions) -> dict[str, int]:
  """``Trainer`` arguments: ``eval_every`` and ``checkpoint_every``."""
  return {"eval_every": options.eval_every, "checkpoint_every": options.checkpoint_every}


def run_config(options: RunOptions) -> dict[str, str]:
  """The loader entry of a run's saved configuration: ``{}`` for the host loader (so runs
  saved before this flag still resume), ``{"loader": "device"}`` otherwise: its augmentation
  draws differ, so a resume across loaders is refused."""
  return {} if options.loader == "host" else {"loader": options.loader}


def fit_kwargs(options: RunOptions) -> dict[str, Any]:
  """``fit`` arguments: what is left of the command's ``--max-seconds``, and
  ``must_finish``."""
  if options.max_seconds is None:
    return {}
  left = options.max_seconds - (time.perf_counter() - options.started)
  return {"max_seconds": max(left, 1e-3), "must_finish": options.must_finish}


def stopped(trainer: Any, label: str) -> bool:
  """Whether ``trainer``'s last fit stopped at the time box; if so, says so on stdout."""
  if trainer.stopped_early is None:
    return False
  kept = (
    "its checkpoint stays, and the same command with --resume continues it"
    if trainer.store is not None
    else "it keeps no checkpoint, so nothing of it is saved"
  )
  print(
    f"{label}: stopped after epoch {trainer.epoch} ({trainer.stopped_early}); {kept}", flush=True
  )
  return True


def provenance() -> dict[str, str]:
  """Where and when a result was trained, saved in its JSON, so a page rendered elsewhere (a
  GPU run published on a CPU machine) still names the machine and date that made it."""
  from experiments.common import machine, pages

  return {"machine": machine.machine_description(), "date": pages.utc_now()}


def page_provenance(runs: list[dict[str, Any]]) -> dict[str, str]:
  """``results_page``'s ``machine`` and ``date`` for a page gathering ``runs``: the machines
  the runs saved (:func:`provenance`), and the newest date, so a page names where its figures
  were made rather than where it was rendered; the current machine and now for runs that saved
  none."""
  from experiments.common import machine, pages

  here = None
  machines, dates = [], []
  for run in runs:
    if "machine" not in run:
      here = here or machine.machine_description()
    machines.append(run.get("machine", here))
    dates.append(run.get("date", pages.utc_now()))
  return {
    "machine": "; ".join(dict.fromkeys(machines)) or machine.machine_description(),
    "date": max(dates, default=pages.utc_now()),
  }


def checkpoint_dir(paper: str, stem: str, out: str | os.PathLike | None = None) -> Path:
  """Where a table run writes its epoch checkpoints: ``runs/checkpoints/<paper>/<stem>``
  (scratch, also for a ``--publish`` run, so they never land beside the results), or
  ``<out>/checkpoints/<stem>`` for a run with ``--out``."""
  if paper not in budgets.PAPERS:
    raise ValueError(f"paper: unknown {paper!r}; choose from {budgets.PAPERS}")
  base = Path(out) / "checkpoints" if out is not None else pages.SCRATCH / "checkpoints" / paper
  return base / stem


def start_or_resume(trainer: Any, train_loader: Any, resume: bool) -> bool:
  """Before a table run's first ``fit``: with ``resume``, restore the trainer's latest
  checkpoint. Returns whether one was restored.

  The run's ``fit`` calls then pass ``resume=False, overwrite=True``: a restored run goes on
  writing its own checkpoints, a fresh one first deletes what an earlier run left there.
  """
  if not resume:
    return False
  restored = trainer.restore_checkpoint(train_loader)
  where = trainer.store.directory if trainer.store is not None else None
  if restored:
    print(f"resumed at epoch {trainer.epoch} from {where}", flush=True)
  else:
    print(f"--resume: no checkpoint in {where}; starting afresh", flush=True)
  return restored
