"""The MoE layout (`moe_align`): routed assignments sorted by expert, and the grouped GEMM's row tiles.

The reference is exactly the layout `SparseMoE` built before the op existed (a stable argsort);
the Triton counting sort may order one expert's rows differently, so it is checked for what the
layer relies on: each expert's rows are its assignments, `slot` inverts `token_of`, the ends and
the row tiles equal the reference's. Outputs garbage-filled first (the kernels must write each one).
"""
from __future__ import annotations

import pytest
import torch

from batchinfer.kernels import ops
from batchinfer.kernels.moe_align import align as tri
from batchinfer.kernels.moe_fp8.tiles import expert_tiles
from batchinfer.kernels.ref import moe_align as ref
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(T: int, k: int, E: int, seed: int, skew: bool = False, device: str = DEVICE) -> torch.Tensor:
    """Each token's k distinct experts; `skew`: most tokens on a few experts, some experts unused."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=gen)
    if skew:
        scores[:, : E // 4] += 2.0 * torch.rand(T, 1, generator=gen)
        scores[:, -2:] = -1.0  # never chosen
    return scores.topk(k, dim=-1).indices.to(device)  # [T, k] int64


@pytest.fixture
def poisoned(monkeypatch):
    """The kernels' outputs start as garbage, so a row they fail to write shows (the scratch
    histogram stays zeroed)."""
    monkeypatch.setattr(tri, "_output", lambda shape, dtype, device, fill=0: torch.full(shape, -7, dtype=dtype,
                                                                                        device=device))


def test_reference_is_the_layers_former_layout_bit_for_bit():
    experts = _experts(19, 3, 8, seed=1, device="cpu")
    order = torch.argsort(experts.reshape(-1), stable=True)
    layout = ref.moe_align(experts, 8, block_m=4)
    assert torch.equal(layout.token_of, (order // 3).to(torch.int32))
    assert torch.equal(layout.slot.reshape(-1)[order], torch.arange(57, dtype=torch.int32))
    assert torch.equal(layout.ends, torch.bincount(experts.reshape(-1), minlength=8).cumsum(0).to(torch.int32))
    tiles = expert_tiles(layout.ends, 57, 4)
    assert all(torch.equal(getattr(layout.tiles, f), getattr(tiles, f)) for f in ("expert", "start", "end"))
    assert layout.down_tiles is None and ref.moe_align(experts, 8, block_m=4, down_block_m=4).down_tiles is None
    down = ref.moe_align(experts, 8, block_m=4, down_block_m=8).down_tiles
    want = expert_tiles(layout.ends, 57, 8)
    assert down.capacity == want.capacity
    assert all(torch.equal(getattr(down, f), getattr(want, f)) for f in ("expert", "start", "end"))


def _check_against_reference(experts: torch.Tensor, E: int, block_m: int, down_block_m: int = 0) -> None:
    T, k = experts.shape
    got, want = tri.moe_align(experts, E, block_m, down_block_m), ref.moe_align(experts.cpu(), E, block_m, down_block_m)
    assert got.token_of.dtype == got.slot.dtype == got.ends.dtype == torch.int32
    assert torch.equal(got.ends.cpu(), want.ends)
    token_of, slot, flat = got.token_of.cpu().long(), got.slot.cpu().reshape(-1).long(), experts.cpu().reshape(-1)
    # slot is a permutation, and token_of inverts it: sorted row slot[t, j] reads token t
    assert torch.equal(torch.sort(slot).values, torch.arange(T * k))
    assert torch.equal(token_of[slot], torch.arange(T * k) // k)
    # each expert's rows [ends[e-1], ends[e]) are exactly its assignments
    row_expert = torch.empty(T * k, dtype=torch.int64)
    row_expert[slot] = flat
    assert torch.equal(row_expert, torch.sort(flat).values)
    for got_tiles, want_tiles in ((got.tiles, want.tiles), (got.down_tiles, want.down_tiles)):
        if want_tiles is None:
            assert got_tiles is None
            continue
        for field in ("expert", "start", "end"):
            assert torch.equal(getattr(got_tiles, field).cpu(), getattr(want_tiles, field)), field
        assert got_tiles.capacity == want_tiles.capacity
    assert (got.tiles is None) == (block_m == 0)
    assert (got.down_tiles is None) == (block_m == 0 or down_block_m in (0, block_m))


@pytest.mark.parametrize("T, k, E, block_m, down_block_m, skew", [
    (1, 1, 4, 0, 0, False), (5, 2, 8, 16, 0, False), (37, 4, 16, 16, 16, True), (300, 8, 64, 64, 0, True),
    (1100, 2, 32, 32, 0, False),
    # the down kernel's own tiles: narrower (the prefill default's 128 / 64) and wider than gate|up's
    (300, 8, 64, 32, 16, True), (1100, 2, 32, 16, 64, False), (3, 2, 4, 0, 16, False)])
def test_kernel_sorts_by_expert_and_tiles_as_the_reference(poisoned, T, k, E, block_m, down_block_m, skew):
    _check_against_reference(_experts(T, k, E, seed=T, skew=skew), E, block_m, down_block_m)


def test_skipped_launches_leave_a_valid_layout(monkeypatch):
    """The precompile trace records launches without running them: what is left must be every row
    on expert 0 (valid ids, `_grouped_mm` offsets ending at the row count), as before the op."""
    class Skipped:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None
    for name in ("_count_kernel", "_scan_kernel", "_tiles_kernel", "_scatter_kernel"):
        monkeypatch.setattr(tri, name, Skipped())
    layout = tri.moe_align(_experts(6, 2, 4, seed=0), 4, block_m=16, down_block_m=8)
    assert layout.ends.tolist() == [12] * 4 and layout.token_of.eq(0).all() and layout.slot.eq(0).all()
    for tiles in (layout.tiles, layout.down_tiles):
        assert tiles.start.eq(tiles.end).all()  # every tile empty: the GEMM programs exit


def test_no_tokens_gives_empty_layouts():
    layout = tri.moe_align(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), 4, block_m=16)
    assert layout.token_of.numel() == 0 and layout.slot.shape == (0, 2)
    assert layout.ends.tolist() == [0, 0, 0, 0] and layout.tiles.capacity == 0


def test_ops_dispatches_moe_align():
    assert ops.implementation("moe_align", True) is tri.moe_align
    assert ops.implementation("moe_align", False) is ref.moe_align


@requires_cuda
@pytest.mark.parametrize("T", [1, 256, 32768])
def test_kernel_at_the_35b_shapes_on_cuda(T):
    """256 experts, top-8: a decode batch and a 32,768-token prefill step (gate|up on 128-row
    tiles, down on 64, as the prefill launch)."""
    _check_against_reference(_experts(T, 8, 256, seed=T, skew=True), 256, *((16, 0) if T <= 512 else (128, 64)))


SM90_CHILD = """
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchinfer.kernels.moe_align import align as K

# kernel: (pointer types, constexprs) at the 35B-A3B's 256 experts, top-8, 16-row tiles (the scan: 128 / 64)
KERNELS = {
    "_count_kernel": (dict(experts_ptr="*i64", counts_ptr="*i32", rank_ptr="*i32"), dict(BLOCK=K.BLOCK)),
    "_scan_kernel": (dict(counts_ptr="*i32", starts_ptr="*i32", ends_ptr="*i32", tile_ends_ptr="*i32",
                          down_tile_ends_ptr="*i32"), dict(BLOCK_M=128, DOWN_BLOCK_M=64, BLOCK_E=256)),
    "_tiles_kernel": ({n: "*i32" for n in ("tile_ends_ptr", "starts_ptr", "ends_ptr", "tile_expert_ptr",
                                           "tile_start_ptr", "tile_end_ptr")},
                      dict(BLOCK_M=16, BLOCK_T=K.BLOCK_TILES, BLOCK_E=256)),
    "_scatter_kernel": (dict(experts_ptr="*i64", rank_ptr="*i32", starts_ptr="*i32", token_of_ptr="*i32",
                             slot_ptr="*i32"), dict(K=8, BLOCK=K.BLOCK)),
}
for name, (types, constexprs) in KERNELS.items():
    fn = getattr(K, name)
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    print(name, "atomic" if re.search(r"\\b(atom|red)\\.global", ptx) else "plain")
"""


def test_kernels_compile_for_sm90():
    """The interpreter runs code the compiler refuses: compile the four kernels for sm_90a offline;
    only the count kernel uses global atomics."""
    from tests.sm90_child import sm90_child_output

    lines = sm90_child_output(SM90_CHILD, timeout=600).split("\n")
    assert [line for line in lines if line] == ["_count_kernel atomic", "_scan_kernel plain", "_tiles_kernel plain",
                                                "_scatter_kernel plain"]
