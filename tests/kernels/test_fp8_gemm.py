"""The FP8 block-scaled GEMM: activation quantization bit-exact against its reference, the
Triton GEMM against the fp32 dequantize-then-matmul reference (interpreter on the CPU)."""
import pytest
import torch

from batchinfer.kernels.fp8_gemm import (FP8_DTYPE, block_dequantize, block_quantize, fp8_gemm, fp8_gemm_reference,
                              quantize_act_reference)
from batchinfer.kernels.fp8_gemm.swapped import SwappedLaunch, default_splits, fp8_block_matmul_swapped
from batchinfer.kernels.fp8_gemm.triton_fp8 import Fp8GemmLaunch, fp8_block_matmul, quantize_act
from batchinfer.kernels.fp8_gemm.triton_fp8 import fp8_gemm as triton_fp8_gemm
from tests.conftest import interpreter_only, requires_cuda
from tests.sm90_child import sm90_child_output

SMALL = Fp8GemmLaunch(block_m=16, block_n=64, num_warps=4, num_stages=1, group_m=2)
# The kernels run where the tests run: the interpreter on the CPU, the GPU when there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Same quantized operands on both sides, only the summation order differs; Hopper's FP8
# tensor cores accumulate each 128-deep step at reduced precision, hence the looser GPU bound.
TOL = dict(rtol=1e-5, atol=1e-5) if DEVICE == "cpu" else dict(rtol=3e-3, atol=3e-3)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("M,K", [(7, 256), (5, 300), (1, 128)])
def test_quantize_act_is_bit_exact(M, K):
    g = torch.Generator().manual_seed(M * K)
    x = (torch.randn(M, K, generator=g) * 3).bfloat16().to(DEVICE)
    x[0, :7] = 0  # part of a group zero
    if K >= 256:
        x[-1, 128:256] = 0  # a whole group zero: the amax floor, not 0/0
    # Values whose rounding carries into the next binade (e.g. 124 → 128 after scaling).
    x[0, 10] = x[0].float().abs().max() * (124 / 448)
    q, s = quantize_act(x)
    q_ref, s_ref = quantize_act_reference(x)
    assert q.dtype == FP8_DTYPE and s.shape == (M, -(-K // 128))
    assert torch.equal(s, s_ref)
    assert torch.equal(_bits(q), _bits(q_ref))


def test_quantize_act_reads_row_strides():
    x = torch.randn(6, 512).bfloat16().to(DEVICE)
    view = x[:, 128:384]  # a column slice: row stride 512
    q, s = quantize_act(view)
    q_ref, s_ref = quantize_act_reference(view.contiguous())
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(s, s_ref)


def test_block_quantize_round_trip_within_e4m3_precision():
    w = torch.randn(3, 200, 300) * 0.02
    q, s = block_quantize(w)
    assert q.shape == w.shape and s.shape == (3, 2, 3)
    err = (block_dequantize(q, s) - w).abs()
    # e4m3 keeps 3 mantissa bits: half an ulp is at most 2^-4 of the value's binade top.
    assert (err <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()


@pytest.mark.parametrize("M,N,K", [(33, 200, 300), (1, 128, 256), (64, 96, 128)])
def test_fp8_gemm_matches_the_fp32_reference(M, N, K):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEVICE)
    w_q, w_s = block_quantize(torch.randn(N, K, generator=g).to(DEVICE) * K ** -0.5)
    ref = fp8_gemm_reference(x, w_q, w_s, torch.float32)
    out = triton_fp8_gemm(x, w_q, w_s, torch.float32, launch=SMALL)
    torch.testing.assert_close(out, ref, **TOL)
    # And the FP8 result is near the unquantized product (e4m3: ~2^-4 relative per operand).
    exact = x.float() @ block_dequantize(w_q, w_s).t()
    assert (ref - exact).abs().max() <= 0.1 * exact.abs().max()


def test_fp8_gemm_writes_every_output():
    M, N, K = 20, 136, 256  # ragged last row and column tiles
    x = torch.randn(M, K).bfloat16().to(DEVICE)
    w_q, w_s = block_quantize(torch.randn(N, K).to(DEVICE) * 0.1)
    xq, xs = quantize_act(x)
    out = torch.full((M, N), float("nan"), dtype=torch.float32, device=DEVICE)
    fp8_block_matmul(xq, xs, w_q, w_s, launch=SMALL, out=out)
    assert out.isfinite().all()
    torch.testing.assert_close(out, fp8_gemm_reference(x, w_q, w_s, torch.float32), **TOL)


def test_fp8_gemm_on_cpu_is_the_reference():
    x = torch.randn(4, 256).bfloat16()
    w_q, w_s = block_quantize(torch.randn(128, 256) * 0.1)
    out = fp8_gemm(x, w_q, w_s)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, fp8_gemm_reference(x, w_q, w_s))


def test_bad_scale_grid_is_refused():
    x = torch.randn(4, 256).bfloat16().to(DEVICE)
    w_q, w_s = block_quantize(torch.randn(128, 256).to(DEVICE))
    with pytest.raises(AssertionError, match="one per 128x128 block"):
        triton_fp8_gemm(x, w_q, w_s[:, :1], launch=SMALL)


SM90_CHILD = """
from benchmarks.bench_fp8_gemm import compile_sm90, compile_swapped_sm90
from batchinfer.kernels.fp8_gemm.swapped import default_launch as swapped_launch
from batchinfer.kernels.fp8_gemm.triton_fp8 import default_launch
import re
wgmma = lambda kernel: bool(re.search(r"wgmma\\.mma_async[^\\n]*e4m3", kernel.asm["ptx"]))
print("cvt.rn.satfinite.e4m3x2" in compile_sm90(None).asm["ptx"])
for M in (256, 8192):  # e4m3 tensor-core products (wgmma) at the decode and prefill launches
    print(wgmma(compile_sm90(default_launch(M, 5120, 5120))))
kernel = compile_swapped_sm90(swapped_launch(5120), 32, splits=4)  # the decode default, K split
print(wgmma(kernel), "atom.global.gpu.acq_rel" in kernel.asm["ptx"])
"""


def test_kernels_compile_for_sm90():
    """The interpreter runs code the compiler refuses (e.g. a plain global read in a kernel):
    compile the kernels for sm_90a offline, in a child without the interpreter."""
    assert sm90_child_output(SM90_CHILD).split() == ["True"] * 5


@pytest.mark.parametrize("M,N,K,launch", [
    (5, 256, 512, SwappedLaunch(128, num_stages=1, splits=1)),
    (17, 200, 300, SwappedLaunch(64, num_stages=1, splits=1)),  # ragged last weight tile and K group
    (3, 384, 1024, SwappedLaunch(128, num_stages=1, splits=4)),  # K split, whole steps a split
    (33, 136, 640, SwappedLaunch(64, num_stages=1, splits=2)),  # K split, the last split short
])
def test_swapped_gemm_matches_the_fp32_reference(M, N, K, launch):
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).bfloat16().to(DEVICE)
    w_q, w_s = block_quantize(torch.randn(N, K, generator=g).to(DEVICE) * K ** -0.5)
    xq, xs = quantize_act(x)
    out = torch.full((M, N), float("nan"), dtype=torch.float32, device=DEVICE)
    fp8_block_matmul_swapped(xq, xs, w_q, w_s, launch=launch, out=out)
    assert out.isfinite().all()
    torch.testing.assert_close(out, fp8_gemm_reference(x, w_q, w_s, torch.float32), **TOL)


def test_swapped_gemm_splits_fill_the_sms_and_keep_long_k_steps():
    assert default_splits(272, 40, 132) == 1  # the 27B's gate|up: 272 weight tiles of 128
    assert default_splits(40, 136, 132) == 4  # its down: 40 tiles, 136 K steps
    assert default_splits(40, 48, 132) == 4  # o_proj / out_proj: 12 steps a split
    assert default_splits(40, 16, 132) == 2  # no split shorter than 8 steps
    assert default_splits(40, 8, 132) == 1


@interpreter_only
def test_fp8_gemm_runs_the_swapped_gemm_for_few_rows_on_sm90(monkeypatch):
    """Dispatch on a (pretend) sm_90 device: up to SWAPPED_MAX_ROWS rows the swapped GEMM, above
    them cuBLAS; BATCHINFER_FP8_GEMM=cublas sends every row count to cuBLAS."""
    import batchinfer.kernels.fp8_gemm as fp8
    from batchinfer.kernels.fp8_gemm import cublas_fp8, swapped

    monkeypatch.setattr(fp8, "_use_triton", lambda x: True)
    monkeypatch.setattr(swapped, "swapped_available", lambda device: True)
    monkeypatch.setattr(cublas_fp8, "available", lambda device: True)
    cublas_calls: list[int] = []
    monkeypatch.setattr(cublas_fp8, "block_scaled_mm", _fake_block_scaled_mm(cublas_calls))
    swapped_calls: list[int] = []
    real = swapped.fp8_block_matmul_swapped
    monkeypatch.setattr(swapped, "fp8_block_matmul_swapped",
                        lambda xq, *args, **kwargs: swapped_calls.append(xq.shape[0]) or real(xq, *args, **kwargs))
    monkeypatch.setattr(swapped, "SWAPPED_MAX_ROWS", 8)
    g = torch.Generator().manual_seed(5)
    w_q, w_s = block_quantize(torch.randn(256, 512, generator=g) * 512 ** -0.5)
    for M in (8, 9):
        x = torch.randn(M, 512, generator=g).bfloat16()
        torch.testing.assert_close(fp8.fp8_gemm(x, w_q, w_s, torch.float32),
                                   fp8_gemm_reference(x, w_q, w_s, torch.float32), rtol=1e-5, atol=1e-5)
    assert swapped_calls == [8] and cublas_calls == [12]
    monkeypatch.setenv("BATCHINFER_FP8_GEMM", "cublas")
    fp8.fp8_gemm(torch.randn(3, 512, generator=g).bfloat16(), w_q, w_s)
    assert swapped_calls == [8] and cublas_calls == [12, 4]


@requires_cuda
def test_swapped_gemm_matches_the_reference_on_gpu_and_in_a_graph():
    """At the 27B's decode shapes, K split or not, eagerly and as CUDA-graph replays (the split
    counts are zeroed by every call, so a replay finds them as the first call did)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K in [(1, 256, 512), (32, 5120, 17408), (128, 34816, 5120), (37, 5120, 6144)]:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w_q, w_s = block_quantize(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        xq, xs = quantize_act(x)
        ref = fp8_gemm_reference(x, w_q, w_s, torch.float32)
        for launch in (None, SwappedLaunch(64), SwappedLaunch(128, splits=1)):
            out = fp8_block_matmul_swapped(xq, xs, w_q, w_s, torch.float32, launch=launch)
            torch.testing.assert_close(out, ref, rtol=3e-3, atol=3e-3)
        out = torch.full((M, N), float("nan"), device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fp8_block_matmul_swapped(xq, xs, w_q, w_s, out=out)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.testing.assert_close(out, ref, rtol=3e-3, atol=3e-3)


@pytest.mark.parametrize("shape", [(3, 256, 384), (200, 300)])
def test_triton_dequantize_is_bit_exact(shape):
    from batchinfer.kernels.fp8_gemm.triton_fp8 import block_dequantize as triton_block_dequantize
    w_q, w_s = block_quantize(torch.randn(shape).to(DEVICE) * 0.3)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(triton_block_dequantize(w_q, w_s, dtype), block_dequantize(w_q, w_s, dtype))


def test_quantize_act_pads_rows_and_transposes_scales_for_cublas():
    x = (torch.randn(5, 512) * 2).bfloat16().to(DEVICE)
    q, s = quantize_act(x, rows=8, scales_transposed=True)
    q_ref, s_ref = quantize_act_reference(x)
    assert q.shape == (8, 512) and s.shape == (8, 4) and s.stride() == (1, 8)  # [G, R] buffer, viewed [R, G]
    assert torch.equal(_bits(q[:5]), _bits(q_ref)) and torch.equal(s[:5], s_ref)
    assert torch.equal(q[5:].float().cpu(), torch.zeros(3, 512)) and torch.equal(s[5:].cpu(), torch.ones(3, 4))


def _fake_block_scaled_mm(calls):
    """cuBLAS's contract, checked, computed by the reference (the GPU test runs the real one)."""
    def fake(xq, x_scale_t, weight, scale_inv, out_dtype):
        M4, K = xq.shape
        assert M4 % 4 == 0 and x_scale_t.shape == (K // 128, M4) and x_scale_t.is_contiguous()
        calls.append(M4)
        deq_x = (xq.float().reshape(M4, K // 128, 128) * x_scale_t.t()[:, :, None]).reshape(M4, K)
        return (deq_x @ block_dequantize(weight, scale_inv).t()).to(out_dtype)
    return fake


@interpreter_only
def test_fp8_gemm_takes_the_cublas_path_and_falls_back_to_triton(monkeypatch):
    """Dispatch on a (pretend) sm_90 device: 4-aligned K blocks go to cuBLAS with padded rows and
    transposed scales; a cuBLAS failure falls back to the Triton GEMM, right, and sticks; running
    out of memory is raised, not taken for a failure."""
    import batchinfer.kernels.fp8_gemm as fp8
    from batchinfer.kernels.fp8_gemm import cublas_fp8

    monkeypatch.setattr(fp8, "_use_triton", lambda x: True)
    monkeypatch.setattr(cublas_fp8, "available", lambda device: str(device) not in cublas_fp8._BROKEN)
    monkeypatch.setattr(cublas_fp8, "_BROKEN", set())
    calls: list[int] = []
    monkeypatch.setattr(cublas_fp8, "block_scaled_mm", _fake_block_scaled_mm(calls))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 512, generator=g).bfloat16()
    w_q, w_s = block_quantize(torch.randn(256, 512, generator=g) * 512 ** -0.5)
    ref = fp8_gemm_reference(x, w_q, w_s, torch.float32)
    out = fp8.fp8_gemm(x, w_q, w_s, torch.float32)
    assert calls == [8] and out.shape == (7, 256)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(3, 384, generator=g).bfloat16()  # K/128 = 3: not cuBLAS's layout → Triton
    w3_q, w3_s = block_quantize(torch.randn(128, 384, generator=g) * 0.05)
    torch.testing.assert_close(fp8.fp8_gemm(x3, w3_q, w3_s, torch.float32),
                               fp8_gemm_reference(x3, w3_q, w3_s, torch.float32), rtol=1e-5, atol=1e-5)
    assert calls == [8]

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.12 GiB")
    monkeypatch.setattr(cublas_fp8, "block_scaled_mm", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):  # not a broken cuBLAS: no fallback, nothing marked
        fp8.fp8_gemm(x, w_q, w_s, torch.float32)
    assert cublas_fp8._BROKEN == set()

    def failing(*args):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    monkeypatch.setattr(cublas_fp8, "block_scaled_mm", failing)
    torch.testing.assert_close(fp8.fp8_gemm(x, w_q, w_s, torch.float32), ref, rtol=1e-5, atol=1e-5)
    assert cublas_fp8._BROKEN == {"cpu"}
    monkeypatch.setenv("BATCHINFER_FP8_GEMM", "cublas")
    monkeypatch.setattr(cublas_fp8, "_BROKEN", set())
    with pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        fp8.fp8_gemm(x, w_q, w_s, torch.float32)


@requires_cuda
def test_cublas_block_scaled_gemm_matches_the_reference_on_gpu():
    from batchinfer.kernels.fp8_gemm import cublas_fp8

    device = torch.device("cuda")
    if not cublas_fp8.available(device):
        pytest.skip("no block-scaled scaled_mm on this GPU / torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K in [(1, 256, 512), (255, 640, 5120), (8192, 1024, 2048)]:
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w_q, w_s = block_quantize(torch.randn(N, K, device="cuda", generator=g) * K ** -0.5)
        xq, xs = quantize_act(x, rows=cublas_fp8.padded_rows(M), scales_transposed=True)
        out = cublas_fp8.block_scaled_mm(xq, xs.t(), w_q, w_s, torch.float32)[:M]
        torch.testing.assert_close(out, fp8_gemm_reference(x, w_q, w_s, torch.float32), rtol=3e-3, atol=3e-3)
