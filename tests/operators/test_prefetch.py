"""The L2 prefetch hint (operators/common.py): its argument checks, its code for sm_90 (one request per
chunk, whatever the warp count), and on the GPU that kernels that issue it compute the same bits."""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.attention import attention_decode
from qwen_triton.operators.common import prefetch_arguments
from tests.operators.test_gated_delta_rule import clone_states, fused_decode, make_decode_layer
from tests.support import run_without_interpreter


def test_prefetch_arguments(device):
    stand_in = torch.zeros(4, device=device)
    assert prefetch_arguments("prefetch", None, stand_in) == (stand_in, 0, False)
    weights = torch.zeros(64, dtype=torch.bfloat16, device=device)
    tensor, count, enabled = prefetch_arguments("prefetch", weights, stand_in)
    assert tensor is weights and count == 64
    assert enabled == (device == "cuda" and torch.cuda.get_device_capability()[0] >= 9)
    with pytest.raises(ValueError, match="prefetch must start on 16 bytes"):
        prefetch_arguments("prefetch", weights[1:9], stand_in)  # 2 bytes in
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        prefetch_arguments("prefetch", weights[:12], stand_in)  # 24 bytes
    with pytest.raises(ValueError, match="contiguous"):
        prefetch_arguments("prefetch", weights.view(8, 8)[:, :4], stand_in)
    with pytest.raises(ValueError, match="prefetch is on"):
        prefetch_arguments("prefetch", weights.to("meta"), stand_in)


REQUESTS_PER_THREAD = """
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from qwen_triton.operators.common import prefetch_to_l2

@triton.jit
def kernel(weights, count, ENABLED: tl.constexpr):
    prefetch_to_l2(weights, count, tl.program_id(0), tl.num_programs(0), ENABLED)

counts = {}
for warps in (1, 2, 4, 8):
    for enabled in (True, False):
        compiled = triton.compile(ASTSource(fn=kernel, signature=dict(weights="*bf16", count="i32", ENABLED="constexpr"),
                                            constexprs=dict(ENABLED=enabled)),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        counts[f"{warps}-{enabled}"] = compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2.global")
print(json.dumps(counts))
"""


def test_prefetch_compiles_to_one_request_per_chunk_for_hopper(tmp_path):
    # compiled for sm_90 (Triton's bundled ptxas) in a process without the interpreter: each thread issues
    # its share of a program's 256 chunk requests per round (256 / threads), so no chunk is requested twice
    script = tmp_path / "requests_per_thread.py"  # Triton reads a kernel's source from its file
    script.write_text(REQUESTS_PER_THREAD)
    counts = run_without_interpreter(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')")
    assert counts == {"1-True": 8, "2-True": 4, "4-True": 2, "8-True": 1,
                      "1-False": 0, "2-False": 0, "4-False": 0, "8-False": 0}


@pytest.mark.gpu
def test_gpu_kernels_that_prefetch_compute_the_same_bits():
    torch.manual_seed(4)
    weights = torch.randn(26_214_400 // 2, device="cuda", dtype=torch.bfloat16)  # a layer tail's bytes
    layer = make_decode_layer(1, 16, 16, 128, 128, 4, torch.bfloat16, "cuda", seed=3)
    plain, hinted = clone_states(layer), clone_states(layer)
    for _ in range(2):
        assert torch.equal(fused_decode(plain), fused_decode(hinted, prefetch=weights))
        assert torch.equal(plain["state"], hinted["state"])
        assert torch.equal(plain["conv_state"], hinted["conv_state"])
    q = torch.randn(1, 8, 256, device="cuda", dtype=torch.bfloat16)
    key_cache = torch.randn(1, 2, 4096, 256, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    for length in (128, 4096):
        lengths = torch.tensor([length], device="cuda", dtype=torch.int32)
        assert torch.equal(attention_decode(q, key_cache, value_cache, lengths),
                           attention_decode(q, key_cache, value_cache, lengths, prefetch=weights))
