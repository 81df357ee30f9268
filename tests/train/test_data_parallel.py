"""Data-parallel training on 4 emulated CPU devices against the single-device step.

One subprocess (the device count must be set before JAX starts) runs every check and prints
one JSON line of results; the tests below read it. Each check compares with something
computed independently of the data-parallel code: the single-device step on the same global
batch, or a hand average of single-device passes over the four quarters of the batch.
"""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
  r"""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import functools, json
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jaxprune.train import step as st
    from jaxprune.train import data_parallel as dp

    assert jax.device_count() == 4, jax.devices()
    out = {}

    class Net(nnx.Module):
      def __init__(self, *, batchnorm, rngs):
        self.stem = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs) if batchnorm else None
        self.conv = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

      def __call__(self, x):
        x = nnx.relu(self.stem(x))
        if self.bn is not None:
          x = self.bn(x)
        return self.head(nnx.relu(self.conv(x)).mean((1, 2)))

    def record_grads():
      # Keeps the gradient it is given in its state: what the optimizer saw.
      return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p), lambda u, s, p=None: (u, u))

    def max_diff(a, b):
      pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
      return max([float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs
                  if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)] + [0.0])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 4, 16).astype(np.int32)
    loss_fn = st.default_loss(0.0)
    tx = optax.chain(record_grads(), optax.sgd(0.1, momentum=0.9))
    mesh = dp.make_mesh()

    def single_step(model, tx):
      tg, eg, p, r = st.split_model(model)
      steps = st.StepFunctions(tg, eg, tx, loss_fn, donate=False)
      return steps.train(p, r, tx.init(p), st.Metrics.zeros(), x, y)

    def dp_step(model, tx, **kw):
      _, _, p, r = st.split_model(model)
      steps = dp.DataParallelSteps(model, tx, loss_fn, mesh, donate=False, **kw)
      state = steps.replicate((p, r, tx.init(p), st.Metrics.zeros()))
      return steps.train(*state, x, y), steps

    def compare(name, a, b):
      out[name] = {
        "loss": abs(a[3].summary()["loss"] - b[3].summary()["loss"]),
        "grads": max_diff(a[2][0], b[2][0]),
        "params": max_diff(a[0], b[0]),
        "rest": max_diff(a[1], b[1]),
        "count": [a[3].summary()["count"], b[3].summary()["count"]],
      }

    # Dense, no BatchNorm; then BatchNorm with synchronised statistics.
    one = single_step(Net(batchnorm=False, rngs=nnx.Rngs(0)), tx)
    four, steps = dp_step(Net(batchnorm=False, rngs=nnx.Rngs(0)), tx)
    compare("dense", one, four)
    sharding = four[0]["head"]["kernel"].sharding
    out["replicated"] = [sharding.is_fully_replicated, len(sharding.device_set)]
    ev = steps.evaluate(*steps.replicate((four[0], four[1], st.Metrics.zeros())), x, y,
                        np.ones(16, np.float32))
    tg, eg, _, _ = st.split_model(Net(batchnorm=False, rngs=nnx.Rngs(0)))
    ev1 = st.StepFunctions(tg, eg, tx, loss_fn, donate=False).evaluate(
      four[0], four[1], st.Metrics.zeros(), x, y, np.ones(16, np.float32))
    out["eval"] = abs(ev.summary()["loss"] - ev1.summary()["loss"])
    try:
      steps.train(*four, x[:10], y[:10])
      out["indivisible"] = None
    except ValueError as e:
      out["indivisible"] = str(e)

    compare("sync_bn", single_step(Net(batchnorm=True, rngs=nnx.Rngs(0)), tx),
            dp_step(Net(batchnorm=True, rngs=nnx.Rngs(0)), tx, sync_batchnorm=True)[0])

    # Per-device BatchNorm: the mean over the quarters of single-device passes.
    model = Net(batchnorm=True, rngs=nnx.Rngs(0))
    tg, _, p, r = st.split_model(model)
    sgd = optax.sgd(0.1)
    (p4, r4, _, m4), _ = dp_step(model, sgd)
    fb = jax.jit(functools.partial(st.forward_backward, tg, loss_fn))
    quarters = [fb(p, r, x[i:i + 4], y[i:i + 4]) for i in range(0, 16, 4)]
    mean = lambda trees: jax.tree.map(lambda *t: sum(t) / len(t), *trees)
    hand_params = jax.tree.map(lambda w, g: w - 0.1 * g, p, mean([q[3] for q in quarters]))
    out["per_device_bn"] = {
      "loss": abs(m4.summary()["loss"] - float(np.mean([q[0] for q in quarters]))),
      "params": max_diff(p4, hand_params),
      "rest": max_diff(r4, mean([q[2] for q in quarters])),
      # Differs from the global-batch step: the check above is not vacuous.
      "vs_single": max_diff(p4, single_step(Net(batchnorm=True, rngs=nnx.Rngs(0)), sgd)[0]),
    }

    # The same per-device body under jax.pmap (batch reshaped to [devices, per_device]).
    model = Net(batchnorm=True, rngs=nnx.Rngs(0))
    tg, _, p, r = st.split_model(model)
    pstep = jax.pmap(
      functools.partial(dp.data_parallel_train_step, dp.train_graphdef(model, "batch"),
                        optax.with_extra_args_support(tx), loss_fn, "batch"),
      axis_name="batch", in_axes=(None, None, None, None, 0, 0), out_axes=None)
    pm = pstep(p, r, tx.init(p), st.Metrics.zeros(), x.reshape(4, 4, 8, 8, 1), y.reshape(4, 4))
    compare("pmap", single_step(Net(batchnorm=True, rngs=nnx.Rngs(0)), tx), pm)

    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["JAX_PLATFORMS"] = "cpu"
  root = pathlib.Path(__file__).resolve().parents[2]
  proc = subprocess.run(
    [sys.executable, "-c", _SCRIPT],
    capture_output=True,
    text=True,
    env=env,
    cwd=root,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT ") :])


def _assert_same_step(got, tol=1e-5):
  assert got["count"] == [16, 16]
  for key in ("loss", "grads", "params", "rest"):
    assert got[key] < tol, (key, got)


@pytest.mark.parametrize("case", ["dense", "sync_bn", "pmap"])
def test_data_parallel_step_equals_single_device_step(results, case):
  _assert_same_step(results[case])


def test_states_are_replicated_and_eval_matches(results):
  assert results["replicated"] == [True, 4]
  assert results["eval"] < 1e-5


def test_per_device_batchnorm_is_the_mean_of_the_quarters(results):
  got = results["per_device_bn"]
  assert got["loss"] < 1e-5 and got["params"] < 1e-5 and got["rest"] < 1e-5, got
  assert got["vs_single"] > 1e-4, got


def test_indivisible_batch_names_both_numbers(results):
  message = results["indivisible"]
  assert message is not None and "10" in message and "4 devices" in message
