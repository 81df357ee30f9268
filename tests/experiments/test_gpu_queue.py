"""gpu_queue: the plan from the time model, a run of the queue over stand-in table commands
(bundle, device report, a failing row), and publishing a returned bundle."""

from __future__ import annotations

import dataclasses
import json
import tarfile

import pytest

from experiments.common import budgets, pages
from experiments.gpu import queue as gpu_queue
from jaxprune import data


def test_estimate_by_hand():
  row = gpu_queue.QUEUE[0]  # ClickTrain VGG-11 dense: 190 x 390 steps
  steps = 190 * 390 * row.step_ms / 1000
  evals = 19 * gpu_queue.EVAL_S
  want = row.compile_s + steps + evals + 190 * gpu_queue.EPOCH_OVERHEAD_S
  assert row.estimate_s() == pytest.approx(want)
  assert row.estimate_s(2.0) == pytest.approx(want + steps + evals)


def test_plan_skips_published_rows_and_those_that_do_not_fit(tmp_path):
  (tmp_path / "clicktrain").mkdir()
  (tmp_path / "clicktrain" / "table1_paper_vgg11_dense.json").write_text("{}")
  (tmp_path / "sdgp").mkdir()
  rows = {"budget_name": "paper", "rows": [{"method": "dense"}]}
  (tmp_path / "sdgp" / "table1_paper.json").write_text(json.dumps(rows))
  by_name = {r.name: r for r in gpu_queue.QUEUE}
  # Planted step times: 100, 340, 200 and 150 s of steps (plus compile and per-epoch costs).
  steps = {"clicktrain-vgg11": 100, "sdgp-table1-mvue": 340, "sdgp-table1-magnitude": 200}
  steps["clicktrain-vgg13-dense"] = 150
  rows = [by_name["clicktrain-vgg11-dense"], by_name["sdgp-table1-dense"]]
  for name, seconds in steps.items():
    row = by_name[name]
    rows.append(
      dataclasses.replace(row, step_ms=1000 * seconds / (row.epochs * row.steps_per_epoch))
    )
  decisions = [(r.name, d) for r, d, _ in gpu_queue.plan(rows, tmp_path, 500)]
  est = {r.name: r.estimate_s() for r in rows}
  # 480 s after start-up: ClickTrain VGG-11 leaves 480 - est; mvue no longer fits, magnitude
  # does, and the VGG-13 row does not fit what magnitude leaves.
  left = 500 - gpu_queue.START_S - est["clicktrain-vgg11"]
  assert est["sdgp-table1-mvue"] > left >= est["sdgp-table1-magnitude"]
  assert left - est["sdgp-table1-magnitude"] < est["clicktrain-vgg13-dense"]
  assert decisions == [
    ("clicktrain-vgg11-dense", "published"),
    ("sdgp-table1-dense", "published"),
    ("clicktrain-vgg11", "run"),
    ("sdgp-table1-mvue", "too long"),
    ("sdgp-table1-magnitude", "run"),
    ("clicktrain-vgg13-dense", "too long"),
  ]


def _history(epochs, steps, first, later, eval_s):
  return [
    {
      "epoch": e + 1,
      "steps": steps,
      "epoch_time_s": first if e == 0 else later,
      "data_wait_s": 0.0,
      "train_loss": 1.0,
      **({"eval_time_s": eval_s, "test_acc": 0.5} if (e + 1) % 10 == 0 or e + 1 == epochs else {}),
    }
    for e in range(epochs)
  ]


def _fake_tables(calls):
  def table(name):
    def main(argv):
      calls.append((name, argv))
      out = argv[argv.index("--out") + 1]
      from pathlib import Path

      folder = Path(out)
      folder.mkdir(parents=True, exist_ok=True)
      if "clicktrain" in argv:
        raise RuntimeError("planted failure")
      history = _history(190, 390, 12.0, 1.0, 0.5)
      for record in history:  # a table whose records keep no step count (SDGP's)
        del record["steps"]
      run = {"test_acc": 0.9, "command": "c", "history": history}
      (folder / "table1_paper_vgg11_dense.json").write_text(json.dumps(run))
      (folder / "logs").mkdir(exist_ok=True)
      (folder / "logs" / "table1_paper_vgg11_dense.jsonl").write_text("{}\n")
      (folder / "checkpoints").mkdir(exist_ok=True)
      (folder / "checkpoints" / "big").write_text("x")
      return {"vgg11": {"dense": run}}

    return main

  return table


def test_queue_runs_rows_reports_and_bundles(tmp_path, monkeypatch):
  monkeypatch.setattr(data, "load", lambda *a, **k: None)
  monkeypatch.setattr(pages, "RESULTS", tmp_path / "results")
  calls = []
  args = gpu_queue._parse(
    [
      "--out", str(tmp_path / "out"),
      "--bundle", str(tmp_path / "b.tar.gz"),
      "--only", "clicktrain-vgg11-dense,clicktrain-vgg11,clicktrain-resnet32",
      "--max-seconds", "700",
    ]
  )  # fmt: skip
  report = gpu_queue.run_queue(args, "cmd", tables=_fake_tables(calls))
  status = [r["status"] for r in report["rows"]]
  assert status[0] == "done" and status[1] == "error" and status[2].startswith("too long")
  assert "planted failure" in report["rows"][1]["error"]
  first = calls[0][1]
  assert first[:4] == ["--rows", "vgg11", "--methods", "dense"]
  assert "--must-finish" in first and first[first.index("--budget") + 1] == "paper"
  measured = report["rows"][0]["measured"]
  # Median epoch 1 s over 390 steps; the first epoch's 11 s excess is compilation.
  assert measured["step_ms"] == pytest.approx(1000 / 390)
  assert measured["compile_s"] == pytest.approx(11.0) and measured["eval_s"] == 0.5
  with tarfile.open(tmp_path / "b.tar.gz") as tar:
    names = set(tar.getnames())
  assert "clicktrain/table1_paper_vgg11_dense.json" in names
  assert "device_report.md" in names and not any("checkpoints" in n for n in names)
  page = (tmp_path / "out" / "device_report.md").read_text()
  assert "| clicktrain-vgg11 | error |" in page and "planted failure" in page


def test_publish_merges_returned_rows_beside_the_papers(tmp_path):
  returned = tmp_path / "returned"
  results = tmp_path / "results"
  (results / "benchmarks").mkdir(parents=True)
  folder = returned / "clicktrain"
  (folder / "logs").mkdir(parents=True)
  run = {
    "row": "vgg11",
    "method": "dense",
    "test_acc": 0.9123,
    "compression": 1.0,
    "command": "python -m experiments.run clicktrain_table1 --budget paper",
    "machine": "an accelerator",
    "date": "2026-11-27 10:00 UTC",
    "log": "logs/table1_paper_vgg11_dense.jsonl",
    "history": [{"epoch": 1, "test_acc": 0.9123}],
  }
  (folder / "table1_paper_vgg11_dense.json").write_text(json.dumps(run))
  (folder / "logs" / "table1_paper_vgg11_dense.jsonl").write_text("{}\n")
  (folder / "logs" / "table1_paper_vgg11_clicktrain.jsonl").write_text("{}\n")  # stopped run
  sdgp_rows = {
    "budget_name": "paper",
    "budget": dict(budgets.get_budget("sdgp_table1", "paper")),
    "rows": [
      {
        "method": "mvue",
        "n": 2,
        "m": 4,
        "test_acc": 0.95,
        "final_train_loss": 0.5,
        "train_time_s": 300.0,
        "command": "c2",
        "date": "2026-11-27 10:05 UTC",
        "machine": "an accelerator",
      }
    ],
  }
  (returned / "sdgp").mkdir()
  (returned / "sdgp" / "table1_paper.json").write_text(json.dumps(sdgp_rows))
  (returned / "device_report.md").write_text("# report\n")
  (returned / "device_report.json").write_text("{}")
  written = gpu_queue.publish(returned, results)
  page = (results / "clicktrain" / "table1_paper.md").read_text()
  assert "| vgg11 dense | 92.1 | 91.23 |" in page
  assert "- Machine: an accelerator" in page and "2026-11-27 10:00 UTC" in page
  assert (results / "clicktrain" / "logs" / "table1_paper_vgg11_dense.jsonl").exists()
  assert not (results / "clicktrain" / "logs" / "table1_paper_vgg11_clicktrain.jsonl").exists()
  sdgp_page = (results / "sdgp" / "table1_paper.md").read_text()
  assert "| MVUE 2:4 (not in paper) | — | 95.00 |" in sdgp_page
  assert str(results / "benchmarks" / "gpu_queue_report.md") in written


def test_dry_run_prints_the_plan(capsys):
  out = gpu_queue.main(["--dry-run", "--max-seconds", "300"])
  assert out["plan"][0][0] == "clicktrain-vgg11-dense"
  assert "plan for 300 s" in capsys.readouterr().out


def test_unknown_row_is_named():
  with pytest.raises(ValueError, match="--only: unknown rows"):
    gpu_queue._selected("nope")
