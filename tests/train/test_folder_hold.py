"""A checkpoint folder belongs to one run: a second live trainer on it is refused by name while
the first holds it; once the first is closed, collected or its process has ended, the folder
resumes as before."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest

import jaxprune.train as jt

_REFUSED = r"checkpoint_dir .*ckpt is in use by another live Trainer \({}\): a folder belongs"


def _loader(kit):
  images, labels = kit.data(48)
  return kit.ArrayLoader(images, labels, 8)


def test_a_second_live_trainer_on_the_folder_is_refused(tmp_path, kit):
  loader, ckpt = _loader(kit), tmp_path / "ckpt"
  a = kit.trainer(checkpoint_dir=ckpt)
  a.fit(loader, epochs=1)
  b = kit.trainer(kit.model(seed=5), checkpoint_dir=ckpt)  # another init seed
  with pytest.raises(jt.FolderInUseError, match=_REFUSED.format("in this process")):
    b.fit(loader, epochs=2)
  assert b.epoch == 0  # nothing of A's was taken
  with pytest.raises(ValueError, match="in use by another live Trainer"):
    b.fit(loader, epochs=1, resume=False, overwrite=True)  # nor deleted
  assert a.store.all_steps() == [1]
  # A goes on with its own run, alone.
  a.fit(loader, epochs=2)
  assert a.store.all_steps() == [1, 2] and [r["epoch"] for r in a.history] == [1, 2]


def test_a_closed_or_collected_trainer_lets_the_folder_go(tmp_path, kit):
  loader, ckpt = _loader(kit), tmp_path / "ckpt"
  a = kit.trainer(checkpoint_dir=ckpt)
  a.fit(loader, epochs=1)
  a.close()
  b = kit.trainer(kit.model(seed=5), checkpoint_dir=ckpt)
  b.fit(loader, epochs=2)  # resumes A's run, as a restarted process would
  assert [r["epoch"] for r in b.history] == [1, 2]
  with pytest.raises(jt.FolderInUseError):
    a.fit(loader, epochs=3)  # a closed trainer takes the folder again only when it is free
  del b
  gc.collect()
  c = kit.trainer(kit.model(seed=6), checkpoint_dir=ckpt)
  assert c.restore_checkpoint(loader) and c.epoch == 2


def test_a_folder_held_by_another_process_is_refused_until_that_process_ends(tmp_path, kit):
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      textwrap.dedent(
        f"""
        import sys
        from jaxprune.train.checkpoint import CheckpointStore
        store = CheckpointStore({str(tmp_path / "ckpt")!r})
        store.hold()
        print("held", flush=True)
        sys.stdin.readline()
        """
      ),
    ],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    trainer = kit.trainer(checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(
      jt.FolderInUseError, match=_REFUSED.format(rf"process {holder.pid} on [^)]+")
    ):
      trainer.fit(_loader(kit), epochs=1)
  finally:
    holder.communicate("\n", timeout=120)
  trainer.fit(_loader(kit), epochs=1)  # the holder has ended: the folder is free
  assert trainer.store.all_steps() == [1]
