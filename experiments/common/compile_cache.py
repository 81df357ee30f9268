"""JAX's persistent compilation cache for the experiment commands.

A table command compiles the same programs every time it runs, and a PruneTrain run compiles
many: every installed reconfiguration (every 10 epochs, §4.2) brings a new train and eval
program and the dynamic mini-batch's memory probes (§4.3), each a compilation of the new train
step.  With the cache on, a rerun (a resumed row, the paired dense run, the same budget again)
loads those programs from disk instead of compiling them; what the cache saves on the CPU is
measured by ``experiments/prunetrain/compile_bench.py``.  Everything is cached, however small
and quick to compile: the default thresholds skip programs that compile in under a second.

The cache is trusted code (JAX runs what it loads): keep it in a folder only you write to.

References:
  Lym et al., "PruneTrain: Fast Neural Network Training by Dynamic Sparse Model
  Reconfiguration", SC 2019. https://arxiv.org/abs/1901.09290
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENV_VAR", "default_dir", "enable"]

ENV_VAR = "JAXPRUNE_COMPILE_CACHE"
# Under the git-ignored scratch folder the table commands write to (experiments/common/budgets.py).
_DEFAULT = Path(__file__).resolve().parents[2] / "runs" / "jax_cache"

# The options that make JAX cache every program; each is set where this JAX has it.  The
# folder's option is required: without it there is no cache.  A minimum entry size of -1
# turns the size limit off for good (0 lets JAX raise it for some file systems).
_CACHE_DIR_OPTION = "jax_compilation_cache_dir"
_CACHE_EVERYTHING = {
  "jax_persistent_cache_min_compile_time_secs": 0.0,
  "jax_persistent_cache_min_entry_size_bytes": -1,
}


def default_dir() -> Path:
  """The cache folder: ``$JAXPRUNE_COMPILE_CACHE`` when set (and not empty), otherwise
  ``runs/jax_cache`` at the top of the repository.

  Returns:
    The folder (not created).
  """
  from_env = os.environ.get(ENV_VAR, "").strip()
  return Path(from_env).expanduser() if from_env else _DEFAULT


def enable(cache_dir: str | os.PathLike | None = None) -> Path:
  """Turns JAX's persistent compilation cache on, in ``cache_dir``, for every program.

  Programs compiled before the call are not cached.  JAX opens its cache folder once per
  process, at the first compilation with a folder set; the call resets that (JAX's public
  ``reset_cache``), so it may come after earlier compilations or again with another folder.

  Args:
    cache_dir: the folder (created); None: :func:`default_dir`.

  Returns:
    The folder, resolved.

  Raises:
    ValueError: ``cache_dir`` is an existing path that is not a folder, or this JAX has no
      persistent compilation cache.
  """
  from jax.experimental.compilation_cache import compilation_cache

  folder = Path(cache_dir).expanduser() if cache_dir is not None else default_dir()
  if folder.exists() and not folder.is_dir():
    raise ValueError(f"cache_dir: {str(folder)!r} exists and is not a folder")
  folder = folder.resolve()
  folder.mkdir(parents=True, exist_ok=True)
  for option, value in _CACHE_EVERYTHING.items():
    # An option a JAX release renamed or dropped only makes the cache keep less.
    _set_option(option, value)
  if not _set_option(_CACHE_DIR_OPTION, str(folder)):
    raise ValueError(f"cache_dir: this JAX has no {_CACHE_DIR_OPTION} option (no persistent cache)")
  compilation_cache.reset_cache()
  return folder


def _set_option(option: str, value: object) -> bool:
  """``jax.config.update(option, value)``; False where this JAX has no such option."""
  import jax

  try:
    jax.config.update(option, value)
  except AttributeError:  # "Unrecognized config option"
    return False
  return True
