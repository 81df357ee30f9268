"""Multi-host start-up: ``jax.distributed.initialize`` from command-line flags or the environment.

Every process of a multi-host run calls :func:`initialize` once, before any other JAX call; JAX's
own runtime then connects the processes (a coordinator service on process 0, Gloo collectives
between CPU hosts, NCCL between GPUs), so one ``jax.sharding.Mesh`` spans every device of every
process and a ``psum`` inside ``jax.shard_map`` reduces across hosts. No transport of our own.

Each setting comes from the flag, else from its environment variable, else its default:

==========================  ============================  =====================================
flag                        environment variable          meaning
==========================  ============================  =====================================
``--coordinator-address``   ``JAX_COORDINATOR_ADDRESS``   ``host:port`` of process 0's service
``--num-processes``         ``JAX_NUM_PROCESSES``         processes in the run (1: no-op)
``--process-id``            ``JAX_PROCESS_ID``            this process, in ``[0, num)``
``--num-cpu-devices``       ``JAX_NUM_CPU_DEVICES``       CPU devices per process (emulation)
==========================  ============================  =====================================

``JAX_COORDINATOR_ADDRESS`` and ``JAX_NUM_CPU_DEVICES`` are the names JAX itself reads; the other
two follow them.

Example (two processes on one machine, two CPU devices each, standing in for two hosts)::

  python -m experiments.run quickstart --coordinator-address 127.0.0.1:1234 \\
      --num-processes 2 --process-id 0 --num-cpu-devices 2 &
  python -m experiments.run quickstart --coordinator-address 127.0.0.1:1234 \\
      --num-processes 2 --process-id 1 --num-cpu-devices 2
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax

__all__ = ["ENVIRONMENT", "Settings", "add_arguments", "backends_started", "initialize", "settings"]

ENVIRONMENT = {
  "coordinator_address": "JAX_COORDINATOR_ADDRESS",
  "num_processes": "JAX_NUM_PROCESSES",
  "process_id": "JAX_PROCESS_ID",
  "num_cpu_devices": "JAX_NUM_CPU_DEVICES",
}

_FLAGS = {
  "coordinator_address": (str, "host:port of process 0's coordinator"),
  "num_processes": (int, "number of processes; 1 runs alone"),
  "process_id": (int, "this process's index in [0, num-processes)"),
  "num_cpu_devices": (int, "CPU devices this process emulates"),
}


class Settings(NamedTuple):
  """The resolved start-up settings (see :func:`settings`)."""

  coordinator_address: str | None
  num_processes: int
  process_id: int
  num_cpu_devices: int | None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
  """Adds the multi-host flags (an argument group) to ``parser``.

  Every flag defaults to ``None`` so that :func:`initialize` can fall back to the environment.

  Args:
    parser: the parser to extend.

  Returns:
    ``parser``, for chaining.

  Example:
    >>> import argparse
    >>> parser = add_arguments(argparse.ArgumentParser())
    >>> parser.parse_args(["--num-processes", "2", "--process-id", "1"]).process_id
    1
  """
  group = parser.add_argument_group("multi-host (jax.distributed)")
  for name, (kind, meaning) in _FLAGS.items():
    group.add_argument(
      "--" + name.replace("_", "-"),
      type=kind,
      default=None,
      help=f"{meaning} (env {ENVIRONMENT[name]})",
    )
  return parser


def backends_started() -> bool:
  """Whether JAX's backends (devices) already started in this process.

  From then on :func:`initialize` can no longer start ``jax.distributed`` or change the CPU device
  count.
  """
  from jax._src import xla_bridge  # JAX exposes this nowhere public

  return xla_bridge.backends_are_initialized()


def _int(value: Any, what: str, source: str) -> int:
  if isinstance(value, bool):
    raise ValueError(f"{what} must be an int, got {value!r} (from {source})")
  try:
    return int(value)
  except (TypeError, ValueError) as err:
    raise ValueError(f"{what} must be an int, got {value!r} (from {source})") from err


def settings(
  args: argparse.Namespace | Mapping[str, Any] | None = None,
  environ: Mapping[str, str] | None = None,
) -> Settings:
  """Resolves the start-up settings: flag, else environment variable, else default.

  Args:
    args: a namespace from a parser given :func:`add_arguments`, a mapping with the same keys
      (``coordinator_address``, ``num_processes``, ``process_id``, ``num_cpu_devices``), or
      None (environment only).
    environ: the environment to read (default ``os.environ``).

  Returns:
    :class:`Settings`; a single process (``num_processes`` 1, ``process_id`` 0) when nothing
    is set.

  Raises:
    ValueError: a value that is not an int; ``num_processes`` < 1; ``process_id`` outside
      ``[0, num_processes)``; several processes without a coordinator address (or an address
      without a port) or without a process id; ``num_cpu_devices`` < 1.
  """
  environ = os.environ if environ is None else environ
  given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
  unknown = set(given) - set(ENVIRONMENT)
  if isinstance(args, Mapping) and unknown:
    raise ValueError(f"args: unknown keys {sorted(unknown)}; expected {sorted(ENVIRONMENT)}")

  def lookup(name: str) -> tuple[Any, str]:
    flag = "--" + name.replace("_", "-")
    if given.get(name) is not None:
      return given[name], flag
    env = ENVIRONMENT[name]
    if environ.get(env, "") != "":
      return environ[env], f"environment variable {env}"
    return None, flag

  address, _ = lookup("coordinator_address")
  num, num_source = lookup("num_processes")
  pid, pid_source = lookup("process_id")
  devices, devices_source = lookup("num_cpu_devices")

  num = 1 if num is None else _int(num, "num_processes", num_source)
  if num < 1:
    raise ValueError(f"num_processes must be at least 1, got {num} (from {num_source})")
  if pid is None and num > 1:
    raise ValueError(f"process_id is required when num_processes is {num} (from {num_source})")
  pid = 0 if pid is None else _int(pid, "process_id", pid_source)
  if not 0 <= pid < num:
    raise ValueError(
      f"process_id {pid} (from {pid_source}) must lie in [0, num_processes) with "
      f"num_processes {num} (from {num_source})"
    )
  if num > 1:
    if not address:
      raise ValueError(
        f"coordinator_address is required when num_processes is {num}: pass "
        f"--coordinator-address host:port or set {ENVIRONMENT['coordinator_address']}"
      )
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit():
      raise ValueError(f"coordinator_address must be host:port, got {address!r}")
  if devices is not None:
    devices = _int(devices, "num_cpu_devices", devices_source)
    if devices < 1:
      raise ValueError(f"num_cpu_devices must be at least 1, got {devices} (from {devices_source})")
  return Settings(address or None, num, pid, devices)


def initialize(
  args: argparse.Namespace | Mapping[str, Any] | None = None,
  *,
  environ: Mapping[str, str] | None = None,
  initialization_timeout: int = 300,
) -> Settings:
  """Starts this process's part of a multi-host run (``jax.distributed.initialize``).

  Call it once, first thing, before any JAX computation or device query. With one process it
  only applies ``num_cpu_devices`` (if given) and starts nothing. With several, CPU
  collectives go through Gloo (JAX's cross-process CPU implementation), and
  ``jax.distributed.initialize`` connects to the coordinator; afterwards ``jax.devices()``
  lists every process's devices and ``jax.process_index()`` is ``process_id``.

  Args:
    args: flags parsed by a parser given :func:`add_arguments`, a mapping with the same
      keys, or None to read the environment only (see the module docstring for the names).
    environ: the environment to read (default ``os.environ``).
    initialization_timeout: seconds to wait for every process to join.

  Returns:
    The :class:`Settings` used.

  Raises:
    ValueError: inconsistent settings (see :func:`settings`), or a multi-process start after
      JAX's backends already started.

  Example:
    >>> from jaxprune import multihost
    >>> multihost.initialize({"num_processes": 1}).num_processes  # one process: a no-op
    1
  """
  resolved = settings(args, environ)
  if resolved.num_processes == 1 and resolved.num_cpu_devices is None:
    return resolved
  started = backends_started()
  if resolved.num_cpu_devices is not None:
    if started:
      have = len(jax.local_devices(backend="cpu"))
      if have != resolved.num_cpu_devices:
        raise ValueError(
          f"num_cpu_devices {resolved.num_cpu_devices}: JAX already started with {have} CPU "
          "devices (initialize must run before any JAX computation or device query)"
        )
    else:
      jax.config.update("jax_num_cpu_devices", resolved.num_cpu_devices)
  if resolved.num_processes == 1:
    return resolved
  if jax.distributed.is_initialized():
    if (jax.process_count(), jax.process_index()) != (resolved.num_processes, resolved.process_id):
      raise ValueError(
        f"jax.distributed is already initialized as process {jax.process_index()} of "
        f"{jax.process_count()}, not {resolved.process_id} of {resolved.num_processes}"
      )
    return resolved
  if started:
    raise ValueError(
      "initialize must run before any JAX computation or device query (JAX's backends "
      "already started in this process)"
    )
  # Gloo is JAX's cross-process collective implementation for CPU devices; without it a CPU
  # all-reduce cannot leave the process.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=resolved.coordinator_address,
    num_processes=resolved.num_processes,
    process_id=resolved.process_id,
    initialization_timeout=initialization_timeout,
  )
  return resolved
