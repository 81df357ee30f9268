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


def test_quickstart_page_says_where_its_settings_are_not_the_papers(tmp_path):
  from jaxprune import quickstart as settings

  # The PruneTrain row's settings, as the page states them (issue 61, item 8a).
  notes = settings.departures(15)
  assert notes[0].startswith(
    "PruneTrain: penalty ratio 0.9 and dead-channel threshold 0.01, not the paper's 0.2 and 0.0001"
  )
  config = settings.METHODS["prunetrain"][1](15)
  assert (config["penalty_ratio"], config["threshold"]) == (0.9, 1e-2)  # what the note says
  assert "not the paper's 0.2 and 1e-4" in settings.__doc__.replace("**", "")
  args = quickstart._parse(["--epochs", "15"])
  rows = [{"method": "dense", "test_acc": 0.5, "compression": 1.0, "train_time_s": 3.0}]
  page = quickstart.write_page(tmp_path, rows, "python -m experiments.run quickstart", args)
  text = page.read_text()
  for note in notes:
    assert f"- Not the papers' settings: {note}" in text
