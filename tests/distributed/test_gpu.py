"""The distributed path on CUDA (run by benchmarks/gpu_check.sh): NCCL (one rank per GPU, at most 2), FSDP2
with bf16 mixed precision, a background sharded checkpoint through pinned host buffers, resume,
and both exports. The numbers are compared with the fp32 one-process run at bf16 tolerance."""

import json

import pytest
import torch
from _dist_common import STEPS
from conftest import reference, run_once

from ftlib.lora import load_adapter
from ftlib.models import load_pretrained

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def test_fsdp2_bf16_on_cuda(tmp_path_factory):
    nproc = min(2, torch.cuda.device_count())  # the loader keeps the global batch on 1 or 2 ranks
    out = run_once(tmp_path_factory, "ftlib-gpu", args=("gpu",), nproc=nproc, timeout=300) / "gpu"
    got = json.loads((out / "records.json").read_text())
    _, want, _ = reference("lora")
    assert len(got["records"]) == STEPS
    for g, w in zip(got["records"], want):
        assert g["tokens"] == w["tokens"] and not g["skipped"]
        assert abs(g["loss"] - w["loss"]) <= 1e-2 * w["loss"], (g["loss"], w["loss"])
    merged = load_pretrained(out / "merged")
    assert merged.lm_head.weight.dtype == torch.bfloat16
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    base = type(merged)(merged.config)  # an adapter applies to any model of the same shape
    load_adapter(base, out / "adapter", check_base=False)
