"""SDGP experiment plumbing: argument parsing, budgets, the conv-layer recorder, Fig. 8 layout."""

import json

import pytest
from flax import nnx

from experiments.common import budgets
from experiments.sdgp import fig8 as sdgp_fig8
from experiments.sdgp import table1 as sdgp_table1
from experiments.sdgp import timemodel as sdgp_timemodel
from jaxprune import models


def test_fig8_settings_parse_and_reject():
  assert sdgp_fig8._parse_settings("2:4,4:32") == [(2, 4), (4, 32)]
  for bad in ("2-4", "5:4", "1:64", "0:4"):
    with pytest.raises(ValueError, match="--settings"):
      sdgp_fig8._parse_settings(bad)


def test_sdgp_budgets_scale_the_peak_lr_with_the_batch():
  paper = sdgp_table1._parse(["--budget", "paper"]).recipe
  # the paper's recipe: batch 512, peak 0.5 at epoch 2 of 150, full width and data
  assert paper["peak_lr"] == 0.5 and paper["peak_epoch"] == 2.0
  assert paper["width"] == 1.0 and paper["epochs"] == 150 and paper["train_subset"] is None
  cpu = sdgp_table1._parse([]).recipe
  assert cpu["peak_lr"] == 0.5 * cpu["batch_size"] / 512
  assert cpu["peak_epoch"] == 0.5  # 2/150 of a short run, floored at half an epoch


def test_fig8_resume_keeps_earlier_cells_and_trains_only_missing_ones(tmp_path, monkeypatch):
  trained = []

  def fake_train_row(method, n, m, budget, train_set, test_set, args, log_path=None):
    trained.append((method, n, m))
    return {"method": method, "n": n, "m": m, "test_acc": 0.5 + n / (10 * m)}

  monkeypatch.setattr(sdgp_table1, "load_data", lambda args, budget: (None, None))
  monkeypatch.setattr(sdgp_table1, "train_row", fake_train_row)

  out_dir = ["--out", str(tmp_path)]
  sdgp_fig8.main(["--budget", "cpu", "--no-dense", "--settings", "1:4,2:8", *out_dir])
  assert trained == [("rescaled_magnitude", 1, 4), ("rescaled_magnitude", 2, 8)]
  trained.clear()
  out = sdgp_fig8.main(
    ["--budget", "cpu", "--no-dense", "--resume", "--settings", "2:8,4:32", *out_dir]
  )
  assert trained == [("rescaled_magnitude", 4, 32)]  # 2:8 came from the file
  assert sorted((c["n"], c["m"]) for c in out["cells"]) == [(1, 4), (2, 8), (4, 32)]
  md = (tmp_path / "fig8_cpu.md").read_text()
  assert "3 of 3" in md and "--resume" in md

  # A file written under another budget is not silently mixed in.
  with pytest.raises(ValueError, match="--resume"):
    sdgp_fig8.main(
      ["--budget", "paper", "--name", "fig8_cpu", "--no-dense", "--resume", "--settings", "1:4"]
      + out_dir
    )


def _table1_row(method, n, m):
  """What ``train_row`` returns, as far as the Table I page reads it."""
  return {
    "method": method,
    "n": n,
    "m": m,
    "test_acc": 0.5,
    "final_train_loss": 1.0,
    "train_time_s": 60.0,
  }


def test_table1_rows_run_at_the_same_time_both_reach_the_page(tmp_path, monkeypatch):
  # ``--rows random`` and ``--rows magnitude`` launched side by side each read the page when they
  # start; the one that finishes last must not drop the row the other wrote meanwhile.
  out_dir = ["--budget", "cpu", "--out", str(tmp_path)]

  def fake_train_row(method, n, m, budget, train_set, test_set, args, log_path=None):
    if method == "random":  # while this row trains, the other invocation finishes its row
      sdgp_table1.main(["--rows", "magnitude", *out_dir])
    return _table1_row(method, n, m)

  monkeypatch.setattr(sdgp_table1, "load_data", lambda args, budget: (None, None))
  monkeypatch.setattr(sdgp_table1, "train_row", fake_train_row)
  sdgp_table1.main(["--rows", "random", *out_dir])
  saved = json.loads((tmp_path / "table1_cpu.json").read_text())
  assert [r["method"] for r in saved["rows"]] == ["random", "magnitude"]
  page = (tmp_path / "table1_cpu.md").read_text()
  assert "Status: 2 of 5 rows done" in page
  assert "--rows random" in page and "--rows magnitude" in page  # each row's command


def _cell(method, n, m, accs, epoch_s=10.0):
  history = [
    {"epoch": e, "test_acc": a, "epoch_time_s": epoch_s} for e, a in enumerate(accs, start=1)
  ]
  return {"method": method, "n": n, "m": m, "history": history}


def test_time_to_accuracy_is_first_epoch_at_target_times_projected_epoch():
  cells = [
    _cell("dense", 1, 1, [0.5, 0.8, 0.9], epoch_s=10.0),
    _cell("rescaled_magnitude", 2, 4, [0.4, 0.7, 0.85], epoch_s=99.0),  # own time unused
    _cell("rescaled_magnitude", 1, 8, [0.3, 0.5, 0.6]),
  ]
  out = sdgp_timemodel.time_to_accuracy(cells, {(2, 4): 0.8, (1, 8): 0.7}, target=0.8)
  by = {(c["n"], c["m"]): c for c in out}
  assert by[(1, 1)]["epochs"] == 2 and by[(1, 1)]["tta_s"] == 20.0
  assert by[(2, 4)]["epochs"] == 3 and by[(2, 4)]["tta_s"] == pytest.approx(3 * 10.0 * 0.8)
  assert by[(1, 8)]["epochs"] is None and by[(1, 8)]["tta_s"] is None


def test_time_to_accuracy_needs_a_dense_cell_and_every_projection():
  sparse = _cell("rescaled_magnitude", 2, 4, [0.9])
  with pytest.raises(ValueError, match="cells"):
    sdgp_timemodel.time_to_accuracy([sparse], {(2, 4): 0.8}, target=0.5)
  with pytest.raises(ValueError, match="step_ratio"):
    sdgp_timemodel.time_to_accuracy([_cell("dense", 1, 1, [0.9]), sparse], {}, target=0.5)


def _kernels(model):
  return {p: c.kernel[...] for p, c in nnx.iter_modules(model) if isinstance(c, nnx.Conv)}


@pytest.mark.parametrize("budget", ["paper", "cpu"])
def test_table_rows_follow_the_released_init_of_the_budget(budget):
  chosen = budgets.get_budget("sdgp_table1", budget)
  assert chosen["init"] == "released"

  def fresh():
    return models.create("sdgp-resnet9", num_classes=10, rngs=nnx.Rngs(0), width_multiplier=0.125)

  before = _kernels(fresh())
  # Released: the dense row is a 4:4 conversion and every converted conv is drawn afresh
  # (all but the stem, whose input gradient nothing needs, so SDGP leaves it unconverted).
  dense = sdgp_table1.row_method("dense", 2, 4, dict(chosen), 0, "reference").convert(fresh())
  after = _kernels(dense)
  assert after.keys() == before.keys()
  unchanged = [p for p in before if bool((after[p] == before[p]).all())]
  assert unchanged == [("prep", "conv")]
  # The library default keeps every kernel bit for bit and leaves the dense row alone.
  kept = sdgp_table1.row_method("mvue", 2, 4, {**chosen, "init": "model"}, 0, "reference")
  after = _kernels(kept.convert(fresh()))
  assert all(bool((after[p] == before[p]).all()) for p in before)
  with pytest.raises(ValueError, match="init"):
    sdgp_table1.row_method("dense", 2, 4, {**chosen, "init": "kaiming"}, 0, "reference")


def test_table1_page_of_other_budget_settings_warns_once_and_is_replaced(tmp_path, monkeypatch):
  monkeypatch.setattr(sdgp_table1, "load_data", lambda args, budget: (None, None))
  monkeypatch.setattr(
    sdgp_table1, "train_row", lambda method, n, m, *_, **__: _table1_row(method, n, m)
  )
  stale = {"budget_name": "cpu", "budget": {"epochs": 1}, "rows": [{"method": "dense"}]}
  (tmp_path / "table1_cpu.json").write_text(json.dumps(stale))
  with pytest.warns(RuntimeWarning, match="other budget settings") as caught:
    sdgp_table1.main(["--budget", "cpu", "--rows", "random", "--out", str(tmp_path)])
  assert len([w for w in caught if "other budget settings" in str(w.message)]) == 1
  saved = json.loads((tmp_path / "table1_cpu.json").read_text())
  assert [r["method"] for r in saved["rows"]] == ["random"]  # the stale dense row is gone


def test_published_table1_page_is_rebuilt_from_its_json(tmp_path):
  """From the published JSON (its rows' log names included) the page code writes the published
  page again (the machine aside)."""
  import re
  from pathlib import Path

  results = Path(__file__).resolve().parents[2] / "experiments" / "results" / "sdgp"
  saved = json.loads((results / "table1_cpu.json").read_text())
  stem = tmp_path / "table1_cpu"
  rows, planned = saved["rows"], len(sdgp_table1.ROWS)
  sdgp_table1._write(stem, saved["command"], "cpu", saved["budget"], rows, planned, saved["date"])

  def stable(page):
    return [line for line in page.splitlines() if not re.match(r"- Machine:", line)]

  published = (results / "table1_cpu.md").read_text()
  assert stable(stem.with_suffix(".md").read_text()) == stable(published)
  assert "(logs/table1_cpu_resnet9_mvue_2-4.jsonl)" in published
