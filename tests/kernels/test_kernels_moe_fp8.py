"""FP8 routed experts as grouped FP8 GEMMs (kernels/moe_fp8): the row tiles, the Triton kernel
(the interpreter on the CPU) against the fp32 reference at tiny shapes, and a tiny FP8 MoE
model's logits with the grouped FP8 path against its dequantized path."""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import ops
from batchinfer.kernels.fp8_gemm.reference import block_dequantize, block_quantize
from batchinfer.kernels.moe_fp8 import grouped_gemm
from batchinfer.kernels.moe_fp8.grouped_gemm import KernelLaunch, MoeFp8Launch, default_launch
from batchinfer.kernels.moe_fp8.grouped_gemm import moe_fp8 as triton_moe_fp8
from batchinfer.kernels.moe_fp8.tiles import expert_tiles
from batchinfer.kernels.ref.moe_fp8 import SharedExpert
from batchinfer.kernels.ref.moe_fp8 import moe_fp8 as reference_moe_fp8
from tests.conftest import interpreter_only, requires_cuda
from tests.sm90_child import sm90_child_output

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, H, I = 4, 256, 128  # gate|up is [E, 256, 256]: N = K = 256
# Rows per expert: uneven, a zero-token expert inside and at either end, tiles with padding.
COUNTS = [[17, 0, 5, 18], [0, 9, 31, 0], [1, 1, 1, 1]]
LAUNCHES = [MoeFp8Launch.same(block_m=16, block_n_down=64, num_warps=4, num_stages=1),
            MoeFp8Launch.same(block_m=32, block_n_down=128, num_warps=4, num_stages=1),
            MoeFp8Launch.same(block_m=16, block_n_down=64, num_warps=4, num_stages=1, columns_fastest=False),
            # Each kernel its own row tiles (the down kernel's table built inside), a down tile over two weight blocks.
            MoeFp8Launch(KernelLaunch(32, 4, 1), KernelLaunch(16, 4, 1), block_n_down=256),
            # The weights on the dots' M side (`swapped.py`): one table, and each kernel its own with a wide down tile.
            MoeFp8Launch.same(block_m=16, block_n_down=64, num_warps=4, num_stages=1, swap_ab=True),
            MoeFp8Launch(KernelLaunch(32, 4, 1), KernelLaunch(16, 4, 1), block_n_down=256, swap_ab=True)]
LAUNCH_IDS = ["m16n64", "m32n128", "m16n64-rows-fastest", "m32-down-m16n256", "swap-m16n64", "swap-m32-down-m16n256"]


def _inputs(counts: list[int], seed: int, T: int = 23, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H, generator=g) * 2).to(dtype)
    w13, s13 = block_quantize(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5)
    w2, s2 = block_quantize(torch.randn(E, H, I, generator=g) * I ** -0.5)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    token_of = torch.randint(0, T, (sum(counts),), generator=g)
    return tuple(t.to(DEVICE) for t in (x, token_of, ends, w13, s13, w2, s2))


def _unquantized(x, token_of, ends, w13, s13, w2, s2) -> torch.Tensor:
    """The same experts in fp32 without any activation quantization: what FP8 approximates."""
    y = torch.zeros(token_of.shape[0], H)
    start = 0
    for e, end in enumerate(ends.tolist()):
        a = x.float().cpu()[token_of.cpu()[start:end]]
        gate, up = (a @ block_dequantize(w13[e], s13[e]).cpu().t()).chunk(2, dim=-1)
        y[start:end] = (torch.nn.functional.silu(gate) * up) @ block_dequantize(w2[e], s2[e]).cpu().t()
        start = end
    return y


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_tiles_cover_every_row_once_within_one_expert(counts, block_m):
    ends = torch.tensor(counts).cumsum(0)
    tiles = expert_tiles(ends, sum(counts), block_m)
    seen = []
    starts = [0] + ends.tolist()[:-1]
    for expert, start, end in zip(tiles.expert.tolist(), tiles.start.tolist(), tiles.end.tolist()):
        if end <= start:
            continue
        assert starts[expert] <= start < end == ends[expert], (expert, start, end)
        seen += range(start, min(start + block_m, end))
    assert seen == list(range(sum(counts)))


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_kernel_matches_the_fp32_reference(counts, launch):
    args = _inputs(counts, seed=sum(counts) + launch.gate_up.block_m)
    out = torch.full((sum(counts), H), float("nan"), device=DEVICE)
    result = triton_moe_fp8(*args, launch=launch, out=out)
    assert result is out and out.isfinite().all()  # every routed row written
    ref = reference_moe_fp8(*args, launch=launch)
    # The same quantized operands on both sides; the kernel's fp32 sums run in another order, which
    # rarely moves a silu·up value across an e4m3 rounding boundary (one e4m3 step, 2^-3 relative).
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    # And FP8 is near the unquantized experts (e4m3: ~2^-4 relative per operand).
    exact = _unquantized(*args)
    assert (ref.cpu() - exact).abs().max() <= 0.1 * exact.abs().max()


def _shared_expert(seed: int) -> SharedExpert:
    g = torch.Generator().manual_seed(seed)
    w13, s13 = block_quantize(torch.randn(2 * I, H, generator=g) * H ** -0.5)
    w2, s2 = block_quantize(torch.randn(H, I, generator=g) * I ** -0.5)
    return SharedExpert(*(t.to(DEVICE) for t in (w13, s13, w2, s2)))


@pytest.mark.parametrize("counts", COUNTS[:2] + [[0, 0, 0, 0]])
@pytest.mark.parametrize("launch", LAUNCHES, ids=LAUNCH_IDS)
def test_shared_expert_rows_follow_the_routed_rows(counts, launch):
    """Row M + t is token t through the shared expert (every token once, no table of its own):
    against the reference, and against the routed rows of the same expert placed in the table."""
    x, token_of, ends, w13, s13, w2, s2 = _inputs(counts, seed=7 + sum(counts))
    shared = _shared_expert(seed=3)
    T, M = x.shape[0], sum(counts)
    out = torch.full((M + T, H), float("nan"), device=DEVICE)
    triton_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch, out=out, shared=shared)
    assert out.isfinite().all()  # every routed and shared row written
    ref = reference_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch, shared=shared)
    assert ref.shape == (M + T, H)
    torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())
    # The shared rows are the rows a routed expert with these weights gives every token, in token order.
    as_routed = triton_moe_fp8(x, torch.arange(T, device=DEVICE), torch.full((1,), T, dtype=torch.int32, device=DEVICE),
                               shared.w13[None], shared.s13[None], shared.w2[None], shared.s2[None], launch=launch)
    torch.testing.assert_close(out[M:], as_routed, rtol=0, atol=0)
    torch.testing.assert_close(out[:M], triton_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch),
                               rtol=0, atol=0)  # the routed rows as without the shared expert


W8A16_LAUNCHES = [MoeFp8Launch.same(block_m=16, num_warps=4, num_stages=1, w8a16=True),
                  MoeFp8Launch.same(block_m=32, num_warps=4, num_stages=1, columns_fastest=False, w8a16=True),
                  MoeFp8Launch(KernelLaunch(32, 4, 1), KernelLaunch(16, 4, 1), block_n_down=256, w8a16=True),
                  MoeFp8Launch.same(block_m=16, num_warps=4, num_stages=1, w8a16=True, fp16_dots=True),
                  MoeFp8Launch(KernelLaunch(32, 4, 1), KernelLaunch(16, 4, 1), block_n_down=256, w8a16=True,
                               fp16_dots=True)]


@pytest.mark.parametrize("counts", COUNTS + [[0, 0, 0, 0]])
@pytest.mark.parametrize("launch", W8A16_LAUNCHES, ids=["m16", "m32-rows-fastest", "m32-down-m16n256", "m16-fp16",
                                                        "m32-down-m16n256-fp16"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_w8a16_kernels_match_the_reference(counts, launch, with_shared):
    """Activations unquantized, weights dequantized in the kernel: the same maths as the reference
    up to the order of fp32 sums; every routed and shared row written."""
    x, token_of, ends, w13, s13, w2, s2 = _inputs(counts, seed=11 + sum(counts))
    shared = _shared_expert(seed=4) if with_shared else None
    rows = sum(counts) + (x.shape[0] if with_shared else 0)
    out = torch.full((rows, H), float("nan"), device=DEVICE)
    triton_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch, out=out, shared=shared)
    assert out.isfinite().all()
    ref = reference_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch, shared=shared)
    assert ref.shape == out.shape == (rows, H)
    if rows:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # W8A16 is the dequantized experts on unquantized activations: nearer them than W8A8.
    if sum(counts):
        exact = _unquantized(x, token_of, ends, w13, s13, w2, s2)
        w8a8 = reference_moe_fp8(x, token_of, ends, w13, s13, w2, s2)[:sum(counts)].cpu()
        assert (ref[:sum(counts)].cpu() - exact).abs().max() < 0.1 * (w8a8 - exact).abs().max()


@requires_cuda  # Triton's interpreter miscomputes bf16 dots (fp16 and fp32 ones are right)
def test_w8a16_in_bf16_rounds_as_the_dequantized_bf16_weights():
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("no bf16 tensor cores")
    x, token_of, ends, w13, s13, w2, s2 = _inputs([9, 3, 0, 14], seed=21, dtype=torch.bfloat16)
    launch = W8A16_LAUNCHES[0]
    out = triton_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch)
    ref = reference_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=launch)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7 * ref.float().abs().max().item())


def test_kernel_reads_only_routed_experts_and_writes_x_dtype():
    x, token_of, ends, w13, s13, w2, s2 = _inputs([12, 0, 20, 7], seed=5, dtype=torch.bfloat16)
    s13[1], s2[1] = float("nan"), float("nan")  # the zero-token expert: never read
    out = triton_moe_fp8(x, token_of, ends, w13, s13, w2, s2, launch=LAUNCHES[0])
    assert out.dtype == torch.bfloat16 and out.shape == (39, H) and out.isfinite().all()
    ref = reference_moe_fp8(x, token_of, ends, w13, s13, w2, s2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=3e-2, atol=3e-2 * ref.float().abs().max().item())


def test_no_routed_rows_launches_nothing():
    x, _, _, w13, s13, w2, s2 = _inputs([1, 1, 1, 1], seed=0)
    out = triton_moe_fp8(x, torch.zeros(0, dtype=torch.int64, device=DEVICE),
                         torch.zeros(E, dtype=torch.int32, device=DEVICE), w13, s13, w2, s2)
    assert out.shape == (0, H)


def test_the_down_kernel_runs_on_the_tiles_it_is_given(monkeypatch):
    """The layout's down tiles (`ops.moe_align`'s second table) replace the ones built inside:
    the same rows bit for bit, no table built; tiles of another size are refused."""
    launch = LAUNCHES[3]  # gate|up on 32-row tiles, down on 16
    args = _inputs(COUNTS[0], seed=5)
    built_inside = triton_moe_fp8(*args, launch=launch)
    M, ends = sum(COUNTS[0]), args[2]
    up, down = expert_tiles(ends, M, 32), expert_tiles(ends, M, 16)
    monkeypatch.setattr(grouped_gemm, "expert_tiles", lambda *a: pytest.fail("a tile table built inside"))
    assert torch.equal(triton_moe_fp8(*args, launch=launch, tiles=up, down_tiles=down), built_inside)
    with pytest.raises(AssertionError, match="down tiles of another row-tile size"):
        triton_moe_fp8(*args, launch=launch, tiles=up, down_tiles=up)


def test_default_launch_tiles_decode_rows_small(monkeypatch):
    # Qwen3.5-35B-A3B decode: 256 / 1024 tokens x top-8 over 256 experts; prefill chunks.
    monkeypatch.delenv("BATCHINFER_MOE_PREFILL_LAUNCH", raising=False)
    monkeypatch.delenv("BATCHINFER_MOE_DECODE_LAUNCH", raising=False)
    # 8 rows an expert: 16-row tiles with the weights on the dots' M side (e4m3 wgmma at 16 rows)
    assert default_launch(256 * 8, 256) == MoeFp8Launch.same(16, 4, 3, swap_ab=True)
    assert default_launch(768 * 8, 256) == MoeFp8Launch.same(16, 4, 3, swap_ab=True)  # 24 rows an expert
    assert default_launch(1024 * 8, 256) == MoeFp8Launch.same(32, 4, 3, swap_ab=True)  # 32: measured fastest
    assert default_launch(1536 * 8, 256) == MoeFp8Launch.same(64, 8, 4)  # 48: 64-row tiles win again
    assert default_launch(2048 * 8, 256) == MoeFp8Launch.same(64, 8, 4)
    wide = default_launch(8192 * 8, 256)  # 256 rows an expert: gate|up on 128-row tiles, down on 64
    assert wide == MoeFp8Launch(KernelLaunch(128, 16, 3), KernelLaunch(64, 8, 4))
    assert default_launch(32768 * 8, 256) == wide


def test_the_prefill_launch_switch_leaves_decode_alone(monkeypatch):
    monkeypatch.setenv("BATCHINFER_MOE_PREFILL_LAUNCH", "64:8:4")
    assert default_launch(32768 * 8, 256) == MoeFp8Launch.same(64, 8, 4)
    assert default_launch(256 * 8, 256) == MoeFp8Launch.same(16, 4, 3, swap_ab=True)  # decode keeps its launch
    monkeypatch.setenv("BATCHINFER_MOE_PREFILL_LAUNCH", "64:8")
    with pytest.raises(ValueError, match="'64:8'"):
        default_launch(32768 * 8, 256)


def test_the_decode_launch_switch_leaves_prefill_alone(monkeypatch):
    monkeypatch.delenv("BATCHINFER_MOE_PREFILL_LAUNCH", raising=False)
    monkeypatch.setenv("BATCHINFER_MOE_DECODE_LAUNCH", "16:4:2")
    assert default_launch(256 * 8, 256) == MoeFp8Launch.same(16, 4, 2)
    assert default_launch(1024 * 8, 256) == MoeFp8Launch.same(16, 4, 2)  # every decode-sized step
    assert default_launch(2048 * 8, 256) == MoeFp8Launch.same(64, 8, 4)  # wider steps keep theirs
    with pytest.raises(ValueError, match="unknown suffix"):
        monkeypatch.setenv("BATCHINFER_MOE_DECODE_LAUNCH", "16:4:3+swapped")
        default_launch(256 * 8, 256)


def test_ops_dispatches_moe_fp8():
    assert ops.implementation("moe_fp8", True) is triton_moe_fp8
    assert ops.implementation("moe_fp8", False) is reference_moe_fp8


# -- the model: a tiny FP8 MoE (every layer MoE, 4 experts top-2, hidden 128, experts 128 wide).

def _tiny_fp8_moe():
    from batchinfer.models.config import model_config_from_dict
    from batchinfer.models.fp8_model import random_fp8_model
    from batchinfer.models.presets import PRESETS

    raw = {**PRESETS["tiny"], "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
           "linear_value_head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
           "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    raw.pop("rope_parameters")
    return random_fp8_model(model_config_from_dict(raw), torch.float32, "cpu", seed=1)


def _logits(model) -> torch.Tensor:
    from tests.model_utils import PackedDriver

    driver = PackedDriver(model, num_state_slots=2, num_kv_slots=64)
    driver.add(0, 1)
    driver.add(1, 0)
    prefill = driver.prefill({0: [5, 17, 200, 3, 99, 42, 7], 1: [1, 2, 3]}, all_logits=True)
    decode = driver.decode({0: 11, 1: 12})
    return torch.cat([prefill[0], prefill[1], decode[0][None], decode[1][None]])


@interpreter_only
def test_tiny_fp8_moe_logits_grouped_fp8_vs_dequantized(monkeypatch):
    from batchinfer.models.layers import mlp
    from batchinfer.models.layers.fp8_linear import Fp8Weight

    model = _tiny_fp8_moe()
    moe = model.layers[0].mlp
    assert isinstance(moe.experts_gate_up, Fp8Weight) and isinstance(moe.experts_down, Fp8Weight)
    # The shared expert's projections run the dense FP8 GEMM.
    assert isinstance(moe.shared_expert.gate_up, Fp8Weight) and isinstance(moe.shared_expert.down, Fp8Weight)
    assert mlp._grouped_fp8_op(torch.empty(1)) is None  # the CPU path stays the dequantized one
    dequantized = _logits(model)

    calls = []
    kernel = ops.implementation("moe_fp8", True)
    monkeypatch.setattr(mlp, "_grouped_fp8_op", lambda x: lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    grouped = _logits(model)
    monkeypatch.setattr(mlp, "_grouped_fp8_op", lambda x: ops.implementation("moe_fp8", False))
    reference = _logits(model)

    assert len(calls) == 2 * model.config.num_layers  # one prefill and one decode call per layer
    assert grouped.isfinite().all() and not torch.equal(grouped, dequantized)
    # Only the activations' e4m3 rounding (~3% per element) separates FP8 from the dequantized path.
    assert (grouped - dequantized).abs().max() / dequantized.abs().max() < 0.05
    torch.testing.assert_close(grouped, reference, rtol=1e-4, atol=1e-4 * reference.abs().max().item())
    assert (grouped.argmax(-1) == dequantized.argmax(-1)).float().mean() >= 0.8


@interpreter_only
def test_tiny_fp8_moe_layer_hands_its_layouts_down_tiles_to_the_kernel(monkeypatch):
    """Where gate|up and down take different row tiles (the prefill default's 128 / 64), both
    tables come from the layer's layout, none is built in the kernel, and the logits are those of
    one tile size."""
    from batchinfer.models.layers import mlp

    model = _tiny_fp8_moe()
    kernel = ops.implementation("moe_fp8", True)
    monkeypatch.setattr(mlp, "_grouped_fp8_op", lambda x: kernel)
    one_size = _logits(model)
    monkeypatch.setattr(grouped_gemm, "default_launch",
                        lambda rows, experts: MoeFp8Launch(KernelLaunch(32, 4, 1), KernelLaunch(16, 4, 1)))
    monkeypatch.setattr(grouped_gemm, "expert_tiles", lambda *a: pytest.fail("a tile table built in the kernel"))
    two_sizes = _logits(model)
    assert two_sizes.isfinite().all()
    torch.testing.assert_close(two_sizes, one_size, rtol=1e-5, atol=1e-5 * one_size.abs().max().item())


@interpreter_only
def test_tiny_fp8_moe_logits_with_the_shared_expert_in_the_grouped_kernel(monkeypatch):
    """BATCHINFER_MOE_SHARED_IN_GROUPED=all: the shared expert rides in the grouped kernel's launches
    (its dense FP8 GEMMs not called); the logits stay those of the separate shared expert within
    the rounding the fused path skips (its gate|up output is not rounded to the activation dtype)."""
    from batchinfer.models.layers import fp8_linear, mlp

    model = _tiny_fp8_moe()
    kernel = ops.implementation("moe_fp8", True)
    monkeypatch.setattr(mlp, "_grouped_fp8_op", lambda x: kernel)
    separate = _logits(model)
    dense_calls = []
    real_gemm = fp8_linear.fp8_gemm
    monkeypatch.setattr(fp8_linear, "fp8_gemm", lambda x, w, *a: dense_calls.append(w.data_ptr()) or real_gemm(x, w, *a))
    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "all")
    fused = _logits(model)
    shared_weights = {p.weight.data_ptr() for layer in model.layers
                      for p in (layer.mlp.shared_expert.gate_up, layer.mlp.shared_expert.down)}
    assert dense_calls and not shared_weights & set(dense_calls)  # other FP8 projections still ran; no shared one
    assert fused.isfinite().all()
    torch.testing.assert_close(fused, separate, rtol=1e-3, atol=1e-3 * separate.abs().max().item())
    assert torch.equal(fused.argmax(-1), separate.argmax(-1))


@requires_cuda
@pytest.mark.parametrize("tokens", [256, 4096])
@pytest.mark.parametrize("launch", ["default", "w8a16", "64:8:3+f16", "128:16:3/128:8:3", "64:8:4/64:8:3:256",
                                    "16:4:3", "32:4:3+swap", "16:4:3/16:4:3:256+swap"])
def test_kernels_at_the_35b_a3b_expert_shapes_on_cuda(tokens, launch):
    """The real shapes compile to other instructions than the interpreter's tiny ones (wgmma at
    64-row tiles and in the swapped pair, mma.sync below): each launch against the fp32 reference on the GPU, with the
    shared expert's rows, outputs NaN-poisoned."""
    from batchinfer.kernels.moe_fp8.grouped_gemm import parse_launch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    E, H_, I_, k = 256, 2048, 512, 8
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, H_, device="cuda", generator=g).bfloat16()
    w13, s13 = block_quantize(torch.randn(E, 2 * I_, H_, device="cuda", generator=g) * H_ ** -0.5)
    w2, s2 = block_quantize(torch.randn(E, H_, I_, device="cuda", generator=g) * I_ ** -0.5)
    sw13, ss13 = block_quantize(torch.randn(2 * I_, H_, device="cuda", generator=g) * H_ ** -0.5)
    sw2, ss2 = block_quantize(torch.randn(H_, I_, device="cuda", generator=g) * I_ ** -0.5)
    shared = SharedExpert(sw13, ss13, sw2, ss2)
    experts = torch.rand(tokens, E, device="cuda", generator=g).topk(k, dim=-1).indices
    layout = ops.moe_align(experts, E)
    chosen = {"default": default_launch(tokens * k, E),
              "w8a16": MoeFp8Launch.same(block_m=16 if tokens <= 256 else 64, num_warps=8, num_stages=3, w8a16=True)}
    launch = chosen.get(launch) or parse_launch(launch)
    M = tokens * k
    out = torch.full((M + tokens, H_), float("nan"), device="cuda", dtype=torch.bfloat16)
    triton_moe_fp8(x, layout.token_of, layout.ends, w13, s13, w2, s2, launch=launch, out=out, shared=shared)
    torch.cuda.synchronize()
    ref = reference_moe_fp8(x, layout.token_of, layout.ends, w13, s13, w2, s2, launch=launch, shared=shared)
    assert out.isfinite().all()
    # one e4m3 / bf16 rounding of silu·up apart at most, and the output's bf16 rounding
    assert (out.float() - ref.float()).norm() <= 2e-2 * ref.float().norm()


@interpreter_only
def test_tiny_fp8_moe_logits_w8a16_are_the_dequantized_models(monkeypatch):
    """BATCHINFER_MOE_W8A16=1: the routed experts without activation quantization; in fp32 that is
    the dequantized path's maths up to the order of sums (the shared expert and the other FP8
    projections run the dense FP8 GEMM in both)."""
    from batchinfer.models.layers import mlp

    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "0")  # the shared expert as dense FP8 GEMMs in both
    model = _tiny_fp8_moe()
    dequantized = _logits(model)
    kernel = ops.implementation("moe_fp8", True)
    launches = []
    monkeypatch.setattr(mlp, "_grouped_fp8_op", lambda x: lambda *a, **kw: launches.append(kw["launch"]) or kernel(*a, **kw))
    monkeypatch.setenv("BATCHINFER_MOE_W8A16", "1")
    w8a16 = _logits(model)
    assert launches and all(launch.w8a16 for launch in launches)
    torch.testing.assert_close(w8a16, dequantized, rtol=1e-5, atol=1e-5 * dequantized.abs().max().item())
    # The dots in fp16 (activations and weights rounded to it): nearer the dequantized model than W8A8.
    monkeypatch.setenv("BATCHINFER_MOE_W8A16", "fp16")
    launches.clear()
    fp16 = _logits(model)
    assert launches and all(launch.fp16_dots for launch in launches)
    monkeypatch.setenv("BATCHINFER_MOE_W8A16", "0")
    w8a8 = _logits(model)
    fp16_error, w8a8_error = (fp16 - dequantized).abs().max(), (w8a8 - dequantized).abs().max()
    assert 0 < fp16_error < w8a8_error / 2, (fp16_error, w8a8_error)
    monkeypatch.setenv("BATCHINFER_MOE_W8A16", "2")
    with pytest.raises(ValueError, match="BATCHINFER_MOE_W8A16='2'"):
        _logits(model)


@requires_cuda
def test_fp8_moe_layer_runs_the_grouped_kernel_in_a_cuda_graph():
    """On CUDA the FP8 MoE layer calls the kernel, needs no host sync (a decode step is a graph)
    and stays near its dequantized path."""
    from batchinfer.models.layers import mlp

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    block = _tiny_fp8_moe().layers[0].mlp.cuda()
    x = torch.randn(64, block.router.shape[1], device="cuda")
    assert mlp._grouped_fp8_op(x) is triton_moe_fp8
    experts, weights = block.route(x)
    out = torch.full((64, x.shape[1]), float("nan"), device="cuda")
    run = lambda: out.copy_(block.routed(x, experts, weights))  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(block.num_experts, dtype=torch.int64, device="cuda").index_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0).to(torch.int32)
    dequantized = block._expert_rows(x, order // block.top_k, ends).float() * weights.reshape(-1)[order, None]
    unquantized = torch.zeros_like(out).index_add_(0, order // block.top_k, dequantized)
    original, mlp._grouped_fp8_op = mlp._grouped_fp8_op, (lambda _: reference_moe_fp8)
    try:  # the same math in fp32 torch: the activations quantized to e4m3 the same way
        reference = block.routed(x, experts, weights).float()
    finally:
        mlp._grouped_fp8_op = original
    assert out.isfinite().all()
    assert (out - reference).norm() <= 1e-2 * reference.norm()
    # against unquantized activations: e4m3's 3 mantissa bits (a few % of each product)
    assert (out - unquantized).norm() <= 0.08 * unquantized.norm()  # 0.045 measured on the CPU



@requires_cuda
def test_fp8_moe_block_with_the_shared_expert_in_the_grouped_kernel_in_a_cuda_graph(monkeypatch):
    """The whole MoE block on CUDA with BATCHINFER_MOE_SHARED_IN_GROUPED=all, replayed as a graph,
    against the block with its separate shared expert."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    block = _tiny_fp8_moe().layers[0].mlp.cuda()
    x = torch.randn(64, block.router.shape[1], device="cuda")
    separate = block(x).float()
    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "all")
    assert block._shared_in_grouped(x) is not None
    out = torch.full_like(x, float("nan"))
    block(x)  # warm-up outside the capture (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(block(x))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert out.isfinite().all()
    assert (out.float() - separate).norm() <= 2e-2 * separate.norm()

SM90_CHILD = """
import re
from batchinfer.kernels.moe_fp8.grouped_gemm import MoeFp8Launch
from benchmarks.moe_fp8_sm90 import compile_sm90
row_major_16 = MoeFp8Launch.same(block_m=16, num_warps=4, num_stages=3)
for kernel, block_m, launch in (("gate_up", 16, None), ("down", 16, None), ("gate_up", 16, row_major_16),
                                ("down", 16, row_major_16), ("gate_up", 64, None), ("down", 64, None)):
    ptx = compile_sm90(kernel, block_m, launch=launch).asm["ptx"]
    print("wgmma-e4m3" if re.search(r"wgmma\\.mma_async\\S*e4m3", ptx) else "mma" if "mma.sync" in ptx else "none")
"""


SM90_SWAPPED_CHILD = """
import re
from batchinfer.kernels.moe_fp8.grouped_gemm import KernelLaunch, MoeFp8Launch
from benchmarks.moe_fp8_sm90 import compile_sm90
for launch in (MoeFp8Launch.same(block_m=16, num_warps=4, num_stages=3, swap_ab=True),
               MoeFp8Launch(KernelLaunch(32, 4, 3), KernelLaunch(16, 4, 3), block_n_down=256, swap_ab=True)):
    for kernel in ("gate_up", "down"):
        ptx = compile_sm90(kernel, 0, launch=launch).asm["ptx"]
        dots = set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.(m64n\\d+k32)\\.f32\\.e4m3\\.e4m3", ptx))
        conversions = len(re.findall(r"cvt\\.rn\\.f16x2\\.e4m3x2", ptx))
        print(kernel, ",".join(sorted(dots)) or "none", "mma.sync" in ptx, conversions)
"""


SM90_W8A16_CHILD = """
import re
from batchinfer.kernels.moe_fp8.grouped_gemm import MoeFp8Launch
from benchmarks.moe_fp8_sm90 import compile_sm90
for fp16_dots in (False, True):
    for block_m in (16, 64):
        launch = MoeFp8Launch.same(block_m=block_m, num_warps=8, num_stages=3, w8a16=True, fp16_dots=fp16_dots)
        for kernel in ("gate_up", "down"):
            ptx = compile_sm90(kernel, block_m, launch=launch).asm["ptx"]
            waits = [int(n) for n in re.findall(r"wgmma\\.wait_group\\.sync\\.aligned (\\d+)", ptx)]
            dots = re.search(r"wgmma\\.mma_async\\S*\\.(bf16|f16)\\.", ptx)
            print(kernel, block_m, dots.group(1) if dots else "none", max(waits, default=0))
"""


def test_w8a16_kernels_keep_their_dots_in_flight_on_sm90():
    """The point of the W8A16 pair: compiled for sm_90a, the weights dequantized in registers feed
    16-bit wgmma dots that accumulate straight into the loop's accumulator, so the waits leave
    groups in flight (the W8A8 kernels wait for every scaled dot: 0)."""
    lines = sm90_child_output(SM90_W8A16_CHILD, timeout=600).splitlines()
    assert [line.split()[2] for line in lines] == ["bf16"] * 4 + ["f16"] * 4
    for line in lines:
        kernel, block_m, dtype, in_flight = line.split()
        assert int(in_flight) > 0, line


def test_kernels_compile_for_sm90():
    """The interpreter runs code the compiler refuses: compile both kernels for sm_90a offline at
    the default decode and prefill launches and the row-major pair at 16 rows, in a child without
    the interpreter."""
    # e4m3 tensor-core products at the default launches (decode's with the weights on the M side);
    # the row-major pair below 64 rows: Triton's f16 mma on exactly converted e4m3.
    assert sm90_child_output(SM90_CHILD, timeout=600).split() == ["wgmma-e4m3", "wgmma-e4m3", "mma", "mma",
                                                                   "wgmma-e4m3", "wgmma-e4m3"]


def test_swapped_kernels_run_e4m3_wgmma_at_decode_tiles_on_sm90():
    """The point of the swapped pair: at 16-32 rows the row-major kernels' dots are f16 mma.sync
    on converted e4m3 (above); with the weights on the M side they are e4m3 wgmma with the rows as
    N (n16 / n32), no conversion left."""
    lines = sm90_child_output(SM90_SWAPPED_CHILD, timeout=600).splitlines()
    assert lines == ["gate_up m64n16k32 False 0", "down m64n16k32 False 0",
                     "gate_up m64n32k32 False 0", "down m64n16k32 False 0"]


def test_shared_in_grouped_by_step_size_and_the_switch(monkeypatch):
    from batchinfer.models.layers import mlp

    monkeypatch.delenv("BATCHINFER_MOE_SHARED_IN_GROUPED", raising=False)
    # the default: decode and prefill steps up to 8,192 tokens (0.96-0.985x the block's time on the H100)
    assert mlp.shared_in_grouped(1) and mlp.shared_in_grouped(8192) and not mlp.shared_in_grouped(8193)
    monkeypatch.setattr(mlp, "SHARED_IN_GROUPED_MAX_TOKENS", 512)
    assert mlp.shared_in_grouped(256) and mlp.shared_in_grouped(512) and not mlp.shared_in_grouped(513)
    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "all")
    assert mlp.shared_in_grouped(32768)
    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "1024")
    assert mlp.shared_in_grouped(1024) and not mlp.shared_in_grouped(1025)
    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "0")
    assert not mlp.shared_in_grouped(1)
    monkeypatch.setenv("BATCHINFER_MOE_SHARED_IN_GROUPED", "yes")
    with pytest.raises(ValueError, match="BATCHINFER_MOE_SHARED_IN_GROUPED='yes'"):
        mlp.shared_in_grouped(1)
