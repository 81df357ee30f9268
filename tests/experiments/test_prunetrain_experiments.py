"""PruneTrain experiment plumbing: reusing an earlier run's dense row, the speed options."""

import dataclasses
import json

import pytest

from experiments.common import budgets, rows
from experiments.prunetrain import speed as prunetrain_speed
from experiments.prunetrain import table1 as prunetrain_table1
from experiments.prunetrain import table1_pages


def _saved(argv):
  """The saved settings of a ResNet-32 row of the command ``argv``."""
  return prunetrain_table1.saved_args(prunetrain_table1._parse(argv), "resnet32")


def _write_earlier(path, args, dense):
  earlier = {"args": {k: getattr(args, k) for k in prunetrain_table1._DENSE_SETTINGS}}
  earlier["args"]["penalty_ratio"] = 0.99  # a PruneTrain setting: must not matter
  earlier["runs"] = {"dense": dense, "prunetrain": {"test_acc": 0.1}}
  path.write_text(json.dumps(earlier))


def test_reuse_dense_returns_the_dense_run_of_a_matching_json(tmp_path):
  path = tmp_path / "earlier.json"
  args = _saved(["--budget", "cpu", "--skip-dense", "--reuse-dense", str(path)])
  dense = {"test_acc": 0.567, "train_time_s": 840.0}
  _write_earlier(path, args, dense)
  assert prunetrain_table1._reused_dense_run(args, "any_name") == dense


def test_reuse_dense_default_json_is_the_name_without_suffix(tmp_path, monkeypatch):
  args = _saved(
    ["--out", str(tmp_path), "--skip-dense", "--reuse-dense", "--name-suffix", "_sweep"]
  )
  dense = {"test_acc": 0.5}
  _write_earlier(tmp_path / "table1_cpu_resnet32.json", args, dense)
  run = prunetrain_table1._reused_dense_run(args, "table1_cpu_resnet32_sweep")
  assert run == dense


def test_reuse_dense_rejects_other_dense_settings(tmp_path):
  path = tmp_path / "earlier.json"
  args = _saved(["--budget", "cpu", "--skip-dense", "--reuse-dense", str(path)])
  _write_earlier(path, args, {"test_acc": 0.5})
  args.lr = args.lr * 2
  args.milestones = [0.5]
  with pytest.raises(ValueError, match=r"--reuse-dense: .* other lr, milestones"):
    prunetrain_table1._reused_dense_run(args, "any_name")


def test_reuse_dense_rejects_a_run_of_another_dtype(tmp_path):
  path = tmp_path / "earlier.json"
  argv = ["--budget", "cpu", "--skip-dense", "--reuse-dense", str(path)]
  fp32, bf16 = _saved(argv), _saved([*argv, "--dtype", "bf16"])
  _write_earlier(path, fp32, {"test_acc": 0.5})  # saved without a dtype, as before the flag
  assert prunetrain_table1._reused_dense_run(fp32, "any_name") == {"test_acc": 0.5}
  with pytest.raises(ValueError, match=r"--reuse-dense: .* other dtype"):
    prunetrain_table1._reused_dense_run(bf16, "any_name")
  earlier = json.loads(path.read_text())
  earlier["args"]["dtype"] = "bf16"
  path.write_text(json.dumps(earlier))
  assert prunetrain_table1._reused_dense_run(bf16, "any_name") == {"test_acc": 0.5}
  with pytest.raises(ValueError, match=r"--reuse-dense: .* other dtype"):
    prunetrain_table1._reused_dense_run(fp32, "any_name")


def test_reuse_dense_without_skip_dense_is_an_error(tmp_path):
  with pytest.raises(SystemExit):
    prunetrain_table1._parse(["--budget", "cpu", "--reuse-dense", str(tmp_path / "x.json")])
  args = _saved(["--budget", "cpu"])
  assert prunetrain_table1._reused_dense_run(args, "any_name") is None


def test_speed_options():
  args = prunetrain_speed._parse(["--keep", "--run", "a.json", "--name-suffix", "_x"])
  assert args.keep == [] and args.run == ["a.json"] and args.name_suffix == "_x"
  assert prunetrain_speed._parse([]).keep == [0.75, 0.5, 0.25]
  for bad in (["--keep"], ["--keep", "0"], ["--keep", "1.5"]):
    with pytest.raises(SystemExit):
      prunetrain_speed._parse(bad)


class _RecordingRun:
  def __init__(self, method, calls):
    self.method, self.calls = method, calls

  def advance(self, epochs):
    self.calls.append((self.method, epochs))


def test_train_paired_alternates_epochs_and_swaps_the_order():
  calls = []
  runs = [_RecordingRun("dense", calls), _RecordingRun("prunetrain", calls)]
  prunetrain_table1._train_paired(runs, 3)
  assert calls == [
    ("dense", 1),
    ("prunetrain", 1),
    ("prunetrain", 2),
    ("dense", 2),
    ("dense", 3),
    ("prunetrain", 3),
  ]


def test_paired_is_rejected_with_skip_dense():
  with pytest.raises(SystemExit):
    prunetrain_table1._parse(["--budget", "cpu", "--paired", "--skip-dense"])
  assert prunetrain_table1._parse(["--budget", "cpu", "--paired"]).paired


def test_another_penalty_ratio_is_a_probe_of_the_budget_at_that_ratio():
  """``--penalty-ratio`` changes only the budget's ratio and names the run a probe."""
  args = prunetrain_table1._parse(["--budget", "fit", "--penalty-ratio", "0.9"])
  fit = budgets.get_budget("prunetrain_table1", "fit")
  assert args.recipe == dataclasses.replace(fit, penalty_ratio=0.9)
  assert args.name_suffix == "_r0.9"
  assert prunetrain_table1._parse(["--budget", "fit"]).recipe == fit
  for bad in ("0", "1", "-0.5"):
    with pytest.raises(SystemExit):
      prunetrain_table1._parse(["--budget", "fit", "--penalty-ratio", bad])


def test_the_penalty_shrink_bound_sums_lr_over_the_steps():
  """20 steps at lr 0.1 and 10 at 0.01, λ = 1e-3, momentum 0.9: (2 + 0.1) · 1e-3 / 0.1."""
  run = {"lambda": 1e-3, "history": [{"steps": 20, "lr": 0.1}, {"steps": 10, "lr": 0.01}]}
  assert table1_pages.penalty_shrink_bound(run) == pytest.approx(0.021)
  assert table1_pages.penalty_shrink_bound(run, momentum=0.0) == pytest.approx(0.0021)


@pytest.fixture
def tiny_rows(monkeypatch):
  """``(train_set, test_set, make_args)`` for rows trained in seconds: 48 random 8x8 images,
  PruneTrain's ResNet-8 at quarter width whatever the row (one block per stage: a third of
  ResNet-20's compile time, the same reconfiguration code), 2 epochs, ratio and threshold high
  enough that channels die in the second epoch's check."""
  import numpy as np

  from jaxprune import data, models

  create = models.create
  monkeypatch.setattr(
    prunetrain_table1.models,
    "create",
    lambda name, **kw: create("prunetrain-resnet20", spec=models.prunetrain_resnet_spec(8), **kw),
  )
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(48, 8, 8, 3), dtype=np.uint8)
  labels = np.arange(48, dtype=np.int32) % 10
  train_set = data.Dataset.from_arrays(images, labels, num_classes=10)
  test_set = data.Dataset.from_arrays(images[:16], labels[:16], num_classes=10)

  def make_args(**changes):
    args = prunetrain_table1._parse(["--budget", "cpu", "--no-dynamic-batch"])
    tiny = {"epochs": 2, "batch_size": 16, "lr": 0.5, "milestones": ()}
    tiny.update(penalty_ratio=0.95, threshold=0.3, width=0.25, **changes)
    args.recipe = dataclasses.replace(args.recipe, **tiny)
    return args

  return train_set, test_set, make_args


def test_paired_training_computes_what_separate_runs_compute(tmp_path, tiny_rows):
  """Alternating two trainers' epochs must not change either run: same losses, accuracy,
  reconfigurations and final weights as each run trained alone."""
  import jax
  import numpy as np

  train_set, test_set, make_args = tiny_rows
  args = make_args()

  def build(method, sub):
    (tmp_path / sub).mkdir(exist_ok=True)
    spec = prunetrain_table1._spec(args, "resnet32", method, train_set, test_set, tmp_path / sub)
    return rows.build_row(spec, args.options)

  paired = [build("dense", "paired"), build("prunetrain", "paired")]
  prunetrain_table1._train_paired(paired, args.recipe.epochs)
  for run in paired:
    alone = build(run.method, "alone")
    alone.advance(args.recipe.epochs)
    keys = ("train_loss", "test_acc", "steps", "batch_size", "pt_channels_removed")
    assert [[r.get(k) for k in keys] for r in run.trainer.history] == [
      [r.get(k) for k in keys] for r in alone.trainer.history
    ]
    for a, b in zip(jax.tree.leaves(run.trainer.params), jax.tree.leaves(alone.trainer.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  pt_history = paired[1].trainer.history
  assert any((r.get("pt_channels_removed") or 0) > 0 for r in pt_history), pt_history
  # the paired table: one row per epoch, PruneTrain's epoch time beside dense's
  args.paired = True
  results = {run.method: rows.row_record(run, args.options) for run in paired}
  paper = prunetrain_table1.PAPER["prunetrain-resnet32"]
  saved = prunetrain_table1.saved_args(args, "resnet32")
  table1_pages.row_page(tmp_path / "paired", saved, results, "cmd", paper)
  assert (tmp_path / "paired_over_training.png").exists()
  lines = (tmp_path / "paired.md").read_text().splitlines()
  header = lines.index(next(line for line in lines if line.startswith("| epoch | dense epoch")))
  epochs = args.recipe.epochs
  table = [line.split("|")[1:-1] for line in lines[header + 2 : header + 2 + epochs]]
  for row, d, p in zip(table, results["dense"]["history"], pt_history):
    assert float(row[1]) == pytest.approx(d["epoch_time_s"], abs=0.06)
    assert float(row[2]) == pytest.approx(p["epoch_time_s"], abs=0.06)
  assert float(table[-1][5]) < 1.0  # the second epoch trained the pruned model


def test_running_stats_probe_gives_before_and_after_of_one_run(tmp_path, tiny_rows):
  """With --recompute-batchnorm the row also records the accuracy with the running statistics
  as training left them, taken before the re-estimation: at epoch 1 it equals a run without
  re-estimation, and re-estimation changes nothing of the training (the same weights)."""
  import jax
  import numpy as np

  train_set, test_set, make_args = tiny_rows

  def run(recompute):
    args = make_args()
    args.recompute_batchnorm = recompute
    (tmp_path / str(recompute)).mkdir()
    spec = prunetrain_table1._spec(
      args, "resnet32", "prunetrain", train_set, test_set, tmp_path / str(recompute)
    )
    built = rows.build_row(spec, args.options)
    built.advance(args.recipe.epochs)
    return built.trainer

  plain, probed = run(0), run(2)
  assert all("test_acc_running_stats" not in r for r in plain.history)
  stale = [r["test_acc_running_stats"] for r in probed.history]
  assert len(stale) == 2 and all(0.0 <= a <= 1.0 for a in stale)
  assert stale[0] == plain.history[0]["test_acc"]
  for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(probed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_resumed_run_continues_from_the_reconfigured_checkpoint(tmp_path, tiny_rows):
  """``--resume`` is wired through: a PruneTrain run stopped after the epoch that reconfigured
  the network and continued by a new build starts from that checkpoint (the smaller model and
  the callback's state come back; the history is stitched whole); a run without ``--resume``
  replaces those checkpoints, and one under other settings is refused. That the resumed run
  trains exactly what an uninterrupted one trains is the trainer's property, proven in
  tests/train/test_resume.py and, across a reconfiguration, tests/prunetrain/."""
  train_set, test_set, make_args = tiny_rows
  checkpoints = tmp_path / "ckpt"

  def build(sub, resume=False, ckpt=checkpoints, **changes):
    args = make_args(epochs=3, **changes)
    args.options = dataclasses.replace(args.options, resume=resume)
    (tmp_path / sub).mkdir(exist_ok=True)
    spec = prunetrain_table1._spec(
      args, "resnet32", "prunetrain", train_set, test_set, tmp_path / sub, ckpt
    )
    return rows.build_row(spec, args.options)

  first = build("parts")
  first.advance(2)
  assert any((r.get("pt_channels_removed") or 0) > 0 for r in first.trainer.history)
  first.trainer.close()  # the stopped run lets its folder go, as its process would by ending
  with pytest.raises(ValueError, match="lr"):
    build("other", resume=True, lr=0.25)
  resumed = build("parts", resume=True)
  assert resumed.trainer.epoch == 2 and resumed.steal_s is None
  assert resumed.wall_s == resumed.trainer.history[-1]["wall_time_s"] > 0
  # the reconfigured (narrower) model and its callback state, not a fresh full-width build
  assert resumed.trainer.model.spec == first.trainer.model.spec
  assert resumed.trainer.model.spec != build("full", ckpt=None).trainer.model.spec
  keys = ("train_loss", "test_acc", "steps", "batch_size", "pt_channels_removed")
  resumed.advance(3)
  assert [[r.get(k) for k in keys] for r in resumed.trainer.history[:2]] == [
    [r.get(k) for k in keys] for r in first.trainer.history
  ]
  assert [r["epoch"] for r in resumed.trainer.history] == [1, 2, 3]
  # Without --resume the run starts at epoch 0 and its checkpoints replace the earlier ones.
  resumed.trainer.close()
  fresh = build("fresh")
  assert fresh.trainer.epoch == 0
  fresh.advance(1)
  assert sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit()) == ["1"]


def test_row_and_probe_files_follow_the_results_naming_scheme(tmp_path, tiny_rows):
  """A row writes ``table1_<budget>_<row>.{md,json}`` and ``logs/..._<method>.jsonl``, its dense
  run ``shared/<budget>_<model>_seed<S>_<digest>.json``; a probe (``--name-suffix``) the same
  names with its suffix under ``probes/``; every link resolves."""
  import re

  train_set, test_set, make_args = tiny_rows
  args = make_args()
  args.out = str(tmp_path)
  name = "table1_cpu_resnet32"
  prunetrain_table1._run_row(args, "resnet32", name, tmp_path, "cmd", train_set, test_set)
  args.name_suffix, args.skip_dense = "_x", True
  prunetrain_table1._run_row(args, "resnet32", f"{name}_x", tmp_path, "cmd", train_set, test_set)
  files = {
    str(p.relative_to(tmp_path))
    for p in tmp_path.rglob("*")
    if p.is_file() and "checkpoints" not in p.parts and p.suffix != ".png"
  }
  # the dense run, shared with every table that trains the model alike
  shared = {f for f in files if f.startswith("shared/")}
  assert len(shared) == 1 and re.fullmatch(
    r"shared/cpu_prunetrain-resnet32_seed0_[0-9a-f]{10}\.json", shared.pop()
  )
  assert files - {f for f in files if f.startswith("shared/")} == {
    "table1_cpu_resnet32.json",
    "table1_cpu_resnet32.md",
    "logs/table1_cpu_resnet32_dense.jsonl",
    "logs/table1_cpu_resnet32_prunetrain.jsonl",
    "probes/table1_cpu_resnet32_x.json",
    "probes/table1_cpu_resnet32_x.md",
    "probes/logs/table1_cpu_resnet32_x_prunetrain.jsonl",
  }
  for page in tmp_path.rglob("*.md"):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
      assert (page.parent / target).exists(), (page.name, target)


def test_published_table_page_is_rebuilt_from_its_rows(tmp_path):
  """From the published rows' JSON the table page code writes the published page again (the
  date and machine aside), its log links included."""
  import re
  import shutil
  from pathlib import Path

  results = Path(__file__).resolve().parents[2] / "experiments" / "results" / "prunetrain"
  for path in results.glob("table1_cpu_*.json"):
    shutil.copy(path, tmp_path)
  rebuilt = prunetrain_table1.write_table_page(tmp_path, "cpu", "-").read_text()

  def stable(page):
    lines = [line for line in page.splitlines() if not re.match(r"- (Date|Machine):", line)]
    return [line for line in lines if line]

  assert stable(rebuilt) == stable((results / "table1_cpu.md").read_text())
  assert "(logs/table1_cpu_vgg11_prunetrain.jsonl)" in rebuilt


def test_gpu_queue_publishes_a_returned_prunetrain_row(tmp_path, tiny_rows, monkeypatch):
  """The queue's PruneTrain publisher end to end: a row trained under the ``paper`` budget's
  names (the budget set to the tiny row's own settings), returned in a bundle folder, lands
  on ``table1_paper.md`` beside the paper's Table 1 with its logs linked and copied."""
  import re

  from experiments.common import budgets
  from experiments.gpu import queue as gpu_queue

  train_set, test_set, make_args = tiny_rows
  args = make_args()
  args.budget = "paper"
  tables = budgets.BUDGETS["prunetrain_table1"]
  monkeypatch.setitem(budgets.BUDGETS, "prunetrain_table1", {**tables, "paper": args.recipe})
  returned = tmp_path / "returned" / "prunetrain"
  returned.mkdir(parents=True)
  name = "table1_paper_resnet32"
  prunetrain_table1._run_row(args, "resnet32", name, returned, "cmd", train_set, test_set)
  results = tmp_path / "results"
  written = gpu_queue.publish(tmp_path / "returned", results)
  page = results / "prunetrain" / "table1_paper.md"
  assert str(page) in written
  text = page.read_text()
  # the paper's ResNet-32 numbers (Δ accuracy, training and inference FLOPs) beside ours
  (row,) = [line for line in text.splitlines() if line.startswith("| [resnet32]")]
  assert "| -1.8 |" in row and "| 47% |" in row and "| 34% |" in row
  links = re.findall(r"\]\(([^)\s]+)\)", text)
  assert links and all((page.parent / link).exists() for link in links)
  assert (results / "prunetrain" / "logs" / "table1_paper_resnet32_prunetrain.jsonl").exists()
  assert not (results / "prunetrain" / "checkpoints").exists()


def test_row_stopped_by_its_time_box_resumes_to_the_end(tmp_path, tiny_rows, capsys):
  """``--max-seconds``: the row stops after the dense run's first epoch (the second would not
  fit), writes no result and keeps its checkpoint; ``--resume`` continues that run from its
  epoch, trains the PruneTrain run, writes the row and removes the checkpoints."""
  train_set, test_set, make_args = tiny_rows
  args = make_args()
  args.out = str(tmp_path)
  args.options = dataclasses.replace(args.options, max_seconds=0.001)
  name = "table1_cpu_resnet32"
  with pytest.warns(RuntimeWarning, match="fit stopped after epoch 1 of 2"):
    out = prunetrain_table1._run_row(args, "resnet32", name, tmp_path, "cmd", train_set, test_set)
  assert out == {"stopped": "dense"}
  assert not (tmp_path / f"{name}.json").exists()
  checkpoints = tmp_path / "checkpoints" / name
  assert (checkpoints / "dense" / "1").exists()
  args.options = dataclasses.replace(args.options, max_seconds=None, resume=True)
  capsys.readouterr()
  done = prunetrain_table1._run_row(args, "resnet32", name, tmp_path, "cmd", train_set, test_set)
  assert "resumed at epoch 1 from" in capsys.readouterr().out  # not a fresh start
  assert [r["epoch"] for r in done["dense"]["history"]] == [1, 2]
  assert [r["epoch"] for r in done["prunetrain"]["history"]] == [1, 2]
  assert (tmp_path / f"{name}.json").exists() and not (checkpoints / "dense").exists()
  # --page-only writes the same row page from its JSON (its date and machine kept).
  page = (tmp_path / f"{name}.md").read_text()
  (tmp_path / f"{name}.md").unlink()
  argv = ["--budget", "cpu", "--rows", "resnet32", "--page-only", "--out", str(tmp_path)]
  # (the tiny row's budget is not the cpu budget's: the table page leaves it off, and says so)
  with pytest.warns(RuntimeWarning, match="run with other budget settings"):
    prunetrain_table1.main(argv)
  assert (tmp_path / f"{name}.md").read_text() == page
  assert (tmp_path / "table1_cpu.md").exists()
  with pytest.raises(SystemExit, match="no saved row"):
    prunetrain_table1.main([*argv[:3], "vgg11", *argv[4:]])
  # A probe's name may hold a ratio: its files keep the whole name ("_r0.9.md", not "_r0.md").
  probes = tmp_path / "probes"
  probes.mkdir()
  (probes / f"{name}_r0.9.json").write_text((tmp_path / f"{name}.json").read_text())
  prunetrain_table1.main([*argv, "--penalty-ratio", "0.9"])
  assert sorted(p.name for p in probes.iterdir()) == [
    f"{name}_r0.9.json",
    f"{name}_r0.9.md",
    f"{name}_r0.9_over_training.png",
  ]
