"""Several nodes: HSDP over 2 "nodes" x 2 ranks on this host, launched as two torchrun agents met by the
c10d rendezvous (``torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d``), trains like one process.

Shard within a node, replicate across nodes (``device_mesh(shard=LOCAL_WORLD_SIZE)``); each of the
4 ranks takes 1 row of every global step, the one-process reference all 4. fp32 on CPU (gloo):
the per-step losses, token counts, gradient norms, the trained tensors and the exported adapter
equal one process's up to the rounding of another summation order (token counts and
skips exactly).
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist_common import build, saved_weights
from conftest import reference
from safetensors.torch import load_file
from test_sharding import _assert_records_match, _assert_weights_match, _records

from ftlib.lora import save_adapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the torchrun launcher
from _torchrun import torchrun_nodes  # noqa: E402

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("_multinode_worker.py")
CASES = ("lora", "qlora")


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    out = tmp_path_factory.mktemp("two-nodes")
    torchrun_nodes(WORKER, str(out), *CASES, nnodes=2, nproc=2, timeout=300)
    assert (out / "ok").read_text() == "ok"
    return out


@pytest.mark.parametrize("case", CASES)
def test_hsdp_on_two_nodes_trains_like_one_process(two_nodes, case, tmp_path):
    module, want, _ = reference(case)
    got = _records(two_nodes, case)
    assert got["groups"] == [[0, [0, 1], [0, 2]], [0, [0, 1], [1, 3]], [1, [2, 3], [0, 2]], [1, [2, 3], [1, 3]]]
    _assert_records_match(got["records"], want, 2e-6, case)
    ref = saved_weights(module)
    _assert_weights_match(load_file(two_nodes / case / "final.safetensors"), ref, 1e-6, case)
    initial = saved_weights(build(case))
    assert any(not torch.equal(ref[k], initial[k]) for k in ref), f"{case}: training changed nothing"
    # the PEFT adapter rank 0 of node 0 wrote: the one-process adapter's tensors and config
    save_adapter(module.model, tmp_path)
    got, want = (load_file(d / "adapter_model.safetensors") for d in (two_nodes / case / "adapter", tmp_path))
    assert set(got) == set(want) and len(want) > 0
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert (two_nodes / case / "adapter" / "adapter_config.json").read_text() == (
        tmp_path / "adapter_config.json").read_text()
