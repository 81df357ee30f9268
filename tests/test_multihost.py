"""Multi-host start-up settings: flags over environment, consistency checks, the no-op path."""

import argparse
import textwrap

import pytest

from jaxprune import multihost


def _parse(argv):
  return multihost.add_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_flags_are_parsed_and_take_precedence_over_the_environment():
  args = _parse(
    ["--coordinator-address", "10.0.0.1:99", "--num-processes", "4", "--process-id", "3"]
  )
  env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
  assert multihost.settings(args, env) == multihost.Settings("10.0.0.1:99", 4, 3, None)


def test_environment_fills_what_the_flags_leave_unset():
  env = {
    "JAX_COORDINATOR_ADDRESS": "h:1",
    "JAX_NUM_PROCESSES": "2",
    "JAX_PROCESS_ID": "1",
    "JAX_NUM_CPU_DEVICES": "2",
  }
  assert multihost.settings(_parse([]), env) == multihost.Settings("h:1", 2, 1, 2)
  assert multihost.settings(_parse(["--process-id", "0"]), env).process_id == 0


def test_nothing_set_is_one_process():
  assert multihost.settings(None, {}) == multihost.Settings(None, 1, 0, None)
  # A single process needs no coordinator and starts nothing.
  assert multihost.initialize({"num_processes": 1}, environ={}).num_processes == 1


@pytest.mark.parametrize(
  "given, match",
  [
    ({"num_processes": 2, "process_id": 2, "coordinator_address": "h:1"}, "process_id 2"),
    ({"num_processes": 2, "process_id": -1, "coordinator_address": "h:1"}, "process_id -1"),
    ({"num_processes": 1, "process_id": 1}, "process_id 1"),
    ({"num_processes": 0}, "num_processes must be at least 1"),
    ({"num_processes": 2, "coordinator_address": "h:1"}, "process_id is required"),
    ({"num_processes": 2, "process_id": 0}, "coordinator_address is required"),
    ({"num_processes": 2, "process_id": 0, "coordinator_address": "nohost"}, "host:port"),
    ({"num_processes": "two"}, "num_processes must be an int"),
    ({"num_processes": True}, "num_processes must be an int"),
    ({"num_cpu_devices": 0}, "num_cpu_devices must be at least 1"),
    ({"num_procs": 2}, "unknown keys"),
  ],
)
def test_inconsistent_settings_raise_naming_the_setting(given, match):
  with pytest.raises(ValueError, match=match):
    multihost.settings(given, {})


def test_environment_errors_name_the_variable():
  with pytest.raises(ValueError, match="JAX_PROCESS_ID"):
    multihost.settings(None, {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "5"})


def test_num_cpu_devices_is_applied_before_jax_starts(run_python):
  script = textwrap.dedent(
    """
    from jaxprune import multihost
    multihost.initialize()
    import jax
    print(jax.local_device_count(), jax.process_count())
    """
  )
  out = run_python(script, env={"JAX_NUM_CPU_DEVICES": "3"})
  assert out.returncode == 0, out.stderr
  assert out.stdout.split() == ["3", "1"]


def test_num_cpu_devices_after_jax_started_must_match():
  import jax

  have = len(jax.local_devices(backend="cpu"))
  assert multihost.initialize({"num_cpu_devices": have}, environ={}).num_cpu_devices == have
  with pytest.raises(ValueError, match=f"already started with {have} CPU devices"):
    multihost.initialize({"num_cpu_devices": have + 1}, environ={})
