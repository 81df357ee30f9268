"""Two OS processes × 2 CPU devices (jax.distributed, Gloo) against one process × 4 devices.

Each worker starts through :func:`jaxprune.multihost.initialize` from the command-line flags,
loads its shard of every global batch with :class:`jaxprune.data.Loader` (process index and
count from JAX), trains a few data-parallel steps (:func:`jaxprune.train.step_functions`
over every device of every process, ClickTrain-style sparse reduction from the second half
on), writes an orbax checkpoint from every process, runs ``Trainer.fit`` with ``mesh="auto"``
and resumes it, and saves what it saw. The
same script with one process and 4 devices is the reference: the same global batches on the
same 4 device shards, so loss and parameters must agree to float tolerance (only the
all-reduce's transport differs).
"""

import json
import pathlib
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_WORKER = textwrap.dedent(
  r"""
    import argparse, json, sys
    from jaxprune import multihost

    parser = multihost.add_arguments(argparse.ArgumentParser())
    parser.add_argument("--out", required=True)
    parser.add_argument("--restore-from", default=None)
    args = parser.parse_args()
    multihost.initialize(args, initialization_timeout=30)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jaxprune import data, distributed, masking
    from jaxprune.paths import path_string
    from jaxprune.train import CheckpointStore, Trainer
    from jaxprune.train import compiled as cp
    from jaxprune.train import data_parallel as dp
    from jaxprune.train import step as st

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.stem = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.conv = nnx.Conv(8, 8, (3, 3), use_bias=False, rngs=rngs)
        self.head = nnx.Linear(8, 4, rngs=rngs)

      def __call__(self, x):
        x = self.bn(nnx.relu(self.stem(x)))
        return self.head(nnx.relu(self.conv(x)).mean((1, 2)))

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (96, 8, 8, 1), dtype=np.uint8)
    labels = rng.integers(0, 4, 96)
    dataset = data.Dataset.from_arrays(images, labels, num_classes=4)
    def new_loader():
      return data.Loader(dataset, 16, seed=3, augment="none", prefetch=0)
    loader = new_loader()
    assert (loader.process_index, loader.process_count) == (jax.process_index(),
                                                           jax.process_count())

    # Parameters from NumPy, not JAX's initializers: each initializer is a compile, and the
    # worker should spend its time on the distributed step.
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Net(nnx.Rngs(0))))

    def build():
      init = np.random.default_rng(1)
      def fill(path, leaf):
        name = path_string(path).rsplit("/", 1)[-1]
        if name in ("scale", "var"):
          return np.ones(leaf.shape, leaf.dtype)
        if name in ("bias", "mean"):
          return np.zeros(leaf.shape, leaf.dtype)
        return (0.3 * init.standard_normal(leaf.shape)).astype(leaf.dtype)
      return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, abstract))

    model = build()
    _, _, params, rest = st.split_model(model)
    mesh = dp.make_mesh()
    assert mesh.devices.size == 4
    kernel = params["conv"]["kernel"]
    mask = np.asarray(np.abs(kernel) > np.median(np.abs(kernel)))
    params["conv"]["kernel"] = kernel * mask
    masks = jax.tree.map(lambda _: None, params)
    masks["conv"]["kernel"] = mask
    # Pruned weights stay zero (their momentum from the dense steps is masked away).
    tx = optax.chain(optax.sgd(0.1, momentum=0.9), masking.mask(masks))
    steps_for = {
      "dense": cp.step_functions(cp.step_settings(model, tx, mesh=mesh)),
      "sparse": cp.step_functions(cp.step_settings(model, tx, mesh=mesh,
                                                   indices=distributed.mask_indices(masks))),
    }
    def local(tree):
      # Replicated over every process's devices: this process's own copy.
      return jax.tree.map(
        lambda a: np.asarray(a.addressable_data(0) if isinstance(a, jax.Array) else a), tree)

    state = steps_for["dense"].replicate(st.TrainState.start(params, rest, tx.init(params)))
    losses, seen = [], []
    for i, (x, y) in zip(range(4), loader):
      seen.append(np.asarray(x[:, 0, 0, 0]).tolist())
      steps = steps_for["dense" if i < 2 else "sparse"]
      state = steps.train(state._replace(metrics=steps.replicate(st.Metrics.zeros())), x, y)
      losses.append(local(state.metrics).summary()["loss"])

    final = local(state[0])

    def save(stem, tree):
      named = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}
      np.savez(f"{args.out}/{stem}_{jax.process_index()}.npz", **named)

    # Orbax from every process: each one takes part in the (collective) save.
    store = CheckpointStore(args.out + "/ckpt")
    store.save(4, {"params": state[0], "opt_state": state[2]}, {"loader": loader.state()})
    restored_loader = None
    if args.restore_from:
      # The pair runs alongside: wait (bounded) for its checkpoint, complete once renamed.
      import os, time
      deadline = time.monotonic() + 90
      while not os.path.isdir(os.path.join(args.restore_from, "4")):
        assert time.monotonic() < deadline, "no checkpoint from the two processes"
        time.sleep(0.2)
      restored, meta = CheckpointStore(args.restore_from).restore(
        4, {"params": params, "opt_state": tx.init(params)})
      save("restored", local(restored["params"]))
      restored_loader = meta["loader"]

    # The Trainer over every process's devices: two epochs, a checkpoint after each ...
    plain_sgd = optax.sgd(0.1, momentum=0.9)  # one object: the resumed run reuses the step

    def trainer():
      return Trainer(build(), plain_sgd, mesh="auto", progress=False,
                     checkpoint_dir=args.out + f"/trainer_ckpt_{jax.process_count()}")
    history = trainer().fit(new_loader(), epochs=2)
    # ... and a fresh Trainer resuming from them for a third epoch.
    try:
      resumed = trainer()
      resumed.fit(new_loader(), epochs=3)
      save("resumed", local(resumed.params))
      resume_error = None
    except Exception as err:  # recorded; both processes still finish
      resume_error = f"{type(err).__name__}: {err}"[:800]
    result = {
      "fit_losses": [h["train_loss"] for h in history], "resume_error": resume_error,
      "process": jax.process_index(), "count": jax.process_count(), "losses": losses,
      "seen": seen, "saved_loader": loader.state(), "restored_loader": restored_loader,
      "pruned_zero": bool(np.all(final["conv"]["kernel"][~mask] == 0)),
    }
    save("params", final)
    with open(f"{args.out}/result_{jax.process_index()}.json", "w") as f:
      json.dump(result, f)
    print("DONE", jax.process_index(), flush=True)
    """
)


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _launch(out, flags, env):
  return subprocess.Popen(
    [sys.executable, "-c", _WORKER, "--out", str(out), *flags],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    env=env,
    cwd=_ROOT,  # the checkout under test, whatever the current folder
  )


def _finish(procs, timeout):
  """Waits for every process (bounded); kills the ones still running, whatever happened."""
  outputs = []
  try:
    for proc in procs:
      try:
        outputs.append(proc.communicate(timeout=timeout)[0])
      except subprocess.TimeoutExpired as err:
        raise AssertionError(f"a worker ran past {timeout} s:\n{err.output}") from None
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return outputs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cpu_env):
  """Runs the two-process pair and the one-process reference; returns their folders."""
  env = cpu_env()
  pair, single = tmp_path_factory.mktemp("pair"), tmp_path_factory.mktemp("single")
  address = f"127.0.0.1:{_free_port()}"
  flags = [
    ["--coordinator-address", address, "--num-processes", "2", "--process-id", str(i),
     "--num-cpu-devices", "2"]
    for i in range(2)
  ]  # fmt: skip
  # The one-process run trains alongside and then restores the pair's checkpoint.
  flags.append(["--num-cpu-devices", "4", "--restore-from", str(pair / "ckpt")])
  outs = [pair, pair, single]
  procs = [_launch(out, f, env) for out, f in zip(outs, flags)]
  outputs = _finish(procs, timeout=150)
  for proc, output in zip(procs, outputs):
    assert proc.returncode == 0, output
  return pair, single


def _results(out, n):
  return [json.loads((out / f"result_{i}.json").read_text()) for i in range(n)]


def _params(path):
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def test_two_processes_of_two_devices_train_like_one_process_of_four(runs):
  pair, single = runs
  (reference,) = _results(single, 1)
  first, second = _results(pair, 2)
  assert (first["count"], second["count"], reference["count"]) == (2, 2, 1)
  # The loss is the global batch's on both processes, and the one process's.
  np.testing.assert_allclose(first["losses"], reference["losses"], rtol=1e-5)
  assert first["losses"] == second["losses"]
  assert reference["losses"][0] != reference["losses"][-1]  # it trained
  want = _params(single / "params_0.npz")
  for process in range(2):
    got = _params(pair / f"params_{process}.npz")
    assert got.keys() == want.keys()
    for name in want:
      np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
  assert first["pruned_zero"] and second["pruned_zero"] and reference["pruned_zero"]


def test_each_process_loads_its_own_half_of_every_global_batch(runs):
  pair, single = runs
  (reference,) = _results(single, 1)
  first, second = _results(pair, 2)
  for step, global_batch in enumerate(reference["seen"]):
    assert len(first["seen"][step]) == len(second["seen"][step]) == 8
    assert first["seen"][step] + second["seen"][step] == global_batch


def test_orbax_checkpoint_written_by_two_processes_restores_exactly(runs):
  pair, single = runs
  first, second = _results(pair, 2)
  (reference,) = _results(single, 1)
  assert (pair / "ckpt" / "4").is_dir()
  assert first["saved_loader"] == second["saved_loader"]
  assert (first["saved_loader"]["epoch"], first["saved_loader"]["step"]) == (0, 4)
  # The one-process run restores what the two processes wrote: the pair's parameters, bit
  # for bit, and the loader position.
  assert reference["restored_loader"] == first["saved_loader"]
  restored, written = _params(single / "restored_0.npz"), _params(pair / "params_0.npz")
  assert restored.keys() == written.keys()
  for name in written:
    np.testing.assert_array_equal(restored[name], written[name], err_msg=name)


def test_trainer_on_two_processes_fits_like_one_process(runs):
  pair, single = runs
  (reference,) = _results(single, 1)
  first, second = _results(pair, 2)
  np.testing.assert_allclose(first["fit_losses"], reference["fit_losses"], rtol=1e-5)
  assert first["fit_losses"] == second["fit_losses"]
  assert len(reference["fit_losses"]) == 2 and reference["resume_error"] is None


def test_trainer_on_two_processes_resumes_like_one_process(runs):
  pair, single = runs
  first, second = _results(pair, 2)
  assert first["resume_error"] is None and second["resume_error"] is None, (
    first["resume_error"],
    second["resume_error"],
  )
  want = _params(single / "resumed_0.npz")
  got = _params(pair / "resumed_0.npz")
  for name in want:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
