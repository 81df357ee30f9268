"""Jit-compiled train and eval steps over a split NNX model.

The model is split once into ``graphdef`` (static structure, baked into the jitted
closure) and two pure-array pytrees: ``params`` (``nnx.Param``) and ``rest`` (batch
statistics, RNG counters and keys, anything else). Each step is a plain ``jax.jit``
with donated buffers: no NNX graph traversal happens per call (it happens once, at
trace time), which is measurably faster than ``nnx.jit`` for small models on CPU.

The optimizer sees exactly what ``nnx.Optimizer.update(model, grads, value=loss)``
passes: ``tx.update(grads, opt_state, params, value=loss)`` with ``nnx.as_pure`` State
pytrees, so every Optax transform (including ``GradientTransformationExtraArgs``
wrappers that read the loss) works unchanged and opt states are interchangeable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxprune.train import _checks
from jaxprune.train.loss import correct_per_example, cross_entropy_per_example

PerExampleLoss = Callable[[jax.Array, jax.Array], jax.Array]


class Metrics(NamedTuple):
  """Device-side running sums; ``count`` is the number of examples.

  A train step whose loss **or gradients** are not finite adds nothing to the sums and counts
  in ``nonfinite`` instead (one NaN batch would otherwise make the epoch's mean loss NaN and
  hide the finite ones; a finite loss can come with NaN gradients, e.g. from one NaN pixel);
  the trainer's step also leaves its update out (see :func:`skip_if_nonfinite`). The fields
  after ``steps`` say why, for the trainer's warning, and track runs of consecutive
  non-finite steps for its stop (``max_nonfinite_steps`` of :class:`~jaxprune.train.Trainer`).
  """

  loss_sum: jax.Array
  correct_sum: jax.Array
  count: jax.Array
  nonfinite: jax.Array  # train steps with a NaN / Inf loss or gradient, left out of the sums
  steps: jax.Array  # train steps seen
  nonfinite_inputs: jax.Array  # train steps whose images (or soft labels) hold NaN / Inf
  first_nonfinite_input: jax.Array  # 1-based step (of ``steps``) of the first of them; 0: none
  labels_out_of_range: jax.Array  # non-finite train steps with class ids outside [0, classes)
  num_classes: jax.Array  # the model's outputs (the logits' last axis); 0 before a train step
  # Consecutive non-finite steps ending at the latest step; the trainer starts an epoch with
  # the previous epoch's, so a run spans epochs.
  nonfinite_run: jax.Array
  run_start: jax.Array  # 1-based step where that run began; 0: no run, or an earlier epoch
  max_nonfinite: jax.Array  # the run length that stops the run (set by the trainer); 0: none
  limit_reached: jax.Array  # 1 once a run reached ``max_nonfinite`` (0 before)
  limit_run_start: jax.Array  # ``run_start`` of the first such run (0: an earlier epoch)

  @classmethod
  def zeros(cls) -> "Metrics":
    return cls(*(jnp.zeros([], jnp.float32) for _ in cls._fields))

  def summary(self) -> dict[str, float]:
    count = float(self.count)
    out = {
      "loss": float(self.loss_sum) / count if count else float("nan"),
      "acc": float(self.correct_sum) / count if count else float("nan"),
      "count": int(count),
    }
    return out | {name: int(getattr(self, name)) for name in self._fields[3:]}


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
  """Mean loss over ``images``, logits, the new non-param state and the gradients.

  Shared by the single-device step and the data-parallel one
  (:mod:`jaxprune.train.data_parallel`), which calls it on each device's shard.
  """

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
  """``(new_params, new_opt_state)``; as ``nnx.Optimizer.update``, the loss reaches
  ``GradientTransformationExtraArgs`` as ``value``."""
  updates, opt_state = tx.update(grads, opt_state, params, value=loss)
  return optax.apply_updates(params, updates), opt_state


def train_sums(
  loss: jax.Array, logits: jax.Array, labels: jax.Array, finite: jax.Array | None = None
) -> Metrics:
  """One batch's contribution to the running sums of :class:`Metrics` (the counting fields
  after ``nonfinite`` are :func:`count_step`'s).

  ``finite`` (default ``isfinite(loss)``) decides whether the batch counts; the train steps
  pass :func:`step_finite`'s decision (a data-parallel step the global one, so every device
  makes the same decision).
  """
  finite = jnp.isfinite(loss) if finite is None else finite
  # A select, not a product: 0 · NaN would poison the sums (see Metrics).
  batch = jnp.where(finite, logits.shape[0], 0).astype(jnp.float32)
  zero = jnp.zeros([], jnp.float32)
  return Metrics(
    jnp.where(finite, loss * batch, 0.0),
    jnp.where(finite, jnp.sum(correct_per_example(logits, labels)), 0.0),
    batch,
    (~finite).astype(jnp.float32),
    *(zero for _ in Metrics._fields[4:]),
  )


def step_finite(loss: jax.Array, grads: Any) -> jax.Array:
  """Whether a train step is finite: its loss **and** every gradient entry (one decision)."""
  return _checks.tree_all_finite(loss, grads)


def count_step(
  metrics: Metrics, sums: Metrics, finite: jax.Array, flags: _checks.BatchFlags, num_classes: int
) -> Metrics:
  """``metrics`` after one train step: ``sums`` added, the step counted, and the causes of a
  non-finite step (:class:`~jaxprune.train._checks.BatchFlags`) recorded."""
  out = add_metrics(metrics, sums)
  bad_inputs = flags.inputs_nonfinite
  first = jnp.where(
    (metrics.first_nonfinite_input == 0) & bad_inputs,
    metrics.steps + 1,
    metrics.first_nonfinite_input,
  )
  # Runs of consecutive non-finite steps: a stop needs the first batch of the run named.
  run = jnp.where(finite, 0.0, metrics.nonfinite_run + 1)
  begins = ~finite & (metrics.nonfinite_run == 0)
  run_start = jnp.where(finite, 0.0, jnp.where(begins, metrics.steps + 1, metrics.run_start))
  hit = (metrics.limit_reached == 0) & (metrics.max_nonfinite > 0) & (run >= metrics.max_nonfinite)
  return out._replace(
    steps=metrics.steps + 1,
    nonfinite_inputs=metrics.nonfinite_inputs + bad_inputs.astype(jnp.float32),
    first_nonfinite_input=first,
    labels_out_of_range=metrics.labels_out_of_range
    + (flags.labels_out_of_range & ~finite).astype(jnp.float32),
    num_classes=jnp.full([], num_classes, jnp.float32),
    nonfinite_run=run,
    run_start=run_start,
    limit_reached=jnp.where(hit, 1.0, metrics.limit_reached),
    limit_run_start=jnp.where(hit, run_start, metrics.limit_run_start),
  )


def skip_if_nonfinite(finite: jax.Array, new: Any, old: Any) -> Any:
  """``new`` where the step was finite, else ``old``: every leaf (params, the optimizer state
  with its momentum and step count), so a non-finite step leaves no trace in them.

  A select, not a ``lax.cond``: both branches are already computed, and a select keeps the
  fused steps of a ``lax.scan`` free of control flow. One NaN gradient applied would make
  every parameter NaN at the next step through the momentum, and a NaN in ``params`` never
  leaves.
  """
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def keep_state_if_finite(finite: jax.Array, new_rest: Any, rest: Any) -> Any:
  """``new_rest`` where the step was finite, else the floating leaves of ``rest``.

  A non-finite batch would otherwise write NaN into BatchNorm's running statistics even when
  its update is skipped (:func:`skip_if_nonfinite`), and every later eval would be NaN;
  counters and keys advance either way.
  """
  return jax.tree.map(
    lambda new, old: jnp.where(finite, new, old) if jnp.issubdtype(new.dtype, jnp.inexact) else new,
    new_rest,
    rest,
  )


def add_metrics(metrics: Metrics, sums: Metrics) -> Metrics:
  return Metrics(*(a + b for a, b in zip(metrics, sums)))


def _train_step(
  graphdef: nnx.GraphDef,
  tx: optax.GradientTransformationExtraArgs,
  loss_fn: PerExampleLoss,
  skip_nonfinite: bool,
  params: Any,
  rest: Any,
  opt_state: Any,
  metrics: Metrics,
  images: jax.Array,
  labels: jax.Array,
):
  loss, logits, new_rest, grads = forward_backward(graphdef, loss_fn, params, rest, images, labels)
  finite = step_finite(loss, grads)
  flags = _checks.batch_flags(images, labels, logits.shape[-1])
  new_params, new_opt_state = apply_optimizer(tx, grads, opt_state, params, loss)
  if skip_nonfinite:
    new_params, new_opt_state = skip_if_nonfinite(
      finite, (new_params, new_opt_state), (params, opt_state)
    )
  params, opt_state = new_params, new_opt_state
  new_rest = keep_state_if_finite(finite, new_rest, rest)
  sums = train_sums(loss, logits, labels, finite)
  return params, new_rest, opt_state, count_step(metrics, sums, finite, flags, logits.shape[-1])


def fused_train_steps(
  train_step: Callable,
  make_batch: Callable,
  params: Any,
  rest: Any,
  opt_state: Any,
  metrics: Metrics,
  images: jax.Array,
  labels: jax.Array,
  indices: jax.Array,
  seed: jax.Array,
  epoch: jax.Array,
  steps: jax.Array,
):
  """``len(steps)`` calls of ``train_step(params, rest, opt_state, metrics, *batch)`` in one
  ``lax.scan``, step ``k`` on ``make_batch(images, labels, indices[k], seed, epoch,
  steps[k])``: the body of :meth:`StepFunctions.fused_train` (and of the data-parallel one,
  whose ``train_step`` is the mapped step). Returns the new ``(params, rest, opt_state,
  metrics)``."""
  # K train steps in one call: each makes its batch from the device-resident data set, so
  # the host neither builds nor copies batches and dispatches once per K steps.
  if steps.shape[0] == 1:
    # One step: no loop. XLA:CPU ran a train step inside a one-trip scan 7x slower than the
    # same step outside it (a VGG-11 at width 1/8, 2026-11).
    batch = make_batch(images, labels, indices[0], seed, epoch, steps[0])
    return train_step(params, rest, opt_state, metrics, *batch)

  def one_step(carry, xs):
    batch_indices, step = xs
    batch = make_batch(images, labels, batch_indices, seed, epoch, step)
    return train_step(*carry, *batch), None

  carry, _ = jax.lax.scan(one_step, (params, rest, opt_state, metrics), (indices, steps))
  return carry


def eval_sums(
  graphdef: nnx.GraphDef,
  loss_fn: PerExampleLoss,
  flip_tta: bool,
  params: Any,
  rest: Any,
  images: jax.Array,
  labels: jax.Array,
  weights: jax.Array,
) -> Metrics:
  """One eval batch's contribution to the running :class:`Metrics` (weight 0 = padding)."""
  model = nnx.merge(graphdef, params, rest)
  logits = model(images)
  if flip_tta:
    # Test-time augmentation of the SDGP/ffcv recipe: average the logits of the image
    # and its horizontal mirror (NHWC: width is axis 2).
    logits = 0.5 * (logits + model(images[:, :, ::-1, :]))
  per_example = loss_fn(logits, labels)
  return Metrics(
    jnp.sum(per_example * weights),
    jnp.sum(correct_per_example(logits, labels) * weights),
    jnp.sum(weights),
    # eval counts no train steps
    *(jnp.zeros([], jnp.float32) for _ in Metrics._fields[3:]),
  )


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
  """``metrics`` plus the batch's sums; with ``axis_name`` (inside a data-parallel step on
  one shard of the batch) the sums are added up over that axis."""
  sums = eval_sums(graphdef, loss_fn, flip_tta, params, rest, images, labels, weights)
  if axis_name is not None:
    sums = jax.lax.psum(sums, axis_name)
  return add_metrics(metrics, sums)


@functools.lru_cache(maxsize=32)
def step_functions(
  train_graphdef: nnx.GraphDef,
  eval_graphdef: nnx.GraphDef,
  tx: optax.GradientTransformation,
  loss_fn: PerExampleLoss,
  *,
  flip_tta: bool = False,
  donate: bool = True,
  skip_nonfinite: bool = True,
) -> "StepFunctions":
  """Cached :class:`StepFunctions`: a model structure seen before (same graphdefs, same
  ``tx`` and ``loss_fn`` objects) reuses the already compiled executables, e.g. when a
  run is resumed in the same process or several runs share one optimizer."""
  return StepFunctions(
    train_graphdef,
    eval_graphdef,
    tx,
    loss_fn,
    flip_tta=flip_tta,
    donate=donate,
    skip_nonfinite=skip_nonfinite,
  )


class StepFunctions:
  """Jitted train / eval steps for one model structure (rebuilt when shapes change).

  ``train(params, rest, opt_state, metrics, images, labels)`` returns the new
  ``(params, rest, opt_state, metrics)``; its first four arguments are donated.
  ``evaluate(params, rest, metrics, images, labels, weights)`` returns metrics; rows with
  weight 0 are padding (so a short last batch reuses the compiled step).
  :meth:`fused_train` runs several steps per call on batches made on the device.
  With ``skip_nonfinite`` (default) a step whose loss or gradients are not finite leaves
  params and optimizer state as they were (:func:`skip_if_nonfinite`); ``False`` applies
  whatever the optimizer makes of them.
  """

  def __init__(
    self,
    train_graphdef: nnx.GraphDef,
    eval_graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn: PerExampleLoss,
    *,
    flip_tta: bool = False,
    donate: bool = True,
    skip_nonfinite: bool = True,
  ):
    tx = optax.with_extra_args_support(tx)
    # One train step, jitted alone (train) and inside the fused loop (fused_train).
    self._train_step = functools.partial(
      _train_step, train_graphdef, tx, loss_fn, bool(skip_nonfinite)
    )
    self._donate = (0, 1, 2, 3) if donate else ()
    self._fused: dict[Callable, Callable] = {}
    self.train = jax.jit(self._train_step, donate_argnums=self._donate)
    self.evaluate = jax.jit(
      functools.partial(eval_step, eval_graphdef, loss_fn, flip_tta),
      donate_argnums=(2,) if donate else (),
    )

  def fused_train(self, make_batch: Callable) -> Callable:
    """The jitted ``fn(params, rest, opt_state, metrics, images, labels, indices, seed, epoch,
    steps)``: ``len(steps)`` train steps in one ``lax.scan``, step ``k`` on
    ``make_batch(images, labels, indices[k], seed, epoch, steps[k])`` (a
    :class:`~jaxprune.data.DeviceLoader`'s :meth:`~jaxprune.data.DeviceLoader.make_batch`).
    Each step is :attr:`train`'s, so K fused steps compute what K single steps compute."""
    if make_batch not in self._fused:
      self._fused[make_batch] = jax.jit(
        functools.partial(fused_train_steps, self._train_step, make_batch),
        donate_argnums=self._donate,
      )
    return self._fused[make_batch]


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), tree)


def memory_bytes(stats: Any) -> int:
  """Bytes a compiled executable needs: arguments + outputs + temporaries - donated
  aliases, or XLA's reported peak if that is larger."""
  total = int(
    stats.argument_size_in_bytes
    + stats.output_size_in_bytes
    + stats.temp_size_in_bytes
    - stats.alias_size_in_bytes
  )
  return max(total, int(getattr(stats, "peak_memory_in_bytes", 0) or 0))


def train_step_memory(
  steps: StepFunctions,
  params: Any,
  rest: Any,
  opt_state: Any,
  image_shape: tuple[int, ...],
  batch_size: int,
  *,
  num_classes: int | None = None,
  soft_labels: bool = False,
) -> dict[str, int]:
  """XLA memory analysis of the compiled train step at ``batch_size``.

  Compiles (does not run) ``steps.train`` on abstract inputs of shape
  ``[batch_size, *image_shape]`` and returns the executable's memory statistics;
  PruneTrain's dynamic mini-batch (§4.3) uses ``"total"`` to pick the largest batch
  that fits the memory freed by a reconfiguration.

  Args:
    steps: the jitted step functions.
    params, rest, opt_state: current model / optimizer states (only shapes are used).
    image_shape: one example's shape, e.g. ``(32, 32, 3)``.
    batch_size: batch size to analyse.
    num_classes: required if ``soft_labels``.
    soft_labels: analyse with ``[B, C]`` float labels instead of int ``[B]``.

  Returns:
    dict with ``argument``, ``output``, ``temp``, ``alias``, ``generated_code`` and
    ``total`` (:func:`memory_bytes`) in bytes.
  """
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  if soft_labels and num_classes is None:
    raise ValueError("num_classes is required when soft_labels=True")
  images = jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32)
  labels = (
    jax.ShapeDtypeStruct((batch_size, num_classes), jnp.float32)
    if soft_labels
    else jax.ShapeDtypeStruct((batch_size,), jnp.int32)
  )
  compiled = steps.train.lower(
    _abstract(params),
    _abstract(rest),
    _abstract(opt_state),
    _abstract(Metrics.zeros()),
    images,
    labels,
  ).compile()
  stats = compiled.memory_analysis()
  return {
    "argument": int(stats.argument_size_in_bytes),
    "output": int(stats.output_size_in_bytes),
    "temp": int(stats.temp_size_in_bytes),
    "alias": int(stats.alias_size_in_bytes),
    "generated_code": int(stats.generated_code_size_in_bytes),
    "total": memory_bytes(stats),
  }
