"""Run a torchrun worker from a test: one node (``torchrun --standalone``) or several "nodes" on this host.

Every rank writes its own log (``torchrun --log-dir DIR --redirects 3``: ``DIR/<run>/attempt_0/<local
rank>/stdout.log`` and ``stderr.log``). A failed launch raises an AssertionError that names the test,
each failed rank and its exit code, and quotes that rank's own traceback from its log, the root
cause (elastic's first observed failure) first; elastic's summary alone says only ``error_file:
<N/A>``. A launch runs in a session of its own: whatever is left of it when the agent exits, fails or
times out (ranks, their children) is killed with the process group before the agent is reaped, so no
process outlives the test that started it.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

_TAG = "FTLIB_TEST_LAUNCH"  # marks every process of one launch, see _kill_tagged


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")


_ABORT = "terminate called without an active exception"


def torchrun(script: Path, *args: str, timeout: float = 120.0, nproc: int = 2) -> str:
    """Launch ``script *args`` on ``nproc`` ranks (2 CPU ranks, gloo, by default; ``script`` may be ``"-m"``
    with the module first in ``args``, as in ``torchrun("-m", "ftlib", "sft", ...)``) and return torchrun's
    output followed by every rank's log; a non-zero exit or a run past ``timeout`` fails with the
    report of ``report``."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
            logs = Path(tmp)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "--max_restarts=0", f"--log_dir={logs / 'ranks'}", "--redirects=3", str(script), *args]
            with open(logs / "agent.log", "w+") as f:
                proc = _launch(cmd, f)
                code = _wait([proc], timeout)[0]
                f.seek(0)
                out = f.read()
            ranks = rank_logs(logs / "ranks")
        if code not in (0, None) and attempt == 0 and any(t.strip() == _ABORT for t in ranks.values()):
            # a rank whose whole output is this line died in torch's C++ (std::terminate: a gloo thread
            # torn down, seen once under a loaded -n 2 run), not in the script: launch once more, and say so
            sys.stderr.write(f"{_title(script, args, f'{nproc} rank(s)')}: a rank aborted ({_ABORT!r}) "
                             "with no other output; relaunching once\n")
            continue
        break
    if code != 0:
        what = f"timed out after {timeout:g} s (of a core's share, see _share)" if code is None else f"torchrun exited with {code}"
        raise AssertionError(f"{_title(script, args, f'{nproc} rank(s)')}: {what}\n"
                             + report(out, ranks, offset=0, timed_out=code is None))
    return out + "".join(f"\n--- rank {r} ---\n{text}" for r, text in sorted(ranks.items()))


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it; taken again by the rendezvous a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(script: Path, *args: str, nnodes: int = 2, nproc: int = 2, timeout: float = 300.0) -> list[str]:
    """See ``_torchrun_nodes``; launched again on a fresh port when the first node could not bind the one
    ``free_port`` gave (another process took it in between)."""
    for attempt in range(3):
        try:
            return _torchrun_nodes(script, *args, nnodes=nnodes, nproc=nproc, timeout=timeout)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(AssertionError):
    pass


def _torchrun_nodes(script: Path, *args: str, nnodes: int, nproc: int, timeout: float) -> list[str]:
    """Launch ``script *args`` as ``nnodes`` torchrun agents of ``nproc`` ranks each on this host, met by the
    c10d rendezvous, as on ``nnodes`` machines (``torchrun --nnodes=N --rdzv_backend=c10d
    --rdzv_endpoint=HOST:PORT``). The first agent hosts the store (``is_host=1``: it fails on a taken
    port instead of joining whatever listens there); the others are its clients. Returns each agent's
    output followed by its ranks' logs.

    A free port and a fresh rendezvous id per call; every agent is killed (with its ranks) when
    one fails or the whole launch runs past ``timeout``; a failure shows, node by node, each failed
    rank's traceback from its own log and the agent's output."""
    port, rdzv_id = free_port(), uuid.uuid4().hex[:12]
    with tempfile.TemporaryDirectory(prefix="torchrun-nodes-") as tmp:
        logs = Path(tmp)

        def cmd(i: int) -> list[str]:
            return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
                    "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}",
                    f"--rdzv_conf=join_timeout={int(timeout)},is_host={int(i == 0)}", "--max_restarts=0",
                    "--monitor_interval=0.5", f"--log_dir={logs / f'node{i}'}", "--redirects=3", str(script), *args]

        files = [open(logs / f"agent{i}.log", "w+") for i in range(nnodes)]
        try:
            procs = [_launch(cmd(i), f) for i, f in enumerate(files)]
            codes = _wait(procs, timeout, stop_on_failure=True)
            outs = []
            for f in files:
                f.seek(0)
                outs.append(f.read())
        finally:
            for f in files:
                f.close()
        ranks = [rank_logs(logs / f"node{i}") for i in range(nnodes)]
    if all(c == 0 for c in codes):
        return [o + "".join(f"\n--- local rank {r} ---\n{t}" for r, t in sorted(rk.items()))
                for o, rk in zip(outs, ranks)]
    if codes[0] not in (None, 0) and re.search(r"EADDRINUSE|address already in use", outs[0], re.I):
        raise _PortTaken(f"port {port} was taken before the rendezvous bound it:\n{_ends(outs[0])}")
    failed = [i for i, c in enumerate(codes) if c not in (None, 0, -signal.SIGKILL)]
    what = f"node {failed[0]} exited with {codes[failed[0]]}" if failed else f"timed out after {timeout:g} s (of a core's share)"
    msg = f"{_title(script, args, f'{nnodes} nodes x {nproc}')}: {what}\n"
    for i, (c, o, rk) in enumerate(zip(codes, outs, ranks)):
        state = "still running, killed" if c is None or c == -signal.SIGKILL else f"exit {c}"
        msg += f"--- node {i} ({state}) ---\n" + report(o, rk, offset=None, timed_out=i not in failed)
    raise AssertionError(msg)


def _launch(cmd: list[str], log) -> subprocess.Popen:
    """``cmd`` in a session (and process group) of its own, its output into the open file ``log``, its
    environment tagged with a value of its own that every process it starts inherits."""
    env = dict(_env(), **{_TAG: uuid.uuid4().hex})
    p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
    p.tag = env[_TAG]
    return p


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process whose environment holds ``FTLIB_TEST_LAUNCH=tag``, until none is left.

    Killing the agent's process group is not enough: torch elastic starts each rank in a session of
    its own (``start_new_session=True``), and a rank's children are re-parented to init when the rank
    exits; the environment follows them all. Linux only (``/proc``); elsewhere the process group kill
    has to do."""
    needle = f"{_TAG}={tag}".encode()
    for _ in range(100):
        found = []
        for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
            if d.isdigit() and int(d) != os.getpid():
                try:
                    with open(f"/proc/{d}/environ", "rb") as f:  # empty for a zombie
                        if needle in f.read().split(b"\0"):
                            found.append(int(d))
                except OSError:  # gone meanwhile, or not ours
                    pass
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _wait(procs: list[subprocess.Popen], timeout: float, stop_on_failure: bool = False) -> list[int | None]:
    """Wait until every process has exited (or, with ``stop_on_failure``, one has failed) or ``timeout``
    (see ``_share``) passed; then kill each process group and whatever else the launch started (its
    ranks, their children: ``_kill_tagged``) and reap the leader. The exit codes, None for a process
    that was still running (killed here)."""
    codes: list[int | None] = [None] * len(procs)
    used, last = 0.0, time.monotonic()
    try:
        while None in codes and used < timeout:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    # WNOWAIT: the exited leader stays a zombie, so its process group id cannot be reused
                    # by another process before the group is killed below
                    st = os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                    if st is not None:
                        codes[i] = st.si_status if st.si_code == os.CLD_EXITED else -st.si_status
            if stop_on_failure and any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
            now = time.monotonic()
            used, last = used + (now - last) * _share(), now
    finally:
        for p in procs:  # also on KeyboardInterrupt: nothing of a launch outlives the test
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _kill_tagged(p.tag)
            p.wait()
    return codes


def _share() -> float:
    """The share of a core a process gets now: 1 up to a load average of one per core, less above it
    (at least 1/8). A launch's ``timeout`` is counted in such seconds: it guards against a hang, and a
    machine shared with other work (a CI runner's neighbours, ``pytest -n``) is slow, not hung."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return 1.0 if load <= cores else max(cores / load, 1 / 8)


def rank_logs(log_dir: Path) -> dict[int, str]:
    """Each local rank's log under a ``torchrun --log_dir`` (the last attempt): its stdout, then its stderr."""
    ranks: dict[int, str] = {}
    for attempt in sorted(log_dir.glob("*/attempt_*"), key=lambda p: int(p.name.split("_")[1])):
        for d in attempt.iterdir():
            if d.is_dir() and d.name.isdigit():
                parts = [(d / n).read_text(errors="replace") for n in ("stdout.log", "stderr.log") if (d / n).exists()]
                ranks[int(d.name)] = "".join(p if p.endswith("\n") or not p else p + "\n" for p in parts)
    return ranks


_FAILURE = re.compile(r"rank\s*: (\d+) \(local_rank: (\d+)\)\s*\n\s*exitcode\s*: (-?\d+)")


def failures(agent_out: str) -> list[tuple[int, int, int, bool]]:
    """(rank, local rank, exit code, root cause?) of each failed rank in elastic's failure summary, the
    root cause (its first observed failure) first."""
    at = agent_out.rfind(" FAILED\n")
    if at < 0:
        return []
    summary = agent_out[at:]
    root = summary.find("Root Cause")
    found = [(int(m[1]), int(m[2]), int(m[3]), m.start() > root >= 0) for m in _FAILURE.finditer(summary)]
    return sorted(found, key=lambda f: (not f[3], f[0]))


def report(agent_out: str, ranks: dict[int, str], offset: int | None, timed_out: bool = False) -> str:
    """What failed, for a pytest report: each failed rank of elastic's summary with its exit code and its
    own log from the first traceback on (the exception and where it came from), then the agent's
    output. Without a summary (a timeout, a kill, a launch that never started its ranks) every rank's
    log tail. ``offset``: the node's first global rank (None: read each rank from the summary)."""
    failed = failures(agent_out)
    parts = []
    for rank, local, code, root in failed:
        why = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
        why += " (root cause: the first failure torchrun saw)" if root else " (after the first failure)"
        parts.append(f"rank {rank} (local rank {local}): {why}\n{_indent(_traceback(ranks.get(local, '')))}")
    listed = {f[1] for f in failed}
    for local, text in sorted(ranks.items()):
        if local not in listed and (timed_out or not failed):
            rank = f"rank {offset + local}" if offset is not None else f"local rank {local}"
            parts.append(f"{rank}: {'still running' if timed_out else 'no exit code in the summary'}, "
                         f"its log's last lines:\n{_indent(_tail(text, 1500))}")
    if not ranks:
        parts.append("no rank logs: the ranks never started")
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts) + f"torchrun's output:\n{_indent(_ends(agent_out))}"


def _traceback(log: str, limit: int = 6000) -> str:
    """A rank's log from its first traceback on (its last lines if it has none), at most ``limit`` chars."""
    if not log.strip():
        return "(empty log)"
    at = log.find("Traceback (most recent call last)")
    if at < 0:
        return _tail(log, 2500)
    text = log[log.rfind("\n", 0, at) + 1:]
    return text if len(text) <= limit else f"{text[:1500]}\n[...]\n{text[-(limit - 1500):]}"


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "[...]\n" + text[-n:]


def _indent(text: str) -> str:
    return "".join(f"  | {line}\n" for line in text.rstrip("\n").split("\n"))


def _title(script: Path, args: tuple[str, ...], where: str) -> str:
    test = os.environ.get("PYTEST_CURRENT_TEST", "?")
    shown = " ".join(args) if len(" ".join(args)) < 300 else " ".join(args)[:300] + " ..."
    return f"{test}: {' '.join([Path(script).name, shown]).strip()} on {where}"


def _ends(text: str, head: int = 2000, tail: int = 2500) -> str:
    """The start (where the first error usually is) and the end (torchrun's summary) of a long output."""
    return text if len(text) <= head + tail else f"{text[:head]}\n[...]\n{text[-tail:]}"


def run_torchrun(worker: Path, out_dir: Path, timeout: float = 120.0, args: tuple[str, ...] = (), nproc: int = 2) -> None:
    """Launch ``worker out_dir *args`` through ``torchrun``; the worker writes ``out_dir/ok`` when it is done."""
    torchrun(worker, str(out_dir), *args, timeout=timeout, nproc=nproc)
    assert (out_dir / "ok").read_text() == "ok"
