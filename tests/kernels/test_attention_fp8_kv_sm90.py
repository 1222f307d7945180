"""The attention kernels over an FP8 KV pool compile for sm_90a (offline, no GPU): the queries stay
bf16, each e4m3 key / value tile is widened by a cvt from e4m3 before its tensor-core dot; over a
bf16 pool the same kernels compile with no such cvt (the widening is static, not a runtime test)."""
from __future__ import annotations

import os

import pytest

from benchmarks.sm90_compile import PTXAS
from tests.sm90_child import sm90_child_output

pytestmark = [pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton ships no ptxas here"),
              pytest.mark.slow]  # two kernels, two pools, for sm_90a

CHILD = """
import re
import triton
import triton.language as tl
from triton.compiler import ASTSource
from benchmarks import sm90_compile as S
from batchinfer.kernels.attention import attention as A

def compile(fn, pool, constexprs):
    names = fn.arg_names
    signature, divisible = {}, []
    for index, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            signature[name] = pool
        elif name in ("q_ptr", "o_ptr"):
            signature[name] = "*bf16"
        elif name in ("part_o_ptr", "part_lse_ptr"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name == "scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            continue
        if name.endswith("_ptr"):
            divisible.append(index)
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    ptx = triton.compile(source, target=S.SM90, options={"num_warps": 4, "num_stages": 2}).asm["ptx"]
    registers, _ = S.ptxas_resources(ptx)
    widen = len(re.findall(r"cvt\\.rn\\.(?:bf16x2|f16x2)\\.e4m3x2", ptx))
    dots = len(re.findall(r"^\\s*(?:mma\\.sync|wgmma\\.mma_async)", ptx, flags=re.M))
    return registers, widen, dots

decode = dict(GROUP=6, D=256, BLOCK_H=16, BLOCK_D=256, BLOCK_N=64, DOT_PRECISION="tf32", SHARED_ROWS=0,
              LOOP_AS_WHILE=False)
prefill = dict(GROUP=6, D=256, BLOCK_M=64, BLOCK_N=32, BLOCK_D=256, DOT_PRECISION="tf32", LOOP_AS_WHILE=False)
for name, fn, constexprs in (("decode", A._attn_decode_split_kernel, decode), ("prefill", A._attn_prefill_kernel, prefill)):
    for pool in ("*fp8e4nv", "*bf16"):
        print(name, pool, *compile(fn, pool, constexprs))
"""


def test_attention_kernels_over_an_fp8_pool_compile_for_sm90_with_the_widening():
    rows = {(name, pool): tuple(map(int, rest))
            for name, pool, *rest in map(str.split, sm90_child_output(CHILD, timeout=600).splitlines())}
    assert set(rows) == {(k, p) for k in ("decode", "prefill") for p in ("*fp8e4nv", "*bf16")}
    for (name, pool), (registers, widen, dots) in rows.items():
        assert 0 < registers <= 255 and dots > 0, (name, pool, registers, dots)
        assert (widen > 0) == (pool == "*fp8e4nv"), (name, pool, widen)
