"""The train and eval steps over a split NNX model: one step body for one device and for data
parallelism, and its jitted functions on one device.

The model is split once into ``graphdef`` (static structure, baked into the jitted closure)
and two pure-array pytrees: ``params`` (``nnx.Param``) and ``rest`` (batch statistics, RNG
counters and keys, anything else). Each step is a plain ``jax.jit`` with donated buffers: no
NNX graph traversal happens per call (it happens once, at trace time), which is measurably
faster than ``nnx.jit`` for small models on CPU.

:func:`train_step` is the one sequence of a train step (forward/backward, the optimizer, the
non-finite guard, the metric sums); with an ``axis_name`` it runs on one device's shard of a
data-parallel step and adds the reductions over that axis (:mod:`jaxprune.train.data_parallel`
compiles it over a mesh). What the compiled steps depend on besides their arrays is one
hashable :class:`StepSettings`, the compile cache key (:func:`jaxprune.train.step_functions`).

The optimizer sees exactly what ``nnx.Optimizer.update(model, grads, value=loss)`` passes:
``tx.update(grads, opt_state, params, value=loss)`` with ``nnx.as_pure`` State pytrees, so
every Optax transform (including ``GradientTransformationExtraArgs`` wrappers that read the
loss) works unchanged and opt states are interchangeable.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxprune import distributed
from jaxprune.train import _checks
from jaxprune.train._nonfinite import (
  NonFiniteState,
  count_step,
  keep_state_if_finite,
  skip_if_nonfinite,
  step_finite,
)
from jaxprune.train.loss import correct_per_example, cross_entropy_per_example

PerExampleLoss = Callable[[jax.Array, jax.Array], jax.Array]


class Metrics(NamedTuple):
  """Device-side running sums (``count``: examples) and the non-finite bookkeeping.

  A train step whose loss **or gradients** are not finite adds nothing to the sums (one NaN
  batch would otherwise make the epoch's mean loss NaN and hide the finite ones) and is
  counted in ``nonfinite_state`` instead (:class:`~jaxprune.train.NonFiniteState`).
  """

  loss_sum: jax.Array
  correct_sum: jax.Array
  count: jax.Array
  nonfinite_state: NonFiniteState

  @classmethod
  def zeros(cls, *, nonfinite_run: float = 0, max_nonfinite: float = 0) -> "Metrics":
    """Empty sums; the non-finite run as in :meth:`NonFiniteState.zeros`."""
    # One buffer per field: the step donates them, and one buffer cannot be donated twice.
    state = NonFiniteState.zeros(nonfinite_run=nonfinite_run, max_nonfinite=max_nonfinite)
    return cls(*(jnp.zeros([], jnp.float32) for _ in range(3)), state)

  def add(self, loss_sum: jax.Array, correct_sum: jax.Array, count: jax.Array) -> "Metrics":
    """These metrics with one batch's sums added."""
    return self._replace(
      loss_sum=self.loss_sum + loss_sum,
      correct_sum=self.correct_sum + correct_sum,
      count=self.count + count,
    )

  def summary(self) -> dict[str, float]:
    """Mean ``loss`` and ``acc``, ``count``, and the non-finite counters by name (ints)."""
    count = float(self.count)
    out = {
      "loss": float(self.loss_sum) / count if count else float("nan"),
      "acc": float(self.correct_sum) / count if count else float("nan"),
      "count": int(count),
    }
    return out | {name: int(v) for name, v in self.nonfinite_state._asdict().items()}


class TrainState(NamedTuple):
  """What a train step reads and returns (donated to it).

  The model's params and other variables, the raw Optax state and the running :class:`Metrics`.
  """

  params: Any
  rest: Any
  opt_state: Any
  metrics: Metrics

  @classmethod
  def start(cls, params: Any, rest: Any, opt_state: Any) -> "TrainState":
    """The state with empty :class:`Metrics`."""
    return cls(params, rest, opt_state, Metrics.zeros())


def indices_digest(indices: Any) -> str | None:
  """A fingerprint of reduction index arrays (``None`` for the dense reduction).

  Used to notice when the masks changed and the step must be rebuilt.
  """
  if indices is None:
    return None
  digest = hashlib.sha1()
  for leaf in jax.tree.leaves(indices, is_leaf=lambda x: x is None):
    digest.update(b"-" if leaf is None else np.asarray(leaf, np.int32).tobytes() + b"|")
  return digest.hexdigest()


class ReductionIndices:
  """The data-parallel reduction's index arrays, hashed by content.

  ``tree``; ``None``: dense. Hashed by content so that :class:`StepSettings` can be a cache key.
  """

  def __init__(self, tree: Any = None):
    self.tree, self.digest = tree, indices_digest(tree)

  def __hash__(self) -> int:
    return hash(self.digest)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, ReductionIndices) and other.digest == self.digest

  def __repr__(self) -> str:
    return f"ReductionIndices({self.digest})"


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """Everything the compiled steps depend on besides their arrays.

  Hashable, so it is the compile cache key of :func:`jaxprune.train.step_functions`.

  Attributes:
    train_graphdef: train-mode graphdef (with a BatchNorm ``axis_name`` for synchronised
      statistics, :func:`jaxprune.train.data_parallel.train_graphdef`).
    eval_graphdef: eval-mode graphdef.
    tx: the optimizer.
    loss_fn: per-example loss.
    flip_tta: flip test-time augmentation in eval.
    donate: donate the states to the steps.
    skip_nonfinite: a non-finite step leaves params and optimizer state as they were;
      ``False`` applies whatever the optimizer makes of them.
    mesh: a mesh with a ``"batch"`` axis for data parallelism; ``None``: one device.
    rng_keys: per leaf of ``rest``, is it an ``nnx.RngKey`` (folded per device on a mesh;
      :func:`jaxprune.train.data_parallel.rng_key_leaves`).
    indices: the data-parallel gradient reduction's kept entries (dense by default).
  """

  train_graphdef: nnx.GraphDef
  eval_graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  loss_fn: PerExampleLoss
  flip_tta: bool = False
  donate: bool = True
  skip_nonfinite: bool = True
  mesh: Any = None
  rng_keys: tuple[bool, ...] = ()
  indices: ReductionIndices = ReductionIndices()


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.GraphDef, Any, Any]:
  """``(train_graphdef, eval_graphdef, params, rest)`` with pure-array states.

  ``model.train()`` / ``model.eval()`` flip static attributes (BatchNorm's
  ``use_running_average``, Dropout's ``deterministic``), so each mode has its own
  graphdef. The model is left in train mode.
  """
  model.eval()
  eval_graphdef = nnx.graphdef(model)
  model.train()
  train_graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return train_graphdef, eval_graphdef, nnx.as_pure(params), nnx.as_pure(rest)


@functools.lru_cache(maxsize=None)
def default_loss(label_smoothing: float = 0.0) -> PerExampleLoss:
  """Per-example softmax cross-entropy with label smoothing (int or soft labels).

  Cached, so trainers with the same smoothing share one function (and compiled steps).
  """
  return functools.partial(cross_entropy_per_example, label_smoothing=label_smoothing)


def forward_backward(
  graphdef: nnx.GraphDef,
  loss_fn: PerExampleLoss,
  params: Any,
  rest: Any,
  images: jax.Array,
  labels: jax.Array,
) -> tuple[jax.Array, jax.Array, Any, Any]:
  """Mean loss over ``images``, logits, the new non-param state and the gradients."""

  def compute_loss(params):
    model = nnx.merge(graphdef, params, rest)
    logits = model(images)
    per_example = loss_fn(logits, labels)
    _, _, new_rest = nnx.split(model, nnx.Param, ...)
    return jnp.mean(per_example), (logits, nnx.as_pure(new_rest))

  (loss, (logits, new_rest)), grads = jax.value_and_grad(compute_loss, has_aux=True)(params)
  return loss, logits, new_rest, grads


def apply_optimizer(
  tx: optax.GradientTransformationExtraArgs, grads: Any, opt_state: Any, params: Any, loss
) -> tuple[Any, Any]:
  """``(new_params, new_opt_state)`` after one optimizer update.

  The loss reaches ``tx`` as ``value``, as in ``nnx.Optimizer.update``.
  """
  updates, opt_state = tx.update(grads, opt_state, params, value=loss)
  return optax.apply_updates(params, updates), opt_state


def _map_rng_keys(rest: Any, rng_keys: tuple[bool, ...], fn: Callable) -> Any:
  """``rest`` with ``fn(leaf, i)`` applied to the ``i``-th leaf where ``rng_keys`` says it is
  a random stream's key."""
  if not any(rng_keys):
    return rest
  leaves, treedef = jax.tree.flatten(rest)
  return jax.tree.unflatten(
    treedef, [fn(x, i) if k else x for i, (x, k) in enumerate(zip(leaves, rng_keys))]
  )


def _shard_forward_backward(
  settings: StepSettings, params: Any, rest: Any, images: jax.Array, labels: jax.Array, axis_name
) -> tuple[jax.Array, jax.Array, Any, Any]:
  """:func:`forward_backward` on this device's shard; on a mapped axis each device draws its
  own random numbers (keys folded with its index, restored after) while the state stays
  replicated."""
  if axis_name is None:
    return forward_backward(settings.train_graphdef, settings.loss_fn, params, rest, images, labels)
  index = jax.lax.axis_index(axis_name)
  folded = _map_rng_keys(rest, settings.rng_keys, lambda x, _: jax.random.fold_in(x, index))
  with distributed.per_device_keys(axis_name):
    loss, logits, new_rest, grads = forward_backward(
      settings.train_graphdef, settings.loss_fn, params, folded, images, labels
    )
  old = jax.tree.leaves(rest)
  new_rest = _map_rng_keys(new_rest, settings.rng_keys, lambda _, i: old[i])
  # BatchNorm's running statistics: the devices' average, so they stay replicated (counters
  # and keys are the same on every device already).
  new_rest = jax.tree.map(
    lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.inexact) else x, new_rest
  )
  return loss, logits, new_rest, grads


def _step_decision(
  loss: jax.Array, grads: Any, images: jax.Array, labels: jax.Array, num_classes: int, axis_name
) -> tuple[jax.Array, _checks.BatchFlags, jax.Array]:
  """``(finite, flags, loss)``: whether the step is finite, why it may not be, and the loss
  the optimizer sees; on a mapped axis, one decision and the mean loss over every device."""
  finite = step_finite(loss, grads)
  flags = _checks.batch_flags(images, labels, num_classes)
  if axis_name is None:
    return finite, flags, loss
  # From every device's loss and gradients (before the reduction: a NaN at an entry the
  # sparse reduction leaves out counts too) and batch, in ONE all-reduce with the loss: a NaN
  # on one device is one non-finite step, counted once, not per device. Equal shards: the
  # global mean loss is the mean of the shards' means.
  local = jnp.stack([~finite, *flags]).astype(jnp.float32)
  loss, local = jax.lax.pmean((loss, local), axis_name)
  return local[0] == 0, _checks.BatchFlags(*(local[1:] > 0)), loss


def _train_sums(
  loss: jax.Array, logits: jax.Array, labels: jax.Array, finite: jax.Array, axis_name
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One batch's ``(loss_sum, correct_sum, count)``, zero when the step is not finite; summed
  over a mapped axis."""
  # A select, not a product: 0 · NaN would poison the sums.
  batch = jnp.where(finite, logits.shape[0], 0).astype(jnp.float32)
  sums = (
    jnp.where(finite, loss * batch, 0.0),
    jnp.where(finite, jnp.sum(correct_per_example(logits, labels)), 0.0),
    batch,
  )
  return sums if axis_name is None else jax.lax.psum(sums, axis_name)


def train_step(
  settings: StepSettings,
  state: TrainState,
  images: jax.Array,
  labels: jax.Array,
  *,
  axis_name: Any = None,
) -> TrainState:
  """One train step: forward/backward, the optimizer's update, the non-finite guard, metrics.

  With ``axis_name`` (inside ``jax.shard_map`` or ``jax.pmap`` over it) this is one device's
  part of a data-parallel step on its shard of the global batch: the loss, the non-finite
  decision and the metric sums are reduced over the axis, the gradients by
  :func:`jaxprune.distributed.allreduce_gradients` (sparse with ``settings.indices``), and
  BatchNorm's running statistics averaged, so ``tx`` runs the same replicated update on
  every device (:mod:`jaxprune.train.data_parallel`).

  Args:
    settings: the step's settings (graphdef, ``tx``, loss, non-finite handling).
    state: params, rest, optimizer state and metrics (replicated on a mapped axis).
    images: the batch (this device's shard on a mapped axis; equal shard sizes).
    labels: its labels.
    axis_name: the mapped axis of a data-parallel step; ``None``: one device.

  Returns:
    The new :class:`TrainState` (the same on every device). With ``settings.skip_nonfinite``
    a step whose loss or gradients are not finite leaves params and optimizer state as they
    were; BatchNorm's statistics are kept either way.

  Example (``jax.pmap``: the batch reshaped to ``[devices, per_device, ...]``)::

    step = jax.pmap(functools.partial(train_step, settings, axis_name="batch"),
                    axis_name="batch", in_axes=(None, 0, 0), out_axes=None)
    state = step(state, images.reshape(4, -1, *images.shape[1:]), labels.reshape(4, -1))
  """
  params, rest, opt_state, metrics = state
  loss, logits, new_rest, grads = _shard_forward_backward(
    settings, params, rest, images, labels, axis_name
  )
  num_classes = logits.shape[-1]
  finite, flags, loss_all = _step_decision(loss, grads, images, labels, num_classes, axis_name)
  if axis_name is not None:
    reduce = distributed.allreduce_gradients(axis_name, indices=settings.indices.tree)
    grads, _ = reduce.update(grads, reduce.init(params))
  tx = optax.with_extra_args_support(settings.tx)
  new_params, new_opt_state = apply_optimizer(tx, grads, opt_state, params, loss_all)
  if settings.skip_nonfinite:
    new_params, new_opt_state = skip_if_nonfinite(
      finite, (new_params, new_opt_state), (params, opt_state)
    )
  metrics = metrics.add(*_train_sums(loss, logits, labels, finite, axis_name))
  metrics = metrics._replace(
    nonfinite_state=count_step(metrics.nonfinite_state, finite, flags, num_classes)
  )
  return TrainState(
    new_params, keep_state_if_finite(finite, new_rest, rest), new_opt_state, metrics
  )


def fused_train_steps(
  train_step: Callable,
  make_batch: Callable,
  state: TrainState,
  images: jax.Array,
  labels: jax.Array,
  indices: jax.Array,
  seed: jax.Array,
  epoch: jax.Array,
  steps: jax.Array,
) -> TrainState:
  """``len(steps)`` calls of ``train_step(state, *batch)`` in one ``lax.scan``.

  Step ``k`` trains on ``make_batch(images, labels, indices[k], seed, epoch, steps[k])``: the
  body of :meth:`StepFunctions.fused_train` (and of the data-parallel one, whose
  ``train_step`` is the mapped step).
  """
  # K train steps in one call: each makes its batch from the device-resident data set, so
  # the host neither builds nor copies batches and dispatches once per K steps.
  if steps.shape[0] == 1:
    # One step: no loop. XLA:CPU ran a train step inside a one-trip scan 7x slower than the
    # same step outside it (a VGG-11 at width 1/8).
    return train_step(state, *make_batch(images, labels, indices[0], seed, epoch, steps[0]))

  def one_step(carry, xs):
    batch_indices, step = xs
    return train_step(carry, *make_batch(images, labels, batch_indices, seed, epoch, step)), None

  state, _ = jax.lax.scan(one_step, state, (indices, steps))
  return state


def eval_step(
  graphdef: nnx.GraphDef,
  loss_fn: PerExampleLoss,
  flip_tta: bool,
  params: Any,
  rest: Any,
  metrics: Metrics,
  images: jax.Array,
  labels: jax.Array,
  weights: jax.Array,
  *,
  axis_name: Any = None,
) -> Metrics:
  """``metrics`` plus one eval batch's sums (weight 0 = padding).

  With ``axis_name`` (inside a data-parallel step on one shard of the batch) the sums are added up
  over that axis.
  """
  model = nnx.merge(graphdef, params, rest)
  logits = model(images)
  if flip_tta:
    # Test-time augmentation of the SDGP/ffcv recipe: average the logits of the image
    # and its horizontal mirror (NHWC: width is axis 2).
    logits = 0.5 * (logits + model(images[:, :, ::-1, :]))
  sums = (
    jnp.sum(loss_fn(logits, labels) * weights),
    jnp.sum(correct_per_example(logits, labels) * weights),
    jnp.sum(weights),
  )
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  return metrics.add(*sums)


class StepFunctions:
  """Jitted train / eval steps on one device for one :class:`StepSettings`.

  ``train(state, images, labels)`` returns the new :class:`TrainState` (``state`` donated).
  ``evaluate(params, rest, metrics, images, labels, weights)`` returns metrics; rows with
  weight 0 are padding (so a short last batch reuses the compiled step).
  :meth:`fused_train` runs several steps per call on batches made on the device. Build it
  with :func:`jaxprune.train.step_functions` (cached on the settings).
  """

  axis_name: Any = None  # the mapped axis of the data-parallel steps

  def __init__(self, settings: StepSettings):
    self.settings = settings
    # One train step, jitted alone (train) and inside the fused loop (fused_train).
    self._train_step = functools.partial(train_step, settings, axis_name=self.axis_name)
    self._fused: dict[Callable, Callable] = {}
    self.train = self._compile_train(self._train_step)
    self.evaluate = self._compile_eval(
      functools.partial(
        eval_step,
        settings.eval_graphdef,
        settings.loss_fn,
        settings.flip_tta,
        axis_name=self.axis_name,
      )
    )

  @property
  def _donate(self) -> tuple[int, ...]:
    return (0,) if self.settings.donate else ()

  def _compile_train(self, step: Callable) -> Callable:
    return jax.jit(step, donate_argnums=self._donate)

  def _compile_eval(self, step: Callable) -> Callable:
    return jax.jit(step, donate_argnums=(2,) if self.settings.donate else ())

  def _compile_fused(self, make_batch: Callable) -> Callable:
    return jax.jit(
      functools.partial(fused_train_steps, self._train_step, make_batch),
      donate_argnums=self._donate,
    )

  def fused_train(self, make_batch: Callable) -> Callable:
    """The jitted ``fn(state, images, labels, indices, seed, epoch, steps)``.

    ``len(steps)`` train steps in one ``lax.scan``, step ``k`` on ``make_batch(images,
    labels, indices[k], seed, epoch, steps[k])`` (a :class:`~jaxprune.data.DeviceLoader`'s
    :meth:`~jaxprune.data.DeviceLoader.make_batch`). Each step is :attr:`train`'s, so K fused
    steps compute what K single steps compute.
    """
    if make_batch not in self._fused:
      self._fused[make_batch] = self._compile_fused(make_batch)
    return self._fused[make_batch]
