"""The `fit` budget's plumbing: its settings keep the papers' hyper-parameters, every row records
whether it fit its data, and a model's dense run is trained once for every table that trains
it alike (on a tiny fit-shaped budget: a few epochs of random 8x8 images)."""

import dataclasses
import json

import numpy as np
import pytest

from experiments.benchmarks import fit_sizing, fit_width
from experiments.clicktrain import table1 as clicktrain_table1
from experiments.common import budgets, pages, rows
from experiments.prunetrain import table1 as prunetrain_table1
from jaxprune import data, models


def test_fit_keeps_the_papers_hyper_parameters_and_shares_one_recipe():
  ct = budgets.get_budget("clicktrain_table1", "fit")
  pt = budgets.get_budget("prunetrain_table1", "fit")
  sd = budgets.get_budget("sdgp_table1", "fit")
  for budget in (ct, pt, sd):
    assert budget.train_subset == budgets.FIT_TRAIN_SUBSET and budget.test_subset is None
    assert budget.epochs == budgets.FIT_EPOCHS and budget.batch_size == 128
  # PruneTrain §5: ratio 0.2, threshold 1e-4, every 10 of 182 epochs (5.3 of 96 -> 5)
  assert (pt.penalty_ratio, pt.threshold, pt.interval) == (0.2, 1e-4, 5)
  # ClickTrain: the paper's schedule and stages at the paper's fractions (5/190 of 96 -> 3)
  assert (ct.lr, ct.milestones, ct.pool_epochs, ct.finalize_epochs) == (0.1, (0.5, 0.75), 3, 3)
  assert (pt.lr, pt.milestones) == (ct.lr, ct.milestones)
  # the hard prune at each row's Table 1 epoch, scaled: ResNet-32 98/190, VGG-11 96/190 of 96
  args = clicktrain_table1._parse(["--budget", "fit"])
  assert clicktrain_table1._stage_epochs(args, "resnet32")["hard_prune_epoch"] == 50
  assert clicktrain_table1._stage_epochs(args, "vgg11")["hard_prune_epoch"] == 49
  assert "pool_start_epoch" not in clicktrain_table1._stage_epochs(args, "vgg11")  # §4.1 trigger
  # ClickTrain's networks get the same width in both tables (their dense runs are one run)
  for model in ("clicktrain-resnet32", "clicktrain-vgg11"):
    assert budgets.row_width(pt.width, model) == budgets.row_width(ct.width, model)
  assert budgets.row_width(pt.width, "prunetrain-resnet32") == 1.0
  assert budgets.row_width(ct.width, "vgg11") == budgets.row_width(ct.width, "clicktrain-vgg11")
  # SDGP: its recipe at 96 epochs (the triangle's peak at 2/150 of the run)
  assert sd.peak_epoch == pytest.approx(96 * 2 / 150) and sd.peak_lr == 0.5 * 128 / 512


def test_last_quarter_gain_is_the_rise_inside_the_final_lr_phase():
  evals = [(4, 0.5), (8, 0.6), (12, 0.7), (13, 0.75), (14, 0.77), (16, 0.78)]
  history = [{"epoch": e, "test_acc": a} for e, a in evals]
  # 16 epochs: the quarter is epochs 13-16 (after the last LR drop at epoch 12)
  assert rows.last_quarter_gain(history) == pytest.approx(0.03)
  # an epoch without evaluation counts as none: the quarter's first evaluation is then 14
  history[3] = {"epoch": 13}
  assert rows.last_quarter_gain(history) == pytest.approx(0.01)
  assert rows.last_quarter_gain([{"epoch": 1, "test_acc": 0.5}]) is None
  one_in_quarter = [{"epoch": 8, "test_acc": 0.5}, {"epoch": 12, "test_acc": 0.6}]
  assert rows.last_quarter_gain(one_in_quarter) is None


@pytest.mark.parametrize(
  ("train_acc", "gain", "verdict"),
  [
    (0.97, 0.005, True),
    (0.9699, 0.0, False),
    (1.0, 0.0051, False),
    (1.0, -0.02, True),
    (None, 0.0, None),
  ],
)
def test_a_run_fits_at_97_percent_train_accuracy_and_a_half_point_plateau(train_acc, gain, verdict):
  run = {"train_acc": train_acc, "test_gain_last_quarter": gain}
  assert pages.fits({k: v for k, v in run.items() if v is not None}) is verdict


def test_shared_runs_of_other_settings_never_meet_and_a_tampered_one_is_refused(tmp_path):
  a = rows.SharedRun(tmp_path, "fit_m_seed0", {"epochs": 4})
  b = rows.SharedRun(tmp_path, "fit_m_seed0", {"epochs": 8})
  assert a.path != b.path and a.load() is None
  a.save("t", {"history": [{"epoch": 4, "test_acc": 0.5}], "train_acc": 0.9, "command": "c"})
  assert a.load()["trained_by"] == "t" and b.load() is None
  saved = json.loads(a.path.read_text())
  a.path.write_text(json.dumps({**saved, "settings": {"epochs": 5}}))
  with pytest.raises(ValueError, match="other settings"):
    a.load()


@pytest.fixture
def tiny_fit(monkeypatch):
  """Both tables' `fit` budgets shrunk to 8 epochs of 32 random 8x8 images at batch 16, and
  every model a quarter-width PruneTrain ResNet-8 whatever its name (its name still keys the
  shared run); returns the list of the methods whose training ran."""
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(48, 8, 8, 3), dtype=np.uint8)
  labels = np.arange(48, dtype=np.int32) % 10
  sets = {
    "train": data.Dataset.from_arrays(images[:32], labels[:32], num_classes=10),
    "test": data.Dataset.from_arrays(images[32:], labels[32:], num_classes=10),
  }
  monkeypatch.setattr(data, "load", lambda name, root=None, split="train": sets[split])
  create = models.create

  def tiny(name, *, linear_init_std=None, **kw):
    return create("prunetrain-resnet20", spec=models.prunetrain_resnet_spec(8), **kw)

  monkeypatch.setattr(models, "create", tiny)
  for table in ("clicktrain_table1", "prunetrain_table1"):
    fit = dataclasses.replace(
      budgets.BUDGETS[table]["fit"], width=0.25, train_subset=None, epochs=8, batch_size=16
    )
    monkeypatch.setitem(budgets.BUDGETS, table, {**budgets.BUDGETS[table], "fit": fit})
  trained = []
  advance = rows.Row.advance

  def counted(self, epochs, **kw):
    if self.trainer.epoch < epochs:
      trained.append(self.method)
    return advance(self, epochs, **kw)

  monkeypatch.setattr(rows.Row, "advance", counted)
  return trained


def test_every_row_records_its_fit_and_a_shared_dense_run_is_trained_once(tmp_path, tiny_fit):
  out = ["--budget", "fit", "--eval-every", "1", "--out", str(tmp_path)]
  ct = clicktrain_table1.main(["--rows", "vgg11", "--methods", "dense", *out])["vgg11"]["dense"]
  assert tiny_fit == ["dense"]
  # both fit figures, recorded and shown
  ct_log = [
    json.loads(line) for line in (tmp_path / "logs" / "table1_fit_vgg11_dense.jsonl").open()
  ]
  assert 0.0 <= ct["train_acc"] <= 1.0
  # 8 epochs: the last quarter is epochs 7 and 8
  assert ct["test_gain_last_quarter"] == pytest.approx(
    ct_log[7]["test_acc"] - ct_log[6]["test_acc"]
  )
  page = (tmp_path / "table1_fit.md").read_text()
  assert "## Does each run fit its data" in page and "| vgg11 dense | " in page
  # PruneTrain's table on ClickTrain's VGG-11: its dense run is taken, PruneTrain's is trained
  pt = prunetrain_table1.main(
    ["--rows", "vgg11", "--family", "clicktrain", "--no-dynamic-batch", *out]
  )
  assert tiny_fit == ["dense", "prunetrain"]
  dense = pt["vgg11"]["dense"]
  assert dense["shared_from"]["trained_by"] == "vgg11 dense"
  for key in ("test_acc", "train_acc", "test_gain_last_quarter"):
    assert dense[key] == ct[key]
  assert dense["history"] == ct_log and "train_acc" in pt["vgg11"]["prunetrain"]
  # its page links the dense run's epochs and shows both runs' fit
  row_page = (tmp_path / "table1_fit_clicktrain-vgg11.md").read_text()
  assert (tmp_path / "logs" / "table1_fit_clicktrain-vgg11_dense.jsonl").exists()
  assert "| dense | " in row_page and "| prunetrain | " in row_page
  # the claim that makes the sharing honest: without the shared run, PruneTrain's table
  # trains the same dense run itself
  for path in (tmp_path / "shared").glob("*.json"):
    path.unlink()
  alone = prunetrain_table1.main(
    ["--rows", "vgg11", "--family", "clicktrain", "--no-dynamic-batch", "--skip-dense", *out]
  )
  assert tiny_fit == ["dense", "prunetrain", "prunetrain"]
  assert alone["vgg11"]["prunetrain"]["test_acc"] == pt["vgg11"]["prunetrain"]["test_acc"]
  again = prunetrain_table1.main(
    [
      "--rows",
      "vgg11",
      "--family",
      "clicktrain",
      "--no-dynamic-batch",
      *out[:-1],
      str(tmp_path / "b"),
    ]
  )["vgg11"]["dense"]
  assert tiny_fit[-2:] == ["dense", "prunetrain"] and "shared_from" not in again
  assert [again[k] for k in ("test_acc", "train_acc")] == [ct[k] for k in ("test_acc", "train_acc")]
  assert again["history"][-1]["train_loss"] == ct_log[-1]["train_loss"]


def test_a_sizing_probe_at_the_budgets_settings_is_the_tables_dense_run(tmp_path, tiny_fit):
  out = ["--eval-every", "1", "--out", str(tmp_path)]
  probe = fit_sizing.main(["--model", "clicktrain-vgg11", *out])["record"]
  other = fit_sizing.main(["--model", "clicktrain-vgg11", "--epochs", "2", *out])["record"]
  assert tiny_fit == ["dense", "dense"]
  assert probe["test_gain_last_quarter"] is not None and other["test_gain_last_quarter"] is None
  ct = clicktrain_table1.main(["--rows", "vgg11", "--methods", "dense", "--budget", "fit", *out])
  assert tiny_fit == ["dense", "dense"]  # taken from the probe
  assert ct["vgg11"]["dense"]["test_acc"] == probe["test_acc"]
  page = (tmp_path / "fit_sizing.md").read_text()
  lines = [
    line
    for line in page.splitlines()
    if line.startswith("| prunetrain-") or line.startswith("| clicktrain-")
  ]
  assert len(lines) == 2
  assert (
    sum("| `fit` |" in line for line in lines) == 1
    and sum("| probe |" in line for line in lines) == 1
  )


def test_a_width_run_is_named_by_its_width_and_the_sweep_pairs_each_method_with_its_dense(
  tmp_path, tiny_fit
):
  out = ["--budget", "fit", "--eval-every", "2", "--out", str(tmp_path)]
  clicktrain_table1.main(["--rows", "vgg11", "--methods", "dense", "--width", "0.125", *out])
  saved = json.loads((tmp_path / "table1_fit_w0.125_vgg11_dense.json").read_text())
  assert "Width sweep: every row at width ×0.125" in (tmp_path / "table1_fit_w0.125.md").read_text()
  assert not (tmp_path / "table1_fit.md").exists()  # not a row of the budget's own table
  # the sweep page reads the runs where the tables publish them (the fixture's fit width is
  # 0.25, so ×0.0625 is a --width run)
  results = tmp_path / "results"
  (results / "clicktrain").mkdir(parents=True)
  dense = {"test_acc": 0.8, "train_acc": 0.99}
  pruned = {"test_acc": 0.79, "compression": 8.5, "train_acc": 0.98}
  for name, run in [("dense", dense), ("clicktrain", pruned)]:
    (results / "clicktrain" / f"table1_fit_w0.0625_vgg11_{name}.json").write_text(json.dumps(run))
  (results / "prunetrain" / "probes").mkdir(parents=True)
  pt = {"runs": {"dense": dense, "prunetrain": {"test_acc": 0.75, "params_ratio": 0.25}}}
  (results / "prunetrain" / "probes" / "table1_fit_clicktrain-vgg11_w0.0625.json").write_text(
    json.dumps(pt)
  )
  entries = fit_width.sweep(results, [0.0625, 0.5])
  assert [e["width"] for e in entries] == [0.0625] and saved["test_acc"] is not None
  methods = entries[0]["methods"]
  assert methods["ClickTrain fine-grained"]["delta"] == pytest.approx(-1.0)
  assert methods["PruneTrain"]["delta"] == pytest.approx(-5.0)
  assert methods["PruneTrain"]["compression"] == pytest.approx(4.0)
  assert "ClickTrain aligned G=8" not in methods
  text = fit_width.page(entries, "cmd", None)
  assert (
    "| ×0.0625 | 80.00 | 99.00 | ClickTrain fine-grained | 79.00 | -1.00 | 8.50x | 98.00 |" in text
  )
