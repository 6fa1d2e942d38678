"""torchrun worker for tests/test_preference.py: precompute_reference across 2 ranks (gloo, CPU).

Each rank computes its share of the pairs; the stored values must equal one process's pass over all
of them, and every rank must end with the same reference attached.
"""

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from test_preference import _adapted, _tiny_model

from ftlib.data.pair_batches import PairLoader
from ftlib.data.pairs import open_pair_cache
from ftlib.preference import precompute_reference, reference_pair_logps


def main(out_dir):
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    out = Path(out_dir)
    cache = open_pair_cache((out / "cache").read_text())
    model = _adapted(_tiny_model(vocab=400), seed=2)
    precompute_reference(model, cache, "dist", pad_id=0, seq_len=128, progress=False)
    got = cache.reference
    if dist.get_rank() == 0:
        want = {"chosen": np.zeros(len(cache)), "rejected": np.zeros(len(cache))}
        for batch in PairLoader(cache, batch_size=1, pad_id=0, seq_len=128, shuffle=False, drop_last=False,
                                rank=0, world_size=1):
            ref = reference_pair_logps(model, {k: v for k, v in batch.items() if not k.startswith("ref_")})
            ids = batch["pair_ids"].numpy()
            want["chosen"][ids], want["rejected"][ids] = ref.chosen.double().numpy(), ref.rejected.double().numpy()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-5)
    both = [None, None]
    dist.all_gather_object(both, got["chosen"].tolist())
    assert both[0] == both[1]
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "ok").write_text("ok")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
