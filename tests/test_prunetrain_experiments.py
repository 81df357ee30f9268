"""PruneTrain experiment plumbing: reusing an earlier run's dense row, the speed options."""

import json

import pytest

from experiments import prunetrain_speed, prunetrain_table1


def _write_earlier(path, args, dense):
  earlier = {"args": {k: getattr(args, k) for k in prunetrain_table1._DENSE_SETTINGS}}
  earlier["args"]["penalty_ratio"] = 0.99  # a PruneTrain setting: must not matter
  earlier["runs"] = {"dense": dense, "prunetrain": {"test_acc": 0.1}}
  path.write_text(json.dumps(earlier))


def test_reuse_dense_returns_the_dense_run_of_a_matching_json(tmp_path):
  path = tmp_path / "earlier.json"
  args = prunetrain_table1._parse(
    ["--budget", "--penalty-ratio", "0.5", "--skip-dense", "--reuse-dense", str(path)]
  )
  dense = {"test_acc": 0.567, "train_time_s": 840.0}
  _write_earlier(path, args, dense)
  assert prunetrain_table1._reused_dense_run(args, "any_name") == dense


def test_reuse_dense_default_json_is_the_name_without_suffix(tmp_path, monkeypatch):
  monkeypatch.setattr(prunetrain_table1, "RESULTS", tmp_path)
  args = prunetrain_table1._parse(
    ["--budget", "--skip-dense", "--reuse-dense", "--name-suffix", "_sweep"]
  )
  dense = {"test_acc": 0.5}
  _write_earlier(tmp_path / "prunetrain_table1_resnet32_budget.json", args, dense)
  run = prunetrain_table1._reused_dense_run(args, "prunetrain_table1_resnet32_budget_sweep")
  assert run == dense


def test_reuse_dense_rejects_other_dense_settings(tmp_path):
  path = tmp_path / "earlier.json"
  args = prunetrain_table1._parse(["--budget", "--skip-dense", "--reuse-dense", str(path)])
  _write_earlier(path, args, {"test_acc": 0.5})
  args.lr = args.lr * 2
  args.milestones = [0.5]
  with pytest.raises(ValueError, match=r"--reuse-dense: .* other lr, milestones"):
    prunetrain_table1._reused_dense_run(args, "any_name")


def test_reuse_dense_without_skip_dense_is_an_error(tmp_path):
  with pytest.raises(SystemExit):
    prunetrain_table1._parse(["--budget", "--reuse-dense", str(tmp_path / "x.json")])
  args = prunetrain_table1._parse(["--budget"])
  assert prunetrain_table1._reused_dense_run(args, "any_name") is None


def test_speed_options():
  args = prunetrain_speed._parse(["--keep", "--run", "a.json", "--name-suffix", "_x"])
  assert args.keep == [] and args.run == ["a.json"] and args.name_suffix == "_x"
  assert prunetrain_speed._parse([]).keep == [0.75, 0.5, 0.25]
  for bad in (["--keep"], ["--keep", "0"], ["--keep", "1.5"]):
    with pytest.raises(SystemExit):
      prunetrain_speed._parse(bad)
