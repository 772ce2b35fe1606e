"""What self-healing takes for the agent's own change (agent/ownchanges.py), judged as a batch of
events is read: after the agent (or someone else) changed the path again. Someone else's change
must never be taken for the agent's; the agent's own, however interleaved, should be."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from agent.fsutil import Root
from agent.inotify import IN_DELETE, IN_DELETE_SELF, IN_ISDIR, IN_MOVED_TO
from agent.ownchanges import OwnChanges


def setup(tmp_path: Path) -> tuple[Root, OwnChanges, str]:
    own = OwnChanges()
    root = Root(tmp_path / "r", own=own)
    return root, own, str(tmp_path / "r" / "uid" / "req" / "f.json")


def test_writes_and_removals_judged_after_later_ones_are_own(tmp_path):
    root, own, path = setup(tmp_path)
    claim_dir = os.path.dirname(os.path.dirname(path))
    events = []
    for _ in range(3):  # prepare, unprepare, ... with no event read in between
        root.write(path, b"x")
        events.append((path, IN_MOVED_TO))
        root.remove_tree(claim_dir)
        events += [(path, IN_DELETE), (os.path.dirname(path), IN_DELETE | IN_ISDIR),
                   (os.path.dirname(path), IN_DELETE_SELF), (claim_dir, IN_DELETE | IN_ISDIR)]
    root.write(path, b"x")
    events.append((path, IN_MOVED_TO))
    assert [p for p, mask in events if not own.is_own(p, mask)] == []


def test_someone_elses_rename_or_removal_is_never_own(tmp_path):
    root, own, path = setup(tmp_path)
    root.write(path, b"x")
    Path(path + ".new").write_bytes(b"y")
    os.replace(path + ".new", path)  # another inode under the name
    assert not own.is_own(path, IN_MOVED_TO)  # the agent's rename, judged now: not its file there
    assert not own.is_own(path, IN_MOVED_TO)  # theirs

    root.write(path, b"x")
    os.unlink(path)
    assert not own.is_own(path, IN_MOVED_TO) and not own.is_own(path, IN_DELETE)


def test_a_file_gone_from_a_directory_the_agent_made_again_is_not_own(tmp_path):
    root, own, path = setup(tmp_path)
    claim_dir = os.path.dirname(os.path.dirname(path))
    root.write(path, b"x")
    root.remove_tree(claim_dir)
    root.write(path, b"x")  # the claim again: its directories are made again
    assert own.is_own(path, IN_MOVED_TO)
    os.unlink(path)  # then someone removes the file
    assert not own.is_own(path, IN_DELETE)
    # A removal of the whole directory by someone else: the files' events say so.
    root.write(path, b"x")
    own.is_own(path, IN_MOVED_TO)
    os.unlink(path)
    os.rmdir(os.path.dirname(path))
    assert not own.is_own(path, IN_DELETE)


def test_the_last_unprepares_removals_judged_while_the_next_prepare_makes_the_directories(tmp_path):
    """A batch read in the middle of a prepare: the claim's directories are made again, its files
    not written yet. The removals of the unprepare before are still the agent's own."""
    root, own, path = setup(tmp_path)
    claim_dir = os.path.dirname(os.path.dirname(path))
    root.write(path, b"x")
    root.remove_tree(claim_dir)
    with root.directory(root.parts(os.path.dirname(path)), create=True):
        pass  # the next prepare has made the directories, and not written the file yet
    assert own.is_own(path, IN_MOVED_TO)
    assert own.is_own(path, IN_DELETE)
    assert own.is_own(os.path.dirname(path), IN_DELETE | IN_ISDIR)
    assert own.is_own(claim_dir, IN_DELETE_SELF)


def test_workers_change_files_at_once_and_a_judgment_waits_for_the_changes_in_progress(tmp_path):
    """Claims' removals (many system calls each) never queue behind one another; a judgment never
    sees a change without its note, nor the note without the change: it waits for both."""
    own = OwnChanges()
    paths = [str(tmp_path / name) for name in ("a", "b")]
    for path in paths:
        Path(path).write_bytes(b"x")
    barrier = threading.Barrier(2, timeout=30)
    leave = threading.Event()

    def remove(path: str) -> None:
        with own.removing(path):
            barrier.wait()  # both workers inside at once, or the barrier breaks
            os.unlink(path)
            assert leave.wait(30)

    workers = [threading.Thread(target=remove, args=(p,)) for p in paths]
    for w in workers:
        w.start()
    judged: list[bool] = []
    judge = threading.Thread(target=lambda: judged.append(own.is_own(paths[0], IN_DELETE)))
    deadline = time.monotonic() + 30
    while any(os.path.exists(p) for p in paths):  # until both workers are inside, their files removed
        assert time.monotonic() < deadline and not barrier.broken
        time.sleep(0.001)
    judge.start()
    judge.join(0.2)
    assert judged == [] and judge.is_alive()  # the removals are still in progress
    leave.set()
    for w in workers:
        w.join(30)
    judge.join(30)
    assert not barrier.broken and judged == [True]
