"""Run a torchrun worker from a test: one node (``torchrun --standalone``) or several "nodes" on this host."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")


def torchrun(script: Path, *args: str, timeout: float = 120.0, nproc: int = 2) -> str:
    """Launch ``script *args`` on ``nproc`` ranks (2 CPU ranks, gloo, by default) and return its output;
    kill the whole process group on timeout; a non-zero exit fails with the output's tail."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{Path(script).name} timed out after {timeout} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-5000:]
    return out


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it; taken again by the rendezvous a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_nodes(script: Path, *args: str, nnodes: int = 2, nproc: int = 2, timeout: float = 300.0) -> list[str]:
    """See ``_torchrun_nodes``; launched again on a fresh port when the first one was taken meanwhile."""
    try:
        return _torchrun_nodes(script, *args, nnodes=nnodes, nproc=nproc, timeout=timeout)
    except AssertionError as e:
        if "Address already in use" not in str(e) and "EADDRINUSE" not in str(e):
            raise
        return _torchrun_nodes(script, *args, nnodes=nnodes, nproc=nproc, timeout=timeout)


def _torchrun_nodes(script: Path, *args: str, nnodes: int, nproc: int, timeout: float) -> list[str]:
    """Launch ``script *args`` as ``nnodes`` torchrun agents of ``nproc`` ranks each on this host, met by the
    c10d rendezvous, as on ``nnodes`` machines (``torchrun --nnodes=N --rdzv_backend=c10d
    --rdzv_endpoint=HOST:PORT``; the first agent hosts the store). Returns each agent's output.

    A free port and a fresh rendezvous id per call; every agent is killed (with its ranks) when
    one fails or the whole launch runs past ``timeout``; a failure shows each agent's output tail."""
    port, rdzv_id = free_port(), uuid.uuid4().hex[:12]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id={rdzv_id}",
           "--rdzv_conf=join_timeout=60", "--max_restarts=0", "--monitor_interval=0.5", str(script), *args]
    logs = [tempfile.TemporaryFile("w+") for _ in range(nnodes)]
    procs = [subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for f in logs]
    deadline, failed = time.monotonic() + timeout, None
    try:
        while any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.returncode not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    outs = []
    for f in logs:
        f.seek(0)
        outs.append(f.read())
        f.close()
    codes = [p.returncode for p in procs]
    if failed is not None or any(codes):
        what = f"node {failed} exited with {codes[failed]}" if failed is not None else f"exit codes {codes}"
        if failed is None and time.monotonic() > deadline:
            what = f"timed out after {timeout} s"
        raise AssertionError(f"{Path(script).name} on {nnodes} nodes x {nproc}: {what}\n" + "\n".join(
            f"--- node {i} (exit {c}) ---\n{_ends(o)}" for i, (c, o) in enumerate(zip(codes, outs))))
    return outs


def _ends(text: str, head: int = 2000, tail: int = 2500) -> str:
    """The start (where the first error usually is) and the end (torchrun's summary) of a long output."""
    return text if len(text) <= head + tail else f"{text[:head]}\n[...]\n{text[-tail:]}"


def run_torchrun(worker: Path, out_dir: Path, timeout: float = 120.0, args: tuple[str, ...] = (), nproc: int = 2) -> None:
    """Launch ``worker out_dir *args`` through ``torchrun``; the worker writes ``out_dir/ok`` when it is done."""
    torchrun(worker, str(out_dir), *args, timeout=timeout, nproc=nproc)
    assert (out_dir / "ok").read_text() == "ok"
