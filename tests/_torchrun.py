"""Run a 2-rank torchrun worker from a test."""

import os
import signal
import subprocess
import sys
from pathlib import Path


def torchrun(script: Path, *args: str, timeout: float = 120.0, nproc: int = 2) -> str:
    """Launch ``script *args`` on ``nproc`` ranks (2 CPU ranks, gloo, by default) and return its output;
    kill the whole process group on timeout; a non-zero exit fails with the output's tail."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script),
           *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{Path(script).name} timed out after {timeout} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-5000:]
    return out


def run_torchrun(worker: Path, out_dir: Path, timeout: float = 120.0, args: tuple[str, ...] = (), nproc: int = 2) -> None:
    """Launch ``worker out_dir *args`` through ``torchrun``; the worker writes ``out_dir/ok`` when it is done."""
    torchrun(worker, str(out_dir), *args, timeout=timeout, nproc=nproc)
    assert (out_dir / "ok").read_text() == "ok"
