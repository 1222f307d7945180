"""Conv1d and RMSNorm: references vs transformers' Qwen3-Next code, Triton kernels vs references.

Without CUDA the Triton kernels run in the interpreter (tests/conftest.py), so shapes stay tiny;
the CUDA variants repeat the comparisons at model shapes in bf16.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchinfer.kernels import conv1d as tri_conv
from batchinfer.kernels.rmsnorm import rmsnorm as tri_norm
from batchinfer.kernels.ref import conv1d as ref_conv
from batchinfer.kernels.ref import norm as ref_norm
from tests.conftest import requires_cuda

# One path: the real kernels on CUDA, the Triton interpreter on CPU (tests/conftest.py). CPU tensors
# must never reach compiled Triton, so the device follows the machine, not a parameter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 2, 63, 64, 65]  # shorter than K-1, chunk boundaries, several sequences
SLOTS = [4, 0, 6, 2, 5]  # out of order, not all slots used


def _hf_conv(seq: torch.Tensor, history: torch.Tensor, weight, bias) -> torch.Tensor:
    """Independent ground truth: F.conv1d over (history | sequence), as transformers' causal_conv1d_fn."""
    window = torch.cat([history.float(), seq.float().t()], dim=-1)[None]  # [1, D, K-1+L]
    bias32 = bias.float() if bias is not None else None
    out = F.conv1d(window, weight.float()[:, None, :], bias32, groups=weight.shape[0])
    return F.silu(out[0]).t()  # [L, D]


def _conv_case(D=40, K=4, num_slots=8, dtype=torch.float32, device="cpu", seed=0, entry_major=False):
    """With `entry_major` the state is laid out as the pools store it (conv_state_zeros): a
    transposed view, channels contiguous; else contiguous [S, D, K-1]."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(LENGTHS)
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    weight = torch.randn(D, K, generator=gen).to(device, dtype)
    bias = torch.randn(D, generator=gen).to(device, dtype)
    state = torch.randn(num_slots, D, K - 1, generator=gen).to(device, dtype)  # non-zero history
    if entry_major:
        pool = ref_conv.conv_state_zeros(num_slots, D, K, dtype, device)
        pool.copy_(state)
        state = pool
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return x, weight, bias, state, torch.tensor(SLOTS, device=device), cu


@pytest.mark.parametrize("with_bias", [True, False])
def test_ref_conv_prefill_matches_full_convolution(with_bias):
    x, weight, bias, state, slots, cu = _conv_case()
    bias = bias if with_bias else None
    old = state.clone()
    out = ref_conv.causal_conv1d_prefill(x, weight, bias, state, slots, cu)
    for i, slot in enumerate(SLOTS):
        seq = x[cu[i]:cu[i + 1]]
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], _hf_conv(seq, old[slot], weight, bias), rtol=1e-5, atol=1e-5)
        expect_state = torch.cat([old[slot], seq.t()], dim=-1)[:, -3:]  # reaches into old state when L < 3
        torch.testing.assert_close(state[slot], expect_state, rtol=0, atol=0)
    untouched = [s for s in range(state.shape[0]) if s not in SLOTS]
    assert torch.equal(state[untouched], old[untouched])


def test_ref_conv_decode_continues_prefill():
    x, weight, bias, state, slots, cu = _conv_case()
    old = state.clone()
    ref_conv.causal_conv1d_prefill(x, weight, bias, state, slots, cu)
    steps = torch.randn(3, len(SLOTS), x.shape[1])
    outs = [ref_conv.causal_conv1d_decode(steps[s], weight, bias, state, slots) for s in range(3)]
    for i, slot in enumerate(SLOTS):
        seq = torch.cat([x[cu[i]:cu[i + 1]], steps[:, i]])
        expect = _hf_conv(seq, old[slot], weight, bias)[-3:]
        torch.testing.assert_close(torch.stack([o[i] for o in outs]), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("entry_major", [False, True])
@pytest.mark.parametrize("with_bias", [True, False])
def test_triton_conv_prefill_matches_reference(with_bias, entry_major):
    D = 40 if DEVICE == "cpu" else 2 * 16 * 128 + 48 * 128
    x, weight, bias, state, slots, cu = _conv_case(D=D, device=DEVICE, entry_major=entry_major)
    bias = bias if with_bias else None
    ref_state = state.clone()
    expect = ref_conv.causal_conv1d_prefill(x, weight, bias, ref_state, slots, cu)
    got = tri_conv.causal_conv1d_prefill(x, weight, bias, state, slots, cu)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


def test_triton_conv_prefill_with_shared_chunk_tables_matches_its_own():
    from batchinfer.kernels._common import ChunkTables

    x, weight, bias, state, slots, cu = _conv_case(D=40, device=DEVICE, entry_major=True)
    tables = ChunkTables(cu, x.shape[0])
    own_state, shared_state = state.clone(), state.clone()
    own = tri_conv.causal_conv1d_prefill(x, weight, bias, own_state, slots, cu)
    shared = tri_conv.causal_conv1d_prefill(x, weight, bias, shared_state, slots, cu, chunk_tables=tables)
    assert torch.equal(own, shared) and torch.equal(own_state, shared_state)
    assert list(tables._tables) == [tri_conv.DEFAULT_PREFILL_LAUNCH.block_t]


def test_triton_conv_prefill_strided_input_and_bf16_state():
    """x as a column slice of a wider projection (the model splits q|k|v|z), bf16 everywhere,
    the state in the pools' entry-major layout."""
    x, weight, bias, state, slots, cu = _conv_case(D=48, device=DEVICE, dtype=torch.bfloat16, entry_major=True)
    wide = torch.randn(x.shape[0], 80, device=DEVICE, dtype=torch.bfloat16)
    wide[:, 8:56] = x
    x_view = wide[:, 8:56]
    ref_state = state.clone()
    expect = ref_conv.causal_conv1d_prefill(x, weight, bias, ref_state, slots, cu)
    got = tri_conv.causal_conv1d_prefill(x_view, weight, bias, state, slots, cu)
    torch.testing.assert_close(got.float(), expect.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


@pytest.mark.parametrize("entry_major", [False, True])
@pytest.mark.parametrize("K, D, block_d", [(4, 40, 256), (4, 300, 128), (3, 33, 16), (2, 20, 16)])
def test_triton_conv_decode_matches_reference(K, D, block_d, entry_major):
    """Several channel blocks (D not a multiple of block_d), K-1 not a power of two, and
    untouched slots: the shifted state must equal the reference's exactly, in either layout."""
    x, weight, bias, state, slots, cu = _conv_case(D=D, K=K, device=DEVICE, entry_major=entry_major)
    ref_state = state.clone()
    launch = tri_conv.ConvLaunch(block_t=1, block_d=block_d, num_warps=4)
    for step in range(3):
        xt = torch.randn(len(SLOTS), D, device=DEVICE)
        expect = ref_conv.causal_conv1d_decode(xt, weight, bias, ref_state, slots)
        got = tri_conv.causal_conv1d_decode(xt, weight, bias, state, slots, launch)
        torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


@requires_cuda
def test_triton_conv_decode_bf16_model_shape():
    """The 27B preset's conv (10,240 channels, K = 4) at batch 256, bf16, strided input rows."""
    D, B = 10240, 256
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(D, 4, generator=gen).to("cuda", torch.bfloat16)
    state = ref_conv.conv_state_zeros(300, D, 4, torch.bfloat16, "cuda")  # the pools' layout
    state.copy_(torch.randn(300, D, 3, generator=gen))
    slots = torch.randperm(300, generator=gen)[:B].cuda()
    wide = torch.randn(B, D + 512, generator=gen).to("cuda", torch.bfloat16)
    xt = wide[:, 256:256 + D]  # a column view, as the in-projection's output is split
    ref_state = state.clone()
    expect = ref_conv.causal_conv1d_decode(xt, weight, None, ref_state, slots)
    got = tri_conv.causal_conv1d_decode(xt, weight, None, state, slots)
    torch.testing.assert_close(got.float(), expect.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


def _hf_norms():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    return Qwen3NextRMSNorm, Qwen3NextRMSNormGated


def test_ref_norms_match_transformers():
    rms_cls, gated_cls = _hf_norms()
    x, z = torch.randn(5, 3, 48), torch.randn(5, 3, 48)
    plain, gated = rms_cls(48, eps=1e-6), gated_cls(48, eps=1e-6)
    with torch.no_grad():
        plain.weight.normal_()
        gated.weight.normal_()
        torch.testing.assert_close(ref_norm.rms_norm(x, plain.weight, 1e-6), plain(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ref_norm.gated_rms_norm(x, z, gated.weight, 1e-6), gated(x, z), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [48, 100])  # power of two and not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_norms_match_reference(n, dtype):
    x = torch.randn(7, 3, n, device=DEVICE, dtype=dtype) * 3
    z = torch.randn(7, 3, n, device=DEVICE, dtype=dtype)
    weight = torch.randn(n, device=DEVICE)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(tri_norm.rms_norm(x, weight, 1e-6), ref_norm.rms_norm(x, weight, 1e-6), **tol)
    torch.testing.assert_close(
        tri_norm.gated_rms_norm(x, z, weight, 1e-6), ref_norm.gated_rms_norm(x, z, weight, 1e-6), **tol
    )


def test_triton_norm_on_strided_rows():
    """A row slice of a wider tensor (e.g. one half of a fused projection) normalises correctly."""
    wide = torch.randn(6, 96, device=DEVICE)
    x = wide[:, 16:80]
    weight = torch.randn(64, device=DEVICE)
    torch.testing.assert_close(tri_norm.rms_norm(x, weight, 1e-6), ref_norm.rms_norm(x, weight, 1e-6))


def test_triton_gated_norm_reads_a_strided_gate_in_place(monkeypatch):
    """The GDN gate z is a [T, heads, d] slice of the in-projection (row stride > heads·d): the
    kernel reads it through its strides, with no copy to rows first."""
    wide = torch.randn(5, 3 * 24 + 10, device=DEVICE)
    z = wide[:, 4:4 + 3 * 24].reshape(5, 3, 24)  # a view: token stride 82, head stride 24
    x = torch.randn(5, 3, 24, device=DEVICE) * 2
    weight = torch.randn(24, device=DEVICE)
    expect = ref_norm.gated_rms_norm(x, z, weight, 1e-6)

    real_kernel, gate_ptrs = tri_norm._rms_norm_kernel, []

    class Recording:  # the launcher indexes the kernel by its grid, then calls it
        def __getitem__(self, grid):
            def launch(x_arg, z_arg, *rest, **kw):
                gate_ptrs.append(z_arg.data_ptr())
                return real_kernel[grid](x_arg, z_arg, *rest, **kw)
            return launch

    monkeypatch.setattr(tri_norm, "_rms_norm_kernel", Recording())
    torch.testing.assert_close(tri_norm.gated_rms_norm(x, z, weight, 1e-6), expect, rtol=1e-5, atol=1e-5)
    assert gate_ptrs == [z.data_ptr()], "z was copied before the launch"


@requires_cuda
def test_triton_norm_model_width_bf16():
    x = torch.randn(333, 5120, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(5120, device="cuda") * 0.1
    got = tri_norm.rms_norm(x, weight, 1e-6).float()
    expect = ref_norm.rms_norm(x, weight, 1e-6).float()
    assert ((got - expect).norm() / expect.norm()).item() < 4e-3
