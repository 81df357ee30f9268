"""Tests for ``import jaxprune``: heavy optional dependencies load only when used."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

_REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_jaxprune_leaves_orbax_and_matplotlib_out_until_used(tmp_path):
  # A fresh interpreter: this test process may already have imported both.
  script = textwrap.dedent(
    f"""
    import sys

    import jaxprune

    def loaded(package):
      return sorted(m for m in sys.modules if m == package or m.startswith(package + "."))

    assert jaxprune.__file__.startswith({str(_REPO_ROOT)!r}), jaxprune.__file__
    assert not loaded("orbax"), loaded("orbax")
    assert not loaded("matplotlib"), loaded("matplotlib")
    # Checkpointing still works, and is what brings orbax in.
    jaxprune.train.CheckpointStore({str(tmp_path / "ckpt")!r})
    assert "orbax.checkpoint" in sys.modules
    """
  )
  result = subprocess.run(
    [sys.executable, "-c", script],
    cwd=_REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert result.returncode == 0, result.stderr
