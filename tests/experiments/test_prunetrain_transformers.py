"""The transformer rows' plumbing (experiments/prunetrain/transformers.py): the standard-library
text, the comparison the page states, and a short run of both trainings end to end."""

import json

import numpy as np
import pytest

from experiments.prunetrain import transformers as T
from experiments.prunetrain.transformers_page import write_page


def test_the_text_is_the_standard_library_with_every_tenth_file_held_out():
  files, root = T.stdlib_sources()
  assert files == sorted(files) and "os.py" in files
  assert not any(f.split("/")[0] in ("test", "site-packages", "idlelib") for f in files)
  train, val, described = T.stdlib_bytes(1 << 16)
  held = b"".join(open(f"{root}/{f}", "rb").read() for f in files[::10])
  assert val.tobytes() == held
  assert len(train) == described["train_bytes"] == 1 << 16
  first_train = open(f"{root}/{files[1]}", "rb").read()  # files[0] is held out
  assert train[: len(first_train)].tobytes() == first_train[: 1 << 16]


def test_windows_are_next_byte_targets():
  text = np.arange(1000, dtype=np.uint8)
  x, y = T._windows(text, np.array([0, 300]))
  assert x.shape == y.shape == (2, T._CONTEXT)
  np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
  assert int(y[1, -1]) == (300 + T._CONTEXT) % 256


def _records(losses, seconds, params, flops):
  return [
    {"val_loss": v, "train_seconds": t, "params": params, "flops": flops}
    for v, t in zip(losses, seconds)
  ]


def test_the_summary_compares_the_ends_and_the_time_to_dense_loss():
  runs = {
    "dense": {"records": _records([3.0, 2.0, 1.5], [10, 20, 30], 100, 1000.0)},
    "prunetrain": {"records": _records([3.1, 1.52, 1.49], [8, 14, 21], 55, 500.0)},
  }
  s = T.summary(runs)
  assert s["params_saved"] == pytest.approx(0.45)
  assert s["flops_saved"] == pytest.approx(0.5)
  assert s["val_loss_ratio"] == pytest.approx(1.49 / 1.5)
  assert s["time_to_dense_loss_ratio"] == pytest.approx(21 / 30)  # first record at <= 1.5
  runs["prunetrain"]["records"][-1]["val_loss"] = 1.6
  assert T.summary(runs)["time_to_dense_loss_ratio"] is None


def test_a_short_lm_row_trains_both_reconfigures_and_writes_its_page(tmp_path):
  args = T._parse(
    ["--rows", "lm", "--steps", "4", "--interval", "2", "--eval-every", "2"]
    + ["--val-windows", "4", "--threshold", "0.275", "--out", str(tmp_path)]
  )
  row = T._ROWS["lm"]
  train, val, _ = T.stdlib_bytes(1 << 15)
  # A threshold inside the MLP units' max|w| at init (truncated normal, 0.23-0.28; the heads' all
  # 0.284): about half the units die, every head stays
  runs = {
    m: T.train_run(row, m, T._LMData(train, val, 4, 0), args, 4) for m in ("dense", "prunetrain")
  }
  assert [r["step"] for r in runs["dense"]["records"]] == [2, 4]
  assert runs["dense"]["reconfigurations"] == []
  (rec,) = runs["prunetrain"]["reconfigurations"]
  assert rec["step"] == 2 and rec["params"][1] < rec["params"][0]
  last = runs["prunetrain"]["records"][-1]
  assert (
    last["params"] == rec["params"][1] and last["flops"] < runs["dense"]["records"][-1]["flops"]
  )
  assert all(np.isfinite(r["val_loss"]) for r in runs["prunetrain"]["records"])
  result = {
    "machine": "test",
    "rows": {
      "lm": {
        "date": "now",
        "command": "cmd",
        "settings": {
          **vars(row),
          "steps": 4,
          "model": T._LM,
          "interval": 2,
          "penalty_ratio": 0.2,
          "threshold": 0.275,
          "seed": 0,
          "data": {},
        },
        "runs": runs,
        "summary": T.summary(runs),
      }
    },
  }
  write_page(tmp_path / "transformers", result)
  page = (tmp_path / "transformers.md").read_text()
  assert "byte LM" in page and "| 2 |" in page
  assert (tmp_path / "transformers_loss.png").stat().st_size > 0
  assert json.loads((tmp_path / "transformers.json").read_text())["rows"]["lm"]["runs"]


def test_bad_arguments_are_refused_by_name():
  with pytest.raises(SystemExit):
    T._parse(["--rows", "cnn"])
  with pytest.raises(SystemExit):
    T._parse(["--penalty-ratio", "1.5"])


def test_a_run_at_other_settings_is_a_probe_named_by_them(tmp_path):
  """The default ratio at the rows' own steps writes the page; another ratio or --steps a
  probe under probes/, named by what differs."""
  stem = lambda argv: T.output_stem(tmp_path, T._parse(argv))  # noqa: E731
  assert stem([]) == tmp_path / "transformers"
  assert stem(["--penalty-ratio", "0.25"]) == tmp_path / "probes" / "transformers_r0.25"
  assert stem(["--steps", "4800"]) == tmp_path / "probes" / "transformers_s4800"
  assert stem(["--penalty-ratio", "0.3", "--steps", "60"]).name == "transformers_r0.3_s60"


def test_the_gap_readout_names_the_penalty_alone_and_dense_still_learning():
  """Hand-made records: the ratio before the first removal, after it and at the end; dense's
  last-quarter gain 1 - 1.5 / 2.0 = 25%."""
  from experiments.prunetrain.transformers_page import _gap_readout

  def recs(losses):
    return [{"step": 100 * (i + 1), "val_loss": v} for i, v in enumerate(losses)]

  row = {
    "runs": {
      "dense": {"records": recs([4.0, 3.0, 2.0, 1.5])},
      "prunetrain": {"records": recs([4.4, 3.3, 2.4, 1.8]), "reconfigurations": [{"step": 200}]},
    }
  }
  text = " ".join(_gap_readout(row))
  assert "×1.100 at step 200 (before the first removal: the penalty alone)" in text
  assert "×1.200 at step 300" in text and "×1.200 at step 400" in text
  assert "fell 25.0% from step 300" in text and "still learning" in text
