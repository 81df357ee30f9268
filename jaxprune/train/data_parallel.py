"""Data-parallel train and eval steps: the global batch split over a mesh axis ``"batch"``.

Parameters, the rest of the model state and the optimizer state are replicated on every
device; each device runs :func:`jaxprune.train.step.forward_backward` on its shard of the
global batch, and the gradients are averaged explicitly, inside a ``jax.shard_map`` step,
by :func:`jaxprune.distributed.allreduce_gradients`. With ``indices`` (from
:func:`jaxprune.distributed.mask_indices` of final masks, e.g. after ClickTrain's hard
prune) only the kept entries are reduced (ClickTrain §5.3); pruned gradients reach the
optimizer as zeros, which is what ClickTrain's masking gives them on one device too. The
same per-device body runs under ``jax.pmap`` (:func:`data_parallel_train_step`).

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
import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxprune import distributed
from jaxprune.train import _checks
from jaxprune.train.batchnorm import batchnorm_layers
from jaxprune.train.step import (
  Metrics,
  PerExampleLoss,
  apply_optimizer,
  count_step,
  eval_step,
  forward_backward,
  fused_train_steps,
  keep_state_if_finite,
  skip_if_nonfinite,
  step_finite,
  train_sums,
)

__all__ = [
  "BATCH_AXIS",
  "DataParallelSteps",
  "data_parallel_train_step",
  "indices_digest",
  "make_mesh",
  "resolve_mesh",
  "step_functions",
  "rng_key_leaves",
  "train_graphdef",
]

BATCH_AXIS = "batch"


def make_mesh(devices: Any = None) -> Mesh:
  """A 1-D mesh with axis ``"batch"`` over ``devices`` (default: every device, ``jax.devices()``,
  which after ``jax.distributed.initialize`` spans all processes)."""
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
  """``None`` → ``None`` (one device); ``"auto"`` → :func:`make_mesh`; a ``Mesh`` with a
  ``"batch"`` axis → itself.

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
  """The train-mode graphdef of ``model``; with ``axis_name`` every BatchNorm reduces its
  batch moments over that axis (synchronised statistics). ``model`` is left as it was."""
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
  """Per leaf of the model's non-param state (``nnx.split(model, nnx.Param, ...)``'s
  third part): is it an ``nnx.RngKey`` (a random stream's constant key)?"""
  _, _, rest = nnx.split(model, nnx.Param, ...)
  leaves = jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return tuple(isinstance(v, nnx.RngKey) for v in leaves)


def _fold_keys(rest: Any, rng_keys: tuple[bool, ...], axis_name: Any) -> Any:
  if not any(rng_keys):
    return rest
  leaves, treedef = jax.tree.flatten(rest)
  index = jax.lax.axis_index(axis_name)
  leaves = [jax.random.fold_in(x, index) if k else x for x, k in zip(leaves, rng_keys)]
  return jax.tree.unflatten(treedef, leaves)


def _restore_keys(new_rest: Any, rest: Any, rng_keys: tuple[bool, ...]) -> Any:
  if not any(rng_keys):
    return new_rest
  new_leaves, treedef = jax.tree.flatten(new_rest)
  leaves = jax.tree.leaves(rest)
  return jax.tree.unflatten(
    treedef, [old if k else new for new, old, k in zip(new_leaves, leaves, rng_keys)]
  )


def _average_floats(tree: Any, axis_name: Any) -> Any:
  """``pmean`` of the floating leaves (BatchNorm running statistics); counters and keys are
  the same on every device already."""
  return jax.tree.map(
    lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x, tree
  )


def data_parallel_train_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformationExtraArgs,
  loss_fn: PerExampleLoss,
  axis_name: Any,
  params: Any,
  rest: Any,
  opt_state: Any,
  metrics: Metrics,
  images: jax.Array,
  labels: jax.Array,
  *,
  indices: Any = None,
  rng_keys: tuple[bool, ...] = (),
  skip_nonfinite: bool = True,
) -> tuple[Any, Any, Any, Metrics]:
  """One data-parallel step on this device's shard; call it mapped over ``axis_name``.

  The loss and the gradients of the shard (:func:`jaxprune.train.step.forward_backward`)
  are averaged over the axis — the gradients by
  :func:`jaxprune.distributed.allreduce_gradients`, sparse when ``indices`` is given —
  before ``tx`` sees them, so ``tx`` runs the same replicated update on every device.
  Returns the new ``(params, rest, opt_state, metrics)``, the same on every device.

  Args:
    graphdef: train-mode graphdef (:func:`train_graphdef`; with an ``axis_name`` for
      synchronised BatchNorm statistics).
    tx: the optimizer (``optax.with_extra_args_support`` applied).
    loss_fn: per-example loss.
    axis_name: the mapped axis.
    params, rest, opt_state, metrics: replicated states.
    images, labels: this device's shard of the global batch (equal shard sizes).
    indices: :func:`jaxprune.distributed.mask_indices` of final masks (``None``: dense).
    rng_keys: :func:`rng_key_leaves` of the model (random streams to fold per device).
    skip_nonfinite: leave params and optimizer state as they were when the step is not
      finite on any device (:func:`jaxprune.train.step.skip_if_nonfinite`).

  Example (``jax.pmap``: the batch reshaped to ``[devices, per_device, ...]``)::

    step = jax.pmap(
      functools.partial(data_parallel_train_step, graphdef, tx, loss_fn, "batch"),
      axis_name="batch", in_axes=(None, None, None, None, 0, 0), out_axes=None)
    params, rest, opt_state, metrics = step(params, rest, opt_state, metrics,
                                            images.reshape(4, -1, *images.shape[1:]),
                                            labels.reshape(4, -1))
  """
  with distributed.per_device_keys(axis_name):
    loss, logits, new_rest, grads = forward_backward(
      graphdef, loss_fn, params, _fold_keys(rest, rng_keys, axis_name), images, labels
    )
  # One decision per step, from every device's loss and gradients (before the reduction: a
  # NaN at an entry the sparse reduction leaves out counts too) and batch, in ONE all-reduce
  # with the loss: a NaN on one device is one non-finite step, counted once, not per device.
  flags = _checks.batch_flags(images, labels, logits.shape[-1])
  local = jnp.stack([~step_finite(loss, grads), *flags]).astype(jnp.float32)
  # Equal shards: the global mean loss / gradient is the mean of the shards' means.
  global_loss, local = jax.lax.pmean((loss, local), axis_name)
  finite = local[0] == 0
  flags = _checks.BatchFlags(*(local[1:] > 0))
  sums = jax.lax.psum(train_sums(loss, logits, labels, finite), axis_name)
  sums = sums._replace(nonfinite=(~finite).astype(jnp.float32))
  reduce = distributed.allreduce_gradients(axis_name, indices=indices)
  grads, _ = reduce.update(grads, reduce.init(params))
  new_rest = _average_floats(_restore_keys(new_rest, rest, rng_keys), axis_name)
  new_rest = keep_state_if_finite(finite, new_rest, rest)
  new_params, new_opt_state = apply_optimizer(tx, grads, opt_state, params, global_loss)
  if skip_nonfinite:
    new_params, new_opt_state = skip_if_nonfinite(
      finite, (new_params, new_opt_state), (params, opt_state)
    )
  metrics = count_step(metrics, sums, finite, flags, logits.shape[-1])
  return new_params, new_rest, new_opt_state, metrics


def indices_digest(indices: Any) -> str | None:
  """A fingerprint of reduction index arrays (``None`` for the dense reduction), to notice
  when the masks changed and the step must be rebuilt."""
  if indices is None:
    return None
  digest = hashlib.sha1()
  for leaf in jax.tree.leaves(indices, is_leaf=lambda x: x is None):
    digest.update(b"-" if leaf is None else np.asarray(leaf, np.int32).tobytes() + b"|")
  return digest.hexdigest()


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


def _check_divisible_steps(jitted: Callable, devices: int, *args: Any) -> Any:
  """Calls a fused data-parallel step after checking that its global batch (the second axis
  of ``indices``, the fourth argument from the end) splits evenly over the devices."""
  _check_divisible(np.shape(args[-4])[1], devices)
  return jitted(*args)


class DataParallelSteps:
  """Jitted data-parallel train / eval steps over ``mesh``'s ``"batch"`` axis; the same
  interface as :class:`jaxprune.train.StepFunctions`.

  ``train(params, rest, opt_state, metrics, images, labels)`` and
  ``evaluate(params, rest, metrics, images, labels, weights)`` take replicated states
  (:meth:`replicate`) and each process's local part of the global batch (the whole batch on
  one process), whose size must be divisible by the process's devices on the mesh. Each
  compiled step is a ``jax.jit`` of a ``jax.shard_map`` of :func:`data_parallel_train_step`
  / :func:`jaxprune.train.step.eval_step` (with ``axis_name``).

  Build it with :func:`step_functions` (cached: the same structure, optimizer, loss, mesh
  and index arrays reuse the compiled executables, e.g. a resumed run in the same process).

  Args:
    train_graphdef: train-mode graphdef (:func:`train_graphdef`).
    eval_graphdef: eval-mode graphdef.
    tx: the optimizer.
    loss_fn: per-example loss.
    mesh: a mesh with a ``"batch"`` axis.
    rng_keys: :func:`rng_key_leaves` of the model.
    flip_tta: flip test-time augmentation in eval.
    donate: donate the states to the step.
    indices: reduction index arrays (:func:`jaxprune.distributed.mask_indices`) or ``None``.
    skip_nonfinite: a non-finite step leaves params and optimizer state as they were.

  Example:
    >>> steps = step_functions(model, tx, loss_fn, make_mesh())  # doctest: +SKIP
    >>> params, rest, opt_state, metrics = steps.replicate((params, rest, opt_state,
    ...                                                     Metrics.zeros()))  # doctest: +SKIP
    >>> params, rest, opt_state, metrics = steps.train(params, rest, opt_state, metrics,
    ...                                                images, labels)  # doctest: +SKIP
  """

  def __init__(
    self,
    train_graphdef: nnx.GraphDef,
    eval_graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: PerExampleLoss,
    mesh: Mesh,
    *,
    rng_keys: tuple[bool, ...] = (),
    flip_tta: bool = False,
    donate: bool = True,
    indices: Any = None,
    skip_nonfinite: bool = True,
  ):
    mesh = resolve_mesh(mesh)
    self.mesh = mesh
    self.indices = indices
    self.indices_digest = indices_digest(indices)
    self.replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P(BATCH_AXIS))
    self.num_devices = int(mesh.shape[BATCH_AXIS])
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    # Every process gets its share of the global batch: a multiple of its local devices.
    self.batch_multiple = int(local)

    tx = optax.with_extra_args_support(tx)
    train_gd, eval_gd = train_graphdef, eval_graphdef
    train_body = functools.partial(
      data_parallel_train_step,
      train_gd,
      tx,
      loss_fn,
      BATCH_AXIS,
      indices=indices,
      rng_keys=rng_keys,
      skip_nonfinite=skip_nonfinite,
    )
    eval_body = functools.partial(eval_step, eval_gd, loss_fn, flip_tta, axis_name=BATCH_AXIS)
    rep, sharded = P(), P(BATCH_AXIS)
    # check_vma=False: with replication checking, autodiff would itself psum the gradients of
    # the replicated params (densely, before the step could reduce only the kept entries);
    # unchecked, each device's gradient is its shard's, as under pmap, and the reduction is
    # the explicit one of the step body, whose outputs are the same on every device.
    train_mapped = jax.shard_map(
      train_body,
      mesh=mesh,
      in_specs=(rep,) * 4 + (sharded,) * 2,
      out_specs=rep,
      check_vma=False,
    )
    eval_mapped = jax.shard_map(
      eval_body, mesh=mesh, in_specs=(rep,) * 3 + (sharded,) * 3, out_specs=rep, check_vma=False
    )
    r, b = self.replicated, batch
    self._train_mapped, self._batch_sharding = train_mapped, batch
    self._donate = (0, 1, 2, 3) if donate else ()
    self._fused: dict[Callable, Callable] = {}
    self.train = _GlobalBatchStep(
      jax.jit(
        train_mapped,
        in_shardings=(r,) * 4 + (b,) * 2,
        out_shardings=r,
        donate_argnums=(0, 1, 2, 3) if donate else (),
      ),
      batch,
      self.batch_multiple,
      2,
    )
    self.evaluate = _GlobalBatchStep(
      jax.jit(
        eval_mapped,
        in_shardings=(r,) * 3 + (b,) * 3,
        out_shardings=r,
        donate_argnums=(2,) if donate else (),
      ),
      batch,
      self.batch_multiple,
      3,
    )

  def fused_train(self, make_batch: Callable) -> Callable:
    """:meth:`StepFunctions.fused_train <jaxprune.train.StepFunctions.fused_train>` over the
    mesh: the jitted ``fn(params, rest, opt_state, metrics, images, labels, indices, seed,
    epoch, steps)``, with the device-resident data set ``images`` / ``labels`` replicated on
    the mesh (:meth:`jaxprune.data.DeviceLoader.place`) and ``indices`` of shape
    ``(K, global batch)``.

    Each step's global batch is made as on one device (the gather and the draws of the whole
    batch: the same pixels), constrained to the batch axis so that XLA makes each device's
    shard where it trains on it, and then trained on by the data-parallel step.

    Raises:
      ValueError: (at the call) a global batch not divisible by the devices.
    """
    if make_batch not in self._fused:
      sharding = self._batch_sharding

      def sharded_batch(*args):
        return jax.lax.with_sharding_constraint(make_batch(*args), sharding)

      r = self.replicated
      by_step = NamedSharding(self.mesh, P(None, BATCH_AXIS))
      jitted = jax.jit(
        functools.partial(fused_train_steps, self._train_mapped, sharded_batch),
        in_shardings=(r,) * 6 + (by_step, r, r, r),
        out_shardings=r,
        donate_argnums=self._donate,
      )
      self._fused[make_batch] = functools.partial(_check_divisible_steps, jitted, self.num_devices)
    return self._fused[make_batch]

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


class _Indices:
  """Index arrays hashed by content, so :func:`step_functions` can cache on them."""

  def __init__(self, tree: Any):
    self.tree, self.digest = tree, indices_digest(tree)

  def __hash__(self) -> int:
    return hash(self.digest)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Indices) and other.digest == self.digest


@functools.lru_cache(maxsize=32)
def _cached_steps(
  train_gd, eval_gd, tx, loss_fn, mesh, rng_keys, flip_tta, donate, indices, skip_nonfinite
):
  return DataParallelSteps(
    train_gd,
    eval_gd,
    tx,
    loss_fn,
    mesh,
    rng_keys=rng_keys,
    flip_tta=flip_tta,
    donate=donate,
    indices=indices.tree,
    skip_nonfinite=skip_nonfinite,
  )


def step_functions(
  model: nnx.Module,
  tx: optax.GradientTransformation,
  loss_fn: PerExampleLoss,
  mesh: Mesh | str,
  *,
  sync_batchnorm: bool = False,
  flip_tta: bool = False,
  donate: bool = True,
  indices: Any = None,
  skip_nonfinite: bool = True,
) -> DataParallelSteps:
  """Cached :class:`DataParallelSteps` for ``model``'s structure (left in train mode).

  Args:
    model: the model (its structure: graphdefs, random streams).
    tx: the optimizer.
    loss_fn: per-example loss.
    mesh: a mesh with a ``"batch"`` axis, or ``"auto"`` (:func:`make_mesh`).
    sync_batchnorm: synchronised BatchNorm statistics (see the module docstring).
    flip_tta: flip test-time augmentation in eval.
    donate: donate the states to the step.
    indices: reduction index arrays (:func:`jaxprune.distributed.mask_indices` of final
      masks) or ``None`` for the dense reduction.
    skip_nonfinite: a non-finite step leaves params and optimizer state as they were.
  """
  train_gd = train_graphdef(model, BATCH_AXIS if sync_batchnorm else None)
  model.eval()
  eval_gd = nnx.graphdef(model)
  model.train()
  return _cached_steps(
    train_gd,
    eval_gd,
    tx,
    loss_fn,
    resolve_mesh(mesh),
    rng_key_leaves(model),
    flip_tta,
    donate,
    _Indices(indices),
    bool(skip_nonfinite),
  )
