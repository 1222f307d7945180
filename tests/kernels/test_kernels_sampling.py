"""The fused Gumbel-max kernel against the engine's torch sampling (same counter hash, same
tie rule), under the interpreter on the CPU and on the GPU where there is one."""
import pytest
import torch

from batchinfer.engine.sampler import gumbel_argmax_torch as reference_gumbel_argmax
from batchinfer.kernels.sampling import GumbelLaunch, gumbel_argmax
from tests.sm90_child import sm90_child_output

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    scaled = torch.randn(rows, vocab, generator=g) * 3
    scaled[1, : vocab // 2] = float("-inf")  # a masked row (grammar)
    scaled[2, :] = float("-inf")
    scaled[2, vocab - 1] = 0.0               # only the last token allowed
    keys = torch.randint(0, 2**32, (rows, 2), generator=g, dtype=torch.int64)
    keys[3] = torch.tensor([0xFFFFFFFF, 0])  # extreme key words
    return scaled, keys


@pytest.mark.parametrize("rows,vocab,block", [(6, 300, 64), (5, 1000, 128), (4, 77, 32)])
def test_fused_gumbel_argmax_matches_the_torch_sampler(rows, vocab, block):
    scaled, keys = _case(rows, vocab, seed=rows * vocab)
    expected = reference_gumbel_argmax(scaled, keys)
    got = gumbel_argmax(scaled.to(DEVICE), keys.to(DEVICE), GumbelLaunch(block_v=block, num_warps=4)).cpu()
    assert got.tolist() == expected.tolist()
    assert got[2].item() == vocab - 1 and got[1].item() >= vocab // 2


def test_all_masked_row_picks_token_zero_like_argmax():
    scaled = torch.full((2, 100), float("-inf"))
    keys = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    assert gumbel_argmax(scaled.to(DEVICE), keys.to(DEVICE), GumbelLaunch(block_v=32, num_warps=4)).tolist() == [0, 0]
    assert reference_gumbel_argmax(scaled, keys).tolist() == [0, 0]


SM90_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchinfer.kernels.sampling import gumbel as k
fn = k._gumbel_argmax_kernel
types = {"scaled_ptr": "*fp32", "keys_ptr": "*i64", "out_ptr": "*i64", "V": "i32", "stride_row": "i32"}
constexprs = {"V_BLOCKS": 122, "BLOCK_V": 2048}
names = fn.arg_names
signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print("lg2" in compiled.asm["ptx"] or "log" in compiled.asm["ptx"])
"""


def test_kernel_compiles_for_sm90():
    """The interpreter runs code the compiler refuses: compile the kernel for sm_90a offline."""
    assert sm90_child_output(SM90_CHILD).split() == ["True"]


def _reference_logprobs(logits, tokens, rows, k):
    """fp64 log_softmax, the drawn token's logprob and torch.topk's values and ids."""
    lp = logits[rows].double().log_softmax(dim=1)
    chosen = lp.gather(1, tokens[rows][:, None])[:, 0]
    top = lp.topk(k, dim=1) if k else None
    return chosen, top


@pytest.mark.parametrize("rows_asking,vocab,k,block", [((0, 1, 2, 3, 4), 300, 5, 64), ((1, 3), 1000, 3, 128),
                                                      ((0, 2), 77, 0, 32), ((0, 1, 2), 130, 1, 32)])
def test_fused_logprobs_match_log_softmax_and_topk(rows_asking, vocab, k, block):
    from batchinfer.kernels.sampling import LogprobsLaunch, row_logprobs
    g = torch.Generator().manual_seed(vocab + k)
    logits = torch.randn(5, vocab, generator=g) * 4
    logits[0, 7] = 30.0                               # a peaked row
    logits[1, vocab - 1] = 25.0                       # the best token in the last, partial block
    tokens = torch.randint(0, vocab, (5,), generator=g)
    rows = torch.tensor(rows_asking, dtype=torch.int64)
    poisoned = torch.full((len(rows_asking), 1 + 2 * k), float("nan"), device=DEVICE)  # every entry must be written
    out = row_logprobs(logits.to(DEVICE), tokens.to(DEVICE), rows.to(DEVICE), k,
                       LogprobsLaunch(block_v=block, num_warps=4), out=poisoned).cpu()
    assert not out.isnan().any()
    chosen, top = _reference_logprobs(logits, tokens, rows, k)
    assert torch.allclose(out[:, 0].double(), chosen, atol=1e-5, rtol=0)
    if k:
        assert torch.allclose(out[:, 1:1 + k].double(), top.values, atol=1e-5, rtol=0)
        assert out[:, 1 + k:].contiguous().view(torch.int32).long().tolist() == top.indices.tolist()
    # The engine's torch path packs the same way (on this device it is the reference itself).
    from batchinfer.engine.sampler import token_logprobs_torch
    packed = token_logprobs_torch(logits, tokens, rows, k)
    assert torch.allclose(packed[:, :1 + k], out[:, :1 + k], atol=1e-5, rtol=0)


def test_fused_logprobs_order_equal_values_by_id():
    from batchinfer.kernels.sampling import LogprobsLaunch, row_logprobs
    logits = torch.zeros(1, 100)
    logits[0, [90, 10, 50]] = 2.0
    out = row_logprobs(logits.to(DEVICE), torch.tensor([3]).to(DEVICE), torch.tensor([0]).to(DEVICE), 3,
                       LogprobsLaunch(block_v=32, num_warps=4)).cpu()
    assert out[0, 4:].contiguous().view(torch.int32).tolist() == [10, 50, 90]


SM90_LOGPROBS_CHILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchinfer.kernels.sampling import logprobs as k
fn = k._row_logprobs_kernel
types = {"logits_ptr": "*fp32", "stride_row": "i32", "rows_ptr": "*i64", "tokens_ptr": "*i64", "out_ptr": "*fp32",
         "V": "i32"}
constexprs = {"K": 5, "KP": 8, "V_BLOCKS": 122, "BLOCK_V": 2048}
names = fn.arg_names
signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
print(compiled.n_spills == 0 if hasattr(compiled, "n_spills") else True)
"""


def test_logprobs_kernel_compiles_for_sm90():
    assert sm90_child_output(SM90_LOGPROBS_CHILD).split() == ["True"]
