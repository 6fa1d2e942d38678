"""Run ``ftlib sft`` (ftlib.cli.sft.main) and SIGKILL this process at a chosen point.

    python tests/cli/_sft_kill_worker.py [--kill-backward N | --kill-save K:F] -- <ftlib sft flags>

``--kill-backward N``: SIGKILL just before the N-th ``TrainOptimizer.backward`` of this process
(N not a multiple of --grad-accum: inside an accumulation window). ``--kill-save K:F``: SIGKILL
while the K-th checkpoint of this process is being written, after its F-th file (from the
background writer thread: the training thread is mid-step then). The kill is a real SIGKILL:
no handler, no flush, no atexit.
"""

import os
import signal
import sys


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv):
    sep = argv.index("--")
    opts, args = argv[:sep], argv[sep + 1:]
    from ftlib import checkpoint
    from ftlib.checkpoint import format as ckformat
    from ftlib.optim import TrainOptimizer

    if "--kill-backward" in opts:
        n_kill = int(opts[opts.index("--kill-backward") + 1])
        calls = [0]
        backward = TrainOptimizer.backward

        def counted(self, *a, **k):
            calls[0] += 1
            if calls[0] == n_kill:
                _die()
            return backward(self, *a, **k)

        TrainOptimizer.backward = counted
    if "--kill-save" in opts:
        k_save, f_kill = (int(x) for x in opts[opts.index("--kill-save") + 1].split(":"))
        saves, files = [0], [0]
        save, write_st = checkpoint.Checkpointer.save, ckformat.write_safetensors

        def counted_save(self, *a, **k):
            saves[0] += 1
            files[0] = 0
            return save(self, *a, **k)

        def counted_write(*a, **k):
            out = write_st(*a, **k)
            files[0] += 1
            if saves[0] == k_save and files[0] == f_kill:
                _die()
            return out

        checkpoint.Checkpointer.save = counted_save
        ckformat.write_safetensors = counted_write
    from ftlib.cli import sft

    sys.exit(sft.main(args))


if __name__ == "__main__":
    main(sys.argv[1:])
