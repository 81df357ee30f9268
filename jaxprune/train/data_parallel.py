"""Data-parallel train and eval steps: the global batch split over a mesh axis ``"batch"``.

Parameters, the rest of the model state and the optimizer state are replicated on every
device; each device runs the one train step, :func:`jaxprune.train.step.train_step` with
``axis_name="batch"``, on its shard of the global batch inside a ``jax.shard_map``, and the
gradients are averaged explicitly by :func:`jaxprune.distributed.allreduce_gradients`. With
``indices`` (from :func:`jaxprune.distributed.mask_indices` of final masks, e.g. after
ClickTrain's hard prune) only the kept entries are reduced (ClickTrain §5.3); pruned
gradients reach the optimizer as zeros, which is what ClickTrain's masking gives them on one
device too. The same step runs under ``jax.pmap`` (see :func:`~jaxprune.train.step.train_step`).

BatchNorm statistics:

* **per device** (default, as PyTorch data parallelism without SyncBatchNorm, which the
  papers' code used): each device normalises its shard with the shard's own batch
  statistics; the running statistics each device updates are then **averaged over the
  devices** (``pmean``), so they stay replicated. (PyTorch's DDP instead broadcasts rank 0's
  buffers; the average uses every shard.) A step then differs from the single-device step on
  the same global batch by design: it equals the mean over devices of single-device steps on
  each shard (for the loss and gradients) — see the tests.
* **synchronised** (``sync_batchnorm=True``): the batch moments are ``pmean``-ed across the
  devices inside each BatchNorm (Flax's ``axis_name``), so each device normalises with the
  global batch's statistics and the step equals the single-device step.

Evaluation uses the (replicated) running statistics in eval mode, on each device's shard
of the evaluation batch; only the metric sums are reduced.

Random streams: every device holds the same keys. ``nnx.Rngs`` keys (dropout) are folded
with the device's axis index for the step and restored after it (their counters advance as
on one device); random layers that read :func:`jaxprune.distributed.device_key` (SDGP's
random methods) fold it into each draw. Draws thus differ across devices and are
reproducible from the seed.

Recompilation: a new step is built (and compiled at its first call) when the model's
structure changes (PruneTrain's reconfiguration) or the reduction's index arrays change
(dense → sparse at ClickTrain's hard prune, new masks on resume).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxprune.train.batchnorm import batchnorm_layers
from jaxprune.train.step import StepFunctions, StepSettings, fused_train_steps

__all__ = [
  "BATCH_AXIS",
  "DataParallelSteps",
  "make_mesh",
  "resolve_mesh",
  "rng_key_leaves",
  "train_graphdef",
]

BATCH_AXIS = "batch"


def make_mesh(devices: Any = None) -> Mesh:
  """A 1-D mesh with axis ``"batch"`` over ``devices``.

  Default: every device, ``jax.devices()``, which after ``jax.distributed.initialize`` spans all
  processes.
  """
  devices = jax.devices() if devices is None else list(devices)
  _check_distinct(devices)
  return Mesh(np.asarray(devices), (BATCH_AXIS,))


def _check_distinct(devices: Any) -> None:
  """A device listed twice would get two shards of one array (JAX fails later, inside
  sharding, with an unrelated ``safe_zip`` message): name it here."""
  seen = collections.Counter(devices)
  twice = [str(d) for d, n in seen.items() if n > 1]
  if twice:
    raise ValueError(
      f"mesh: every device must appear once, but {', '.join(twice)} appear(s) more than once "
      f"among its {seen.total()} devices"
    )


def resolve_mesh(mesh: Mesh | str | None) -> Mesh | None:
  """The mesh of a ``mesh`` argument.

  ``None`` → ``None`` (one device); ``"auto"`` → :func:`make_mesh`; a ``Mesh`` with a ``"batch"``
  axis → itself.

  Raises:
    ValueError: any other value, or a mesh without a ``"batch"`` axis.
  """
  if mesh is None:
    return None
  if isinstance(mesh, str):
    if mesh != "auto":
      raise ValueError(f"mesh must be None, 'auto' or a jax.sharding.Mesh, got {mesh!r}")
    return make_mesh()
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh must be None, 'auto' or a jax.sharding.Mesh, got {mesh!r}")
  if BATCH_AXIS not in mesh.axis_names:
    raise ValueError(
      f"mesh must have an axis named {BATCH_AXIS!r} to split the batch over, got axes "
      f"{mesh.axis_names}"
    )
  _check_distinct(mesh.devices.flat)
  return mesh


def train_graphdef(model: nnx.Module, axis_name: Any = None) -> nnx.GraphDef:
  """The train-mode graphdef of ``model``.

  With ``axis_name`` every BatchNorm reduces its batch moments over that axis (synchronised
  statistics). ``model`` is left as it was.
  """
  bns = batchnorm_layers(model) if axis_name is not None else []
  saved = [bn.axis_name for bn in bns]
  try:
    for bn in bns:
      bn.axis_name = axis_name
    model.train()
    return nnx.graphdef(model)
  finally:
    for bn, name in zip(bns, saved):
      bn.axis_name = name


def rng_key_leaves(model: nnx.Module) -> tuple[bool, ...]:
  """Per leaf of the model's non-param state: is it an ``nnx.RngKey``?

  The non-param state is ``nnx.split(model, nnx.Param, ...)``'s third part; an ``nnx.RngKey`` is a
  random stream's constant key.
  """
  _, _, rest = nnx.split(model, nnx.Param, ...)
  leaves = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return tuple(isinstance(v, nnx.RngKey) for v in leaves)


class _GlobalBatchStep:
  """The jitted step, called with process-local batch arrays that it turns into global ones
  (``jax.make_array_from_process_local_data``); ``lower`` takes global shapes."""

  def __init__(
    self, jitted: Callable[..., Any], sharding: NamedSharding, local_devices: int, batch_args: int
  ):
    self._jitted = jitted
    self._sharding = sharding
    self._local_devices = local_devices
    self._batch_args = batch_args  # the trailing arguments that are batch arrays

  def lower(self, *args: Any) -> Any:
    return self._jitted.lower(*args)

  def __call__(self, *args: Any) -> Any:
    state, batch = args[: -self._batch_args], args[-self._batch_args :]
    return self._jitted(*state, *(self._global(x) for x in batch))

  def _global(self, x: Any) -> jax.Array:
    if isinstance(x, jax.Array) and x.sharding == self._sharding:
      return x
    on_device = isinstance(x, jax.Array) and x.is_fully_addressable
    if not on_device:
      x = np.asarray(x)
    _check_divisible(x.shape[0], self._local_devices)
    if on_device and self._sharding.is_fully_addressable:
      # A batch already on the device (a DeviceLoader's): resharded there, not via the host.
      return jax.device_put(x, self._sharding)
    return jax.make_array_from_process_local_data(self._sharding, np.asarray(x))


def _check_divisible(size: int, devices: int) -> None:
  """A batch of ``size`` examples must split evenly over ``devices`` (this process's, on
  several processes)."""
  if size % devices:
    where = " on this process" if jax.process_count() > 1 else ""
    raise ValueError(
      f"batch size {size} is not divisible by the {devices} devices it is split over (mesh "
      f"axis {BATCH_AXIS!r}{where})"
    )


class DataParallelSteps(StepFunctions):
  """:class:`~jaxprune.train.StepFunctions` over ``settings.mesh``'s ``"batch"`` axis.

  ``train(state, images, labels)`` and ``evaluate(params, rest, metrics, images, labels,
  weights)`` take replicated states (:meth:`replicate`) and each process's local part of the
  global batch (the whole batch on one process), whose size must be divisible by the
  process's devices on the mesh. Each compiled step is a ``jax.jit`` of a ``jax.shard_map`` of
  :func:`jaxprune.train.step.train_step` / :func:`jaxprune.train.step.eval_step` with
  ``axis_name="batch"``. Build it with :func:`jaxprune.train.step_functions` (cached on the
  settings: the same structure, optimizer, loss, mesh and index arrays reuse the compiled
  executables, e.g. a resumed run in the same process).

  Example:
    >>> steps = train.step_functions(train.step_settings(model, tx, mesh="auto"))  # doctest: +SKIP
    >>> state = steps.replicate(train.TrainState.start(params, rest, opt_state))  # doctest: +SKIP
    >>> state = steps.train(state, images, labels)  # doctest: +SKIP
  """

  axis_name = BATCH_AXIS

  def __init__(self, settings: StepSettings):
    mesh = resolve_mesh(settings.mesh)
    self.mesh = mesh
    self.replicated = NamedSharding(mesh, P())
    self._batch_sharding = NamedSharding(mesh, P(BATCH_AXIS))
    self.num_devices = int(mesh.shape[BATCH_AXIS])
    # Every process gets its share of the global batch: a multiple of its local devices.
    self.batch_multiple = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    super().__init__(settings)

  @property
  def indices(self) -> Any:
    """The reduction's index arrays (``None``: dense)."""
    return self.settings.indices.tree

  @property
  def indices_digest(self) -> str | None:
    """Their fingerprint (:func:`jaxprune.train.step.indices_digest`)."""
    return self.settings.indices.digest

  def _mapped(self, step: Callable, replicated_args: int, batch_args: int) -> Callable:
    # check_vma=False: with replication checking, autodiff would itself psum the gradients of
    # the replicated params (densely, before the step could reduce only the kept entries);
    # unchecked, each device's gradient is its shard's, as under pmap, and the reduction is
    # the explicit one of the step body, whose outputs are the same on every device.
    return jax.shard_map(
      step,
      mesh=self.mesh,
      in_specs=(P(),) * replicated_args + (P(BATCH_AXIS),) * batch_args,
      out_specs=P(),
      check_vma=False,
    )

  def _compile_global(self, step: Callable, replicated_args: int, batch_args: int, donate):
    r, b = self.replicated, self._batch_sharding
    jitted = jax.jit(
      self._mapped(step, replicated_args, batch_args),
      in_shardings=(r,) * replicated_args + (b,) * batch_args,
      out_shardings=r,
      donate_argnums=donate,
    )
    return _GlobalBatchStep(jitted, b, self.batch_multiple, batch_args)

  def _compile_train(self, step: Callable) -> Callable:
    return self._compile_global(step, 1, 2, self._donate)

  def _compile_eval(self, step: Callable) -> Callable:
    return self._compile_global(step, 3, 3, (2,) if self.settings.donate else ())

  def _compile_fused(self, make_batch: Callable) -> Callable:
    """Each step's global batch is made as on one device (the gather and the draws of the
    whole batch: the same pixels), constrained to the batch axis so that XLA makes each
    device's shard where it trains on it, and then trained on by the data-parallel step; the
    device-resident data set is replicated on the mesh
    (:meth:`jaxprune.data.DeviceLoader.place`), ``indices`` has shape ``(K, global batch)``."""
    sharding = self._batch_sharding

    def sharded_batch(*args):
      return jax.lax.with_sharding_constraint(make_batch(*args), sharding)

    r = self.replicated
    by_step = NamedSharding(self.mesh, P(None, BATCH_AXIS))
    jitted = jax.jit(
      functools.partial(fused_train_steps, self._mapped(self._train_step, 1, 2), sharded_batch),
      in_shardings=(r, r, r, by_step, r, r, r),
      out_shardings=r,
      donate_argnums=self._donate,
    )
    return functools.partial(_checked_fused, jitted, self.num_devices)

  def replicate(self, tree: Any) -> Any:
    """``tree`` placed on every device of the mesh (the same value on each).

    On several processes every process must hold the same values (the same seed, the same
    checkpoint); each leaf becomes a global array from its process-local copy.
    """
    if self.replicated.is_fully_addressable:
      return jax.device_put(tree, self.replicated)
    return jax.tree.map(self._replicate_leaf, tree)

  def _replicate_leaf(self, x: Any) -> jax.Array:
    if isinstance(x, jax.Array) and x.sharding == self.replicated:
      return x
    if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
      data = jax.make_array_from_process_local_data(
        self.replicated, np.asarray(jax.random.key_data(x))
      )
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.make_array_from_process_local_data(self.replicated, np.asarray(x))


def _checked_fused(
  jitted: Callable, devices: int, state, images, labels, indices, seed, epoch, steps
) -> Any:
  """Calls a fused data-parallel step after checking that its global batch (``indices``'
  second axis) splits evenly over the devices."""
  _check_divisible(np.shape(indices)[1], devices)
  return jitted(state, images, labels, indices, seed, epoch, steps)
