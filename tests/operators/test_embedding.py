"""Token embedding: a row gather, so exact equality with table[ids].

CPU: int32 and int64 ids, float16 / bfloat16 / float32 tables, a row width (70) over several blocks of
the interpreter's 32, repeated ids, out=, and ids outside [0, V) (zero rows). GPU: the real table
(248320 x 1024, bf16) at M = 1 and 4096.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.embedding import benchmark_cases, embedding


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_embedding_gathers_rows(device, id_dtype, dtype):
    table = torch.randn(50, 70).to(device=device, dtype=dtype)
    ids = torch.tensor([3, 49, 0, 7, 3], dtype=id_dtype, device=device)
    assert torch.equal(embedding(ids, table), table[ids.long()])


def test_embedding_out_and_out_of_range_ids(device):
    table = torch.randn(50, 70, device=device)
    ids = torch.tensor([5, -1, 50, 49], device=device)
    out = torch.full((4, 70), 7.0, device=device)
    assert embedding(ids, table, out=out) is out
    assert torch.equal(out[0], table[5]) and torch.equal(out[3], table[49])
    assert (out[1:3] == 0).all()


def test_embedding_empty(device):
    table = torch.randn(50, 70, device=device)
    assert embedding(torch.empty(0, dtype=torch.int64, device=device), table).shape == (0, 70)


@pytest.mark.parametrize("call, message", [
    (lambda ids, t: embedding(ids.float(), t), "ids has dtype"),
    (lambda ids, t: embedding(ids[None], t), "ids has shape"),
    (lambda ids, t: embedding(ids, t.int()), "table has dtype"),
    (lambda ids, t: embedding(ids, t[:, ::2]), "table must have unit stride"),
    (lambda ids, t: embedding(ids, t, out=torch.zeros(3, 69)), "out has shape"),
    (lambda ids, t: embedding(ids, t, out=torch.zeros(3, 70, dtype=torch.float16)), "out has dtype"),
])
def test_embedding_rejects_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(3, dtype=torch.int64), torch.zeros(50, 70))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4096])
def test_gpu_embedding(M):
    torch.manual_seed(0)
    table = torch.randn(248320, 1024, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 248320, (M,), device="cuda", dtype=torch.int32)
    assert torch.equal(embedding(ids, table), table[ids.long()])


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    for case in benchmark_cases():
        case["fn"]()
    torch.cuda.synchronize()
