"""The quickstart command: its arguments and its table."""

import pytest

from experiments.benchmarks import quickstart


def test_quickstart_rejects_unknown_method_and_formats_rows():
  with pytest.raises(SystemExit):
    quickstart._parse(["--methods", "dense,no_such_method"])
  assert "dense" in quickstart.METHODS
  table = quickstart.format_table(
    [{"method": "dense", "test_acc": 0.5, "compression": 1.0, "train_time_s": 3.0}]
  )
  assert "| dense | 50.00% | 1.00x | 3.0 |" in table.splitlines()


def test_quickstart_seeds_add_each_methods_min_max():
  assert quickstart._parse(["--seeds", "0,1,2"]).seed_list == [0, 1, 2]
  assert quickstart._parse(["--seed", "4"]).seed_list == [4]
  for bad in ("0,x", "1,1"):
    with pytest.raises(SystemExit):
      quickstart._parse(["--seeds", bad])
  rows = [
    {"method": "dense", "test_acc": acc, "compression": 1.0, "train_time_s": 3.0}
    for acc in (0.97, 0.9555, 0.99)
  ] + [
    {"method": "clicktrain", "test_acc": 0.5, "compression": c, "train_time_s": 1.0}
    for c in (2.0, 1.5, 2.25)
  ]
  lines = quickstart.format_table(rows).splitlines()
  assert lines[0].endswith("| test acc, 3 seeds | compression, 3 seeds |")
  # the first seed's run, then min–max over the seeds
  assert "| dense | 97.00% | 1.00x | 3.0 | 95.55–99.00% | 1.00–1.00x |" in lines
  assert "| clicktrain | 50.00% | 2.00x | 1.0 | 50.00–50.00% | 1.50–2.25x |" in lines
