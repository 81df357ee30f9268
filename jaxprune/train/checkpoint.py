"""Checkpoints of a training run with orbax-checkpoint.

A checkpoint holds pytrees of arrays (model params and the rest of the model state
— batch statistics, RNG keys and counters —, optimizer state) plus a JSON record
(epoch, step, batch size, loader position, model width spec, history). Orbax writes
each checkpoint into a temporary directory and renames it when complete, so an
interrupted write leaves no directory that :meth:`CheckpointStore.latest_step`
returns (tested by interrupting a save).

Pytrees are stored as nested dicts keyed by their tree paths, and restored into the
structure of a template pytree (built from the current model and ``tx.init``), so
NNX ``State`` objects, Optax NamedTuple states and typed PRNG keys all round-trip.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import socket
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

try:  # POSIX: an flock is released by the system when its holder closes it or exits.
  import fcntl
except ImportError:  # pragma: no cover - Windows: folders are not held
  fcntl = None

import jax
import jax.numpy as jnp
import numpy as np

_ARRAYS = "arrays"
_META = "meta"


class DamagedCheckpointError(ValueError):
  """A checkpoint whose files cannot be read back (truncated, missing or corrupt).

  Attributes:
    step: the checkpoint's number.
    path: its directory.
    reason: what failed.
  """

  def __init__(self, step: int, path: str, reason: str):
    self.step, self.path, self.reason = step, path, reason
    super().__init__(f"checkpoint {step} at {path} is damaged ({reason})")


def _orbax() -> Any:
  """``orbax.checkpoint``, imported on first use.

  Importing orbax is slow and most uses of the library (transforms, FLOPs, models) never
  checkpoint, so ``import jaxprune`` leaves it out until a :class:`CheckpointStore` is built.
  """
  import orbax.checkpoint as ocp

  return ocp


_log = logging.getLogger(__name__)

# The file in a checkpoint folder that the live trainer writing there holds (CheckpointStore.hold).
LOCK_FILE = ".run.lock"


class FolderInUseError(ValueError):
  """A checkpoint folder is held by another live trainer (:meth:`CheckpointStore.hold`)."""


class _OrbaxToDebug(logging.Filter):
  """Moves orbax's own log records to this module's logger at DEBUG.

  Orbax logs ``ERROR:absl:Failed to json parse ...`` for a damaged file it can do without
  (its ``_CHECKPOINT_METADATA``) and for files whose failure the store reports itself as a
  :class:`DamagedCheckpointError` (and the trainer as one warning naming the checkpoint):
  in a user's log they only repeat, or contradict, that message. Debug logging shows them.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    if f"{os.sep}orbax{os.sep}" not in record.pathname:
      return True
    _log.debug("orbax: %s", record.getMessage())
    return False


def _quiet_orbax(method: Callable) -> Callable:
  """Runs a :class:`CheckpointStore` method with :class:`_OrbaxToDebug` on absl's logger."""

  @functools.wraps(method)
  def wrapped(*args, **kwargs):
    logger, only = logging.getLogger("absl"), _OrbaxToDebug()
    logger.addFilter(only)
    try:
      return method(*args, **kwargs)
    finally:
      logger.removeFilter(only)

  return wrapped


def _drop_late_read_callbacks() -> None:
  """Keeps the noise of a failed read out of the user's stderr.

  When one array of a damaged checkpoint fails to read, orbax closes the event loop of the
  read while the storage threads still finish the other arrays; each then reports into the
  closed loop, which Python prints as an ignored ``RuntimeError: Event loop is closed``. The
  damage is already named (:class:`DamagedCheckpointError`), so from the first failed read on,
  exactly these reports go to this module's debug log; every other unraisable exception still
  reaches the hook that was installed before.
  """
  previous = sys.unraisablehook
  if getattr(previous, "_drops_late_read_callbacks", False):
    return

  def hook(unraisable: Any) -> None:
    exc = unraisable.exc_value
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
      _log.debug("a read of a damaged checkpoint finished after its event loop closed")
      return
    previous(unraisable)

  hook._drops_late_read_callbacks = True
  sys.unraisablehook = hook


def _try_lock(fd: int) -> bool:
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    return False
  return True


def _read_holder(fd: int) -> str:
  """Who holds a lock file, from what it wrote into it."""
  try:
    holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
  except ValueError:
    holder = {}
  pid, host = holder.get("pid"), holder.get("host")
  if pid == os.getpid() and host == socket.gethostname():
    return "in this process"
  return f"process {pid} on {host}" if pid else "another process"


def _path_entry_name(entry: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(entry, attr):
      return str(getattr(entry, attr))
  return str(entry)


def _is_prng_key(x: Any) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _storable(x: Any) -> Any:
  # Orbax stores plain numeric arrays; typed PRNG keys are saved as their raw key data.
  return jax.random.key_data(x) if _is_prng_key(x) else x


def _to_nested(tree: Any) -> dict[str, Any]:
  nested: dict[str, Any] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    node = nested
    names = [_path_entry_name(e) for e in path] or ["_"]
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = leaf
  return nested


def _lookup(nested: dict[str, Any], path: tuple) -> Any:
  node = nested
  for name in [_path_entry_name(e) for e in path] or ["_"]:
    node = node[name]
  return node


class CheckpointStore:
  """A directory of numbered checkpoints (orbax ``CheckpointManager``, synchronous).

  Args:
    directory: where checkpoints live (created if missing).
    max_to_keep: number of most recent checkpoints kept (``None`` = all).

  Example:
    >>> store = CheckpointStore("/tmp/run/ckpt")          # doctest: +SKIP
    >>> store.save(3, {"params": params}, {"epoch": 3})   # doctest: +SKIP
    >>> arrays, meta = store.restore(3, {"params": params})  # doctest: +SKIP
  """

  @_quiet_orbax
  def __init__(self, directory: str | os.PathLike, max_to_keep: int | None = 2):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    self.directory = os.path.abspath(os.fspath(directory))
    ocp = _orbax()
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
    )
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._hold: int | None = None  # the lock file's descriptor while this store holds it

  def hold(self) -> None:
    """Takes the folder for this store's run until :meth:`release`.

    Or until the store is garbage collected, or its process ends.

    A folder belongs to one run: two live trainers writing checkpoints into one folder
    would each resume the other's latest epoch and silently become one run. The hold is an
    exclusive ``flock`` on :data:`LOCK_FILE`, so the system drops it when its process ends:
    a restarted process resumes the folder as before. On several processes (multi-host)
    only process 0 holds it, as every process writes the same checkpoints.

    Raises:
      FolderInUseError: another live store (in this process or another) holds the folder;
        the message names its process.
    """
    if self._hold is not None or fcntl is None or jax.process_index() != 0:
      return
    fd = os.open(os.path.join(self.directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    if not _try_lock(fd):
      gc.collect()  # a trainer that only a reference cycle keeps is no longer live
      if not _try_lock(fd):
        holder = _read_holder(fd)
        os.close(fd)
        raise FolderInUseError(
          f"checkpoint_dir {self.directory} is in use by another live Trainer ({holder}): a "
          "folder belongs to one run, and two trainers on it would each resume the other's "
          "checkpoints. Close that trainer first (Trainer.close(), or let it go), or use "
          "another checkpoint_dir"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    self._hold = fd
    self._release_at_collection = weakref.finalize(self, os.close, fd)

  def release(self) -> None:
    """Lets the folder go (:meth:`hold`); a later :meth:`hold` takes it again."""
    if self._hold is not None:
      self._release_at_collection()  # closes the descriptor, which drops the flock
      self._hold = None

  @_quiet_orbax
  def all_steps(self) -> list[int]:
    """Steps of the complete checkpoints, ascending."""
    self._manager.reload()
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """Step of the newest complete checkpoint, or ``None``."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  @_quiet_orbax
  def clear(self) -> None:
    """Delete every checkpoint of the directory."""
    for step in self.all_steps():
      self._manager.delete(step)
    self._manager.reload()

  @_quiet_orbax
  def save(self, step: int, arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """Write checkpoint ``step`` (blocks until it is complete and renamed into place)."""
    ocp = _orbax()
    stored = jax.tree.map(_storable, _to_nested(arrays))
    self._manager.save(
      step,
      args=ocp.args.Composite(
        **{_ARRAYS: ocp.args.StandardSave(stored), _META: ocp.args.JsonSave(meta)}
      ),
      force=True,
    )
    self._manager.wait_until_finished()

  def step_path(self, step: int) -> str:
    """Directory of checkpoint ``step``."""
    return os.path.join(self.directory, str(step))

  def _item_path(self, step: int, item: str) -> Any:
    return self._manager.directory / str(step) / item

  @contextlib.contextmanager
  def _reading(self, step: int) -> Iterator[None]:
    """Report a failure to read checkpoint ``step``'s files (a bare ``JSONDecodeError``
    for a truncated record, ``KeyError`` for a missing item, ...) as that checkpoint's
    damage, with its step and path."""
    try:
      yield
    except Exception as e:
      _drop_late_read_callbacks()
      raise DamagedCheckpointError(step, self.step_path(step), f"{type(e).__name__}: {e}") from e

  @_quiet_orbax
  def set_aside(self, step: int) -> str:
    """Rename damaged checkpoint ``step`` to ``<step>.damaged``; returns the path.

    It is kept for inspection, no longer a numbered checkpoint, so its number can be written again.
    """
    target = base = self.step_path(step) + ".damaged"
    n = 1
    while os.path.exists(target):
      target, n = f"{base}.{n}", n + 1
    os.rename(self.step_path(step), target)
    self._manager.reload()
    return target

  @_quiet_orbax
  def restore_meta(self, step: int) -> dict[str, Any]:
    """The JSON record of checkpoint ``step``.

    Raises:
      DamagedCheckpointError: if the record cannot be read back.
    """
    ocp = _orbax()
    with self._reading(step):
      restored = self._manager.restore(
        step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
      )
      return dict(restored[_META])

  @_quiet_orbax
  def restore(self, step: int, template: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Restore checkpoint ``step`` into the structure of ``template``.

    Args:
      step: checkpoint number.
      template: pytrees (concrete or ``ShapeDtypeStruct``) with the saved structure and
        shapes, e.g. built from a freshly constructed model and ``tx.init``.

    Returns:
      ``(arrays, meta)``: pytrees shaped like ``template`` and the JSON record.

    Raises:
      ValueError: if a saved array's shape differs from the template's, or the template
        has arrays the checkpoint lacks or the other way round (the model was
        reconfigured: rebuild it from ``meta["model_spec"]`` first).
      DamagedCheckpointError: if the checkpoint's own files cannot be read back.
    """
    ocp = _orbax()
    # Read the checkpoint into the shapes it recorded, not the template's: a failure here is
    # then the checkpoint's own damage, told apart from a template that does not fit it.
    with self._reading(step):
      recorded = ocp.StandardCheckpointHandler().metadata(self._item_path(step, _ARRAYS)).tree
      # A device this process can address: on several hosts jax.devices()[0] belongs to
      # process 0 only, and every process reads the whole (replicated) state.
      sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
      abstract = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), recorded
      )
      restored = self._manager.restore(
        step,
        args=ocp.args.Composite(
          **{_ARRAYS: ocp.args.StandardRestore(abstract), _META: ocp.args.JsonRestore()}
        ),
      )
    stored = restored[_ARRAYS]
    have = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored)}
    want_paths = {
      jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(_to_nested(template))
    }
    if have != want_paths:
      raise ValueError(
        f"template: arrays differ from checkpoint {step}'s: not in the checkpoint "
        f"{sorted(want_paths - have)}, not in the template {sorted(have - want_paths)}"
      )

    def fill(path, like):
      value = _lookup(stored, path)
      want = jax.eval_shape(_storable, like) if _is_prng_key(like) else like
      if tuple(np.shape(value)) != tuple(np.shape(want)):
        raise ValueError(
          f"template: shape of {jax.tree_util.keystr(path)} is "
          f"{np.shape(want)} but the checkpoint has {np.shape(value)}"
        )
      # Host memory, not a device array: the caller places (or replicates across hosts) it.
      value = np.asarray(value, dtype=want.dtype)
      if _is_prng_key(like):
        return jax.random.wrap_key_data(value, impl=jax.random.key_impl(like))
      return value

    arrays = jax.tree_util.tree_map_with_path(fill, template)
    return arrays, dict(restored[_META])
