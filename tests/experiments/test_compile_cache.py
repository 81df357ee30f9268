"""experiments/compile_cache.py: JAX's persistent compilation cache for the table commands."""

import json
from pathlib import Path

import pytest

from experiments.common import compile_cache

_REPO = Path(__file__).resolve().parents[2]

# Compiles one program before the cache is on (not cached) and one train step after; reports
# the cache's writes and hits (JAX's monitoring events).
_CHILD = """
import json, jax, jax.numpy as jnp, optax
from experiments.common import compile_cache
events = []
jax.monitoring.register_event_listener(lambda name, **kwargs: events.append(name))
jax.jit(lambda x: x * 3)(jnp.ones(4)).block_until_ready()
folder = compile_cache.enable()

def loss(w, x, y):
  return jnp.mean((jnp.tanh(x @ w) - y) ** 2)

@jax.jit
def step(w, state, x, y):
  grads = jax.grad(loss)(w, x, y)
  updates, state = optax.sgd(0.1, momentum=0.9).update(grads, state, w)
  return optax.apply_updates(w, updates), state

w = jnp.ones((6, 3))
w, _ = step(w, optax.sgd(0.1, momentum=0.9).init(w), jnp.ones((8, 6)), jnp.zeros((8, 3)))
w.block_until_ready()
print(json.dumps({
  "folder": str(folder),
  "writes": events.count("/jax/compilation_cache/cache_misses"),
  "hits": events.count("/jax/compilation_cache/cache_hits"),
}))
"""


def test_a_second_process_loads_every_program_from_the_cache(run_python, tmp_path):
  folder = tmp_path / "jax_cache"
  # No cache before enable() (the suite's own, inherited, would take the first program).
  env = {
    compile_cache.ENV_VAR: str(folder),
    "PYTHONPATH": str(_REPO),
    "JAX_COMPILATION_CACHE_DIR": "",
  }
  reports, entries = [], []
  for _ in range(2):
    done = run_python(_CHILD, env=env)
    assert done.returncode == 0, done.stderr
    reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
    entries.append(sorted(path.name for path in folder.iterdir()))
  first, second = reports
  assert first["folder"] == second["folder"] == str(folder.resolve())
  assert first["writes"] >= 1 and first["hits"] == 0
  assert len(entries[0]) == first["writes"]  # one file per program compiled with the cache on
  assert second["writes"] == 0 and second["hits"] == first["writes"]  # nothing compiled anew
  assert entries[1] == entries[0]


def test_the_folder_defaults_to_runs_unless_the_environment_names_one(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_cache.ENV_VAR, raising=False)
  assert compile_cache.default_dir() == _REPO / "runs" / "jax_cache"
  monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "elsewhere"))
  assert compile_cache.default_dir() == tmp_path / "elsewhere"


def test_a_file_is_not_a_cache_folder(tmp_path):
  path = tmp_path / "a_file"
  path.write_text("")
  with pytest.raises(ValueError, match="cache_dir"):
    compile_cache.enable(path)
