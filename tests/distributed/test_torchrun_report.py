"""The torchrun launcher of the tests (tests/_torchrun.py): a failed rank is named in the pytest report
with its own exception and traceback, and nothing a launch started outlives it."""

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchrun launcher
from _torchrun import torchrun  # noqa: E402

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("_torchrun_report_worker.py")


@pytest.fixture(autouse=True)
def _gloo():
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")


def test_a_failed_rank_shows_its_exception_and_traceback():
    """Rank 1 raises; the report names this test, rank 1 as the root cause with its exit code, and quotes
    its traceback (the frame that raised, the exception) from rank 1's own log."""
    with pytest.raises(AssertionError) as e:
        torchrun(WORKER, "fail", timeout=120)
    msg = str(e.value)
    print(msg)  # the report as pytest shows it (pytest -s)
    assert "test_torchrun_report.py::test_a_failed_rank_shows_its_exception_and_traceback" in msg
    assert re.search(r"^rank 1 \(local rank 1\): exit code 1 \(root cause", msg, re.M), msg
    ours = msg[msg.index("rank 1 (local rank 1)"):]
    assert re.search(r"(?s)Traceback \(most recent call last\).*, in fail_here\n.*"
                     r"raise ValueError\(f\"rank \{rank\} fails on purpose\"\)\n.*ValueError: rank 1 fails on purpose",
                     ours), msg


def test_a_hung_launch_times_out_with_every_rank_killed(tmp_path):
    """Rank 1 sleeps, rank 0 waits for it: past the timeout the report says so and shows each rank's log,
    and both ranks are gone (torch elastic starts them in sessions of their own, out of reach of the
    agent's process group)."""
    with pytest.raises(AssertionError) as e:
        torchrun(WORKER, "hang", str(tmp_path), timeout=20)
    msg = str(e.value)
    assert re.search(r"_torchrun_report_worker.py hang \S+ on 2 rank\(s\): timed out after 20 s", msg), msg
    assert re.search(r"rank 1: still running, its log's last lines:\n  \| rank 1 sleeps\n", msg), msg
    for r in range(2):
        assert not _alive(int((tmp_path / f"rank-{r}.pid").read_text())), f"rank {r} outlived its launch"


def test_nothing_a_launch_started_outlives_it(tmp_path):
    """A rank leaves a sleeping grandchild behind and exits 0: the launch succeeds and the grandchild is
    gone when torchrun() returns (killed with the launch's process group)."""
    torchrun(WORKER, "orphan", str(tmp_path), timeout=120)
    pid = int((tmp_path / "orphan.pid").read_text())
    deadline = time.monotonic() + 30  # killed already; its new parent (init) may take a moment to reap it
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"pid {pid} outlived its launch"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_rendezvous_port_taken_meanwhile_is_retried_on_a_fresh_one(monkeypatch):
    """Another process listens on the port ``free_port`` gave before the first node binds it: that node
    fails to host the store (it does not join the stranger as a client) and the launch runs again on a
    fresh port."""
    import socket

    import _torchrun

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    given, real = [], _torchrun.free_port

    def free_port():
        given.append(taken.getsockname()[1] if not given else real())
        return given[-1]

    monkeypatch.setattr(_torchrun, "free_port", free_port)
    try:
        outs = _torchrun.torchrun_nodes(WORKER, "ok", nnodes=2, nproc=1, timeout=120)
    finally:
        taken.close()
    assert len(outs) == 2 and len(given) == 2, given  # the taken port, then a fresh one that worked
