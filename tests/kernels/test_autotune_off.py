"""Autotuning off (FTLIB_LORA_AUTOTUNE=0 / FTLIB_ATTN_AUTOTUNE=0) times nothing, on every Triton version.

The launchers' autotuners are built as on a GPU (not the interpreter's key-less ones), around a stub
kernel that records its launches, with an H200 emulated (sm_90, 227 KiB of shared memory per block).
The device benchmarker (``driver.active.get_benchmarker()``, Triton's ``do_bench``) is replaced by a
counter. With autotuning off the prune leaves one configuration; Triton 3.9 takes it untimed, Triton 3.6
timed it anyway (one ``do_bench`` per kernel and key) unless the autotuner is given a ``do_bench`` of
its own: these tests hold both to zero calls and exactly one launch per call.
"""

from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")
autotuner = pytest.importorskip("triton.runtime.autotuner")

H200_SMEM = 232448


class _Stub:
    """Stands in for a @triton.jit kernel: the real one's argument names, ``run`` records the launch."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names
        self.fn = kernel.fn
        self.launches = []

    def run(self, *args, **kwargs):
        self.launches.append({k: v for k, v in kwargs.items() if k.isupper()})


@pytest.fixture
def bench_calls(monkeypatch):
    calls = []

    def do_bench(kernel_call, quantiles=None, **kw):
        calls.append(1)
        kernel_call()
        return [1.0, 1.0, 1.0]

    fake = SimpleNamespace(active=SimpleNamespace(get_benchmarker=lambda: do_bench))
    monkeypatch.setattr(autotuner, "driver", fake)
    return calls


# GPU-sized tile lists (under the interpreter the launchers' own lists hold one small tile each)
_TILES = {
    "down": [((64, 64), 4, 2), ((128, 64), 8, 2), ((32, 64), 4, 2)],  # (BLOCK_M, BLOCK_K)
    "fwd": [((128, 64), 8, 2), ((64, 64), 4, 2), ((64, 32), 4, 2)],  # attention (BLOCK_M, BLOCK_N)
}


def _tuned(module, kind, monkeypatch, blocks):
    configs = [triton.Config(dict(zip(blocks, b)), num_warps=w, num_stages=s) for b, w, s in _TILES[kind]]
    monkeypatch.setattr(module, "_INTERPRET", False)  # the GPU path's autotuner: keys and a prune
    monkeypatch.setattr(module, "_AUTOTUNE", False)
    monkeypatch.setattr(module, "_smem_budget", lambda: H200_SMEM)
    monkeypatch.setattr(module.torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(module.CONFIGS if hasattr(module, "CONFIGS") else module._CONFIGS, kind, configs)
    stub = _Stub(module.KERNELS[kind])
    return module._autotune(configs, kind)(stub), stub


def test_lora_autotune_off_times_nothing(monkeypatch, bench_calls):
    from ftlib.kernels import lora_triton as lt

    tuned, stub = _tuned(lt, "down", monkeypatch, ("BLOCK_M", "BLOCK_K"))
    for m_bucket, r in ((1024, 16), (2048, 16), (1024, 64)):  # three keys: three new tunings on 3.6
        meta = dict(M_BUCKET=m_bucket, K=4096, R=r, BLOCK_R=r, DROPOUT=False, WRITE_H=False, PRECISION="tf32")
        tuned.run(grid=(1,), warmup=False, **meta)
    assert len(bench_calls) == 0, f"{len(bench_calls)} do_bench calls with FTLIB_LORA_AUTOTUNE=0"
    assert len(stub.launches) == 3  # the launches themselves, nothing more
    first = lt.tile_configs("down", meta, H200_SMEM)[0][0]
    assert all(launch["BLOCK_M"] == first.kwargs["BLOCK_M"] for launch in stub.launches)


def test_attention_autotune_off_times_nothing(monkeypatch, bench_calls):
    from ftlib.kernels import attention_triton as at

    tuned, stub = _tuned(at, "fwd", monkeypatch, ("BLOCK_M", "BLOCK_N"))
    for d, causal in ((128, True), (64, False)):
        tuned.run(grid=(1,), warmup=False, BLOCK_D=d, CAUSAL=causal, IS_VARLEN=True, PRECISION="tf32")
    assert len(bench_calls) == 0, f"{len(bench_calls)} do_bench calls with FTLIB_ATTN_AUTOTUNE=0"
    assert len(stub.launches) == 2
