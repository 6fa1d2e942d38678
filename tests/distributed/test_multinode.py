"""Several nodes: HSDP over 2 "nodes" x 2 ranks on this host, launched as two torchrun agents met by the
c10d rendezvous (``torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d``), trains like one process.

Shard within a node, replicate across nodes (``device_mesh(shard=LOCAL_WORLD_SIZE)``); each of the
4 ranks takes 1 row of every global step, the one-process reference all 4. fp32 on CPU (gloo):
the per-step losses, token counts, gradient norms, the trained tensors and the exported adapter
equal one process's up to the rounding of another summation order (token counts and
skips exactly). The multi-node recipe of docs/guides/multi-gpu.md itself (``ftlib sft --engine fsdp
--shard-size 2`` on the demo) gives the losses and the adapter of ``--engine none`` in one process.
"""

import json
import re
import subprocess
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
from _torchrun import _env, torchrun_nodes  # noqa: E402

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).with_name("_multinode_worker.py")
SFT = ("-m", "ftlib", "sft")  # the ftlib sft command: python -m ftlib sft, torchrun -m ftlib sft
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


def _step_losses(out: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and r.get("kind") in (None, "train")}


def test_example_recipe_on_two_nodes_trains_like_one_process(tmp_path):
    """The multi-node recipe of docs/guides/multi-gpu.md, as the user runs it: ``ftlib sft --engine fsdp
    --shard-size 2`` on 2 nodes x 2 ranks (1 row each) against ``--engine none`` in one process (4 rows),
    the demo's model and data, no dropout: the same per-step losses and the same adapter."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    common = ("--demo", "--max-steps", "3", "--save-every", "0", "--log-every", "1", "--num-proc", "1",
              "--num-workers", "0", "--lora-dropout", "0", "--eval-generate", "0")
    one, two = tmp_path / "one", tmp_path / "two"
    r = subprocess.run([sys.executable, *SFT, "--out", str(one), "--batch-size", "4", *common], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    outs = torchrun_nodes(*SFT, "--out", str(two), "--engine", "fsdp", "--shard-size", "2", "--batch-size", "1",
                          *common, nnodes=2, nproc=2, timeout=300)
    assert "fsdp on 4 rank(s), HSDP shard groups of 2" in "".join(outs)
    want, got = _step_losses(one), _step_losses(two)
    assert sorted(want) == sorted(got) == [1, 2, 3]
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-5 * loss, (step, got[step], loss)
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (two, one))
    assert set(a) == set(b) and len(b) > 0
    for k in b:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    init = torch.zeros(())  # the adapter moved: lora_B starts at zero
    assert any(not torch.equal(v, init.expand_as(v)) for k, v in b.items() if "lora_B" in k)


def test_a_failed_rank_ends_every_node_with_its_output():
    """One rank of node 1 exits while the others wait in a collective: the launch fails (an agent whose
    rank failed ends the job; the launcher kills every agent on the first failure, or at its timeout)
    and the failure shows each node's output, the failed rank's message included."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    with pytest.raises(AssertionError) as e:
        torchrun_nodes(Path(__file__).with_name("_multinode_fail_worker.py"), nnodes=2, nproc=2, timeout=240)
    msg = str(e.value)
    print(msg)
    assert re.search(r"_multinode_fail_worker.py on 2 nodes x 2: node \d exited with 1\n", msg), msg
    assert "--- node 0 (" in msg and "--- node 1 (" in msg, msg
    # rank 3 with its own message: from its agent's summary, or (that agent killed first, when the other
    # node's ranks failed sooner) from its log
    assert re.search(r"rank 3 \(local rank 1\): exit code 1 [^\n]*\n  \| rank 3 on node 1 gives up\n", msg) or re.search(
        r"local rank 1: still running[^\n]*\n(  \|[^\n]*\n)*?  \| rank 3 on node 1 gives up\n", msg), msg
