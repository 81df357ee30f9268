"""experiments.run: the one entry point takes the multi-host flags out for every experiment."""

from experiments import run as run_module


def test_multihost_flags_start_jax_distributed_and_the_rest_reaches_the_experiment(monkeypatch):
  started, received = [], []
  monkeypatch.setattr(run_module.multihost, "initialize", started.append)
  monkeypatch.setattr(run_module, "load", lambda name: received.append(name) or received.append)
  argv = ["quickstart", "--epochs", "2", "--num-processes", "2", "--process-id", "1"]
  argv += ["--coordinator-address", "127.0.0.1:5", "--out", "x"]
  assert run_module.main(argv) == 0
  assert received == ["quickstart", ["--epochs", "2", "--out", "x"]]
  (flags,) = started
  assert (flags.num_processes, flags.process_id, flags.coordinator_address) == (2, 1, "127.0.0.1:5")


def test_flags_are_not_abbreviated():
  flags, rest = run_module.split_multihost(["x", "--process", "3", "--num", "1"])
  assert rest == ["x", "--process", "3", "--num", "1"]
  assert flags.process_id is None and flags.num_processes is None


def test_inconsistent_multihost_flags_exit_with_the_error(capsys):
  assert run_module.main(["quickstart", "--num-processes", "2", "--process-id", "2"]) == 2
  assert "process_id 2" in capsys.readouterr().err
