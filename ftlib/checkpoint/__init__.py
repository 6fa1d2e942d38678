"""Train-state checkpoints: atomic, verified, rotated, written off the training path; exact resume.

    ckpt = Checkpointer("runs/x/checkpoints", keep=3, metric="eval_loss", mode="min")
    step = 0
    if resume and (path := latest_checkpoint(ckpt.root)) is not None:
        step = load_checkpoint(path, model=model, optimizer=opt, scheduler=sched, clipper=clip,
                               loader=loader).step
    while step < total:
        ...                                        # one optimizer step (a whole accumulation window)
        step += 1
        if step % save_every == 0 or step == total:
            ckpt.save(step, model=model, optimizer=opt, scheduler=sched, clipper=clip, loader=loader,
                      metrics={"eval_loss": eval_loss})
    ckpt.close()                                   # waits for the last write, releases the root's lock

Modules, bottom up: ``format`` (names, marker, strict JSON, streamed safetensors, fsync +
SHA-256, temporary directory, finalize, rotate), ``verify`` (a directory against its marker; the
newest good one under a root), ``lock`` (one writer per root), ``background`` (one write in
flight), ``local`` (the one-process ``Checkpointer``), ``sharded`` (the names of the sharded
layout), ``load`` (``load_checkpoint`` for either kind). The sharded writer is
``ftlib.distributed.ShardedCheckpointer``, built on these.

Atomicity. A save fills ``<root>/.tmp-step-00001200-<pid>-<n>/``: every file is fsynced, the
marker is written last and fsynced, then the directory, which is renamed to ``step-00001200``
(atomic on POSIX), and the root fsynced. A crash leaves either the finished directory or a
``.tmp-*`` one that is never taken for a checkpoint. A ``step-*`` directory without a valid
marker, whose marker records another step (copied or renamed), or with a file whose size or
SHA-256 differs from the marker's record, is never resumed from: ``latest_checkpoint`` warns
(``CheckpointWarning``) naming the directory and why, and falls back to the previous good one.

Exact resume. A resumed run continues bit for bit when it gets back: the trainable weights; the
optimizer's state and, through ``TrainOptimizer.state_dict``, its precision (and fp16 fallback),
update and skipped-window counters and loss scaler; the schedule's progress and state; the
clipper's state (the z-score EMA); the loader's position (epoch, batches handed out, and the
settings its order depends on, which it checks); the Python, NumPy (legacy global) and torch CPU
and CUDA RNG states (LoRA dropout masks come from the torch RNG). Save between optimizer steps,
after ``step()`` has closed the accumulation window; everything the loop itself keeps (token
counters, the best eval metric) goes into ``extra``. Restore the RNG states last, after anything
that draws random numbers while being built (``load_checkpoint`` does so after the rest).
"""

from .format import (
    MARKER,
    CheckpointError,
    CheckpointWarning,
    best_checkpoint,
    list_checkpoints,
    step_dir_name,
)
from .load import Checkpoint, load_checkpoint
from .local import Checkpointer, save_checkpoint
from .lock import RootLock
from .verify import latest_checkpoint, verify_checkpoint

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "CheckpointWarning",
    "Checkpointer",
    "MARKER",
    "RootLock",
    "best_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]
