"""The ``join`` processes of one machine count each other (``commands.neighbours``), so that they
share its cores however they found each other (discovery says nothing of where a peer runs)."""

import os
import subprocess
import sys
import time

import pytest

from p2ptrain.commands import neighbours
from p2ptrain.commands.neighbours import Neighbours

pytestmark = pytest.mark.timeout(60)


def test_each_counts_the_others_until_they_close(tmp_path):
    a, b, c = Neighbours(tmp_path), Neighbours(tmp_path), Neighbours(tmp_path)
    assert [n.count() for n in (a, b, c)] == [3, 3, 3]
    b.close()
    assert [a.count(), c.count()] == [2, 2] and len(os.listdir(tmp_path)) == 2
    c.close()
    a.close()
    assert Neighbours(tmp_path).count() == 1 and len(os.listdir(tmp_path)) == 1


def test_a_killed_process_is_not_counted_and_its_file_goes(tmp_path, monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from p2ptrain.commands.neighbours import "
                              f"Neighbours; n = Neighbours(__import__('pathlib').Path({str(tmp_path)!r})); "
                              "print(n.count(), flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"
        mine = Neighbours(tmp_path)
        assert mine.count() == 2  # (another process's lock: it runs)
        child.kill()
        child.wait(10)
        assert mine.count() == 1  # its lock went with it
        assert len(os.listdir(tmp_path)) == 2  # (a file not yet STALE_AFTER old is left: its owner may be locking it)
        monkeypatch.setattr(neighbours, "STALE_AFTER", 0.0)
        time.sleep(0.01)
        assert mine.count() == 1 and len(os.listdir(tmp_path)) == 1
    finally:
        child.kill()


def test_a_folder_it_cannot_write_counts_this_process_alone(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    lone = Neighbours(blocker / "joins")
    assert lone.count() == 1
    lone.close()


def test_the_cores_are_split_while_others_run_and_taken_back_after(tmp_path, monkeypatch):
    import torch

    from p2ptrain.commands.neighbours import CoreShare

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    own = torch.get_num_threads()
    other = Neighbours(tmp_path)
    cores = CoreShare(Neighbours(tmp_path))
    try:
        cores.share()
        assert torch.get_num_threads() == 4
        other.close()
        cores.share_every(time.monotonic())  # (counted less than CHECK_EVERY ago: not again)
        assert torch.get_num_threads() == 4
        cores.share()
        assert torch.get_num_threads() == own  # alone again: its own threads back
        cores.listed = 3  # --peers names three more peers at this machine's addresses
        cores.share()
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice: kept
        cores.listed = 0
        cores.share()
        assert torch.get_num_threads() == 2
    finally:
        cores.close()
        torch.set_num_threads(own)


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")
def test_a_folder_someone_else_could_have_made_is_not_used_and_nothing_else_is_deleted(tmp_path, monkeypatch):
    """In a shared temporary folder another user may make ours first, or make it a link to a
    folder of our own: the count there deleted every unlocked file older than 10 s it found."""
    monkeypatch.setattr(neighbours, "STALE_AFTER", 0.0)
    mine = tmp_path / "documents"
    mine.mkdir()
    for name in ("notes.txt", "123-deadbeef"):
        (mine / name).write_text("keep me")
    (tmp_path / "p2ptrain-u").mkdir(mode=0o700)
    (tmp_path / "p2ptrain-u" / "joins").symlink_to(mine)
    linked = Neighbours(tmp_path / "p2ptrain-u" / "joins")
    assert linked.count() == 1 and sorted(os.listdir(mine)) == ["123-deadbeef", "notes.txt"]
    linked.close()

    shared = tmp_path / "shared" / "joins"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    (shared / "123-deadbeef").write_text("")
    open_to_all = Neighbours(shared)
    assert open_to_all.count() == 1 and os.listdir(shared) == ["123-deadbeef"]
    open_to_all.close()

    private = tmp_path / "private" / "joins"
    private.mkdir(parents=True)
    (private / "notes.txt").write_text("keep me")
    (private / "123-deadbeef").write_text("")  # a file of ours its killed process left
    time.sleep(0.01)
    ours = Neighbours(private)
    assert ours.count() == 1
    assert sorted(os.listdir(private)) == sorted(["notes.txt", os.path.basename(ours._path)])
    ours.close()
