"""The chunked delta rule's state pass with one dependent product per chunk instead of two, on the CPU: how far each
carries the state from the float32 recurrence, at the real shape (16 heads, Dk = Dv = 128, chunks of 64, the
chunked rule's test inputs: tests/operators/test_gated_delta_rule.py's make_inputs, seed 20, its initial state).

    two products (as kernel 2 runs): V' = bf16(U - bf16(W) bf16(S)),  S <- exp(G_C) S + bf16(K~)^T V'
    one product (a candidate):       S <- exp(G_C) S + K~^T U - N bf16(S),  N = bf16(bf16(K~)^T bf16(W)), K~^T U float32
    the same with U in bf16:         K~^T U = bf16(K~)^T bf16(U) (float32 sums), as the state pass would form it

where N [Dk, Dk] and K~^T U [Dk, Dv] would come from kernel 1's parallel programs, leaving the state pass one
dependent product a step (and kernel 3 forming V' = U - W S from the chunk's start state). float32 sums throughout,
as the tensor cores sum; the rest (W, U, K~, the decays) in float32 from the reference's UT form.

    python3 benchmarks/state_step_precision.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from qwen_triton.reference import functional as fn  # noqa: E402
from qwen_triton.reference.functional import _prepare_delta_rule_inputs  # noqa: E402
from tests.operators.test_gated_delta_rule import make_inputs, random_state  # noqa: E402

HEADS, DIM, CHUNK = 16, 128, 64


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="a multiple of 64")
    length = parser.parse_args().tokens
    chunks = length // CHUNK
    inputs = make_inputs(length, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cpu", seed=20)
    g, beta = fn.gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    _, k, v, g, beta = _prepare_delta_rule_inputs(inputs["q"].float(), inputs["k"].float(), inputs["v"].float(),
                                                  g, beta, 1)
    k, v = (x.transpose(0, 1).reshape(HEADS, chunks, CHUNK, DIM) for x in (k, v))
    g, beta = (x.transpose(0, 1).reshape(HEADS, chunks, CHUNK) for x in (g, beta))
    decay = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * pair_decay).masked_fill(~causal.tril(-1), 0.0)
    identity = torch.eye(CHUNK)
    u = torch.linalg.solve_triangular(identity + system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(identity + system, k_beta * decay.exp()[..., None], upper=False,
                                      unitriangular=True)
    decayed_keys = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    correction = bf16(bf16(decayed_keys).transpose(-1, -2) @ bf16(w))  # N, stored in bf16
    carried = bf16(decayed_keys).transpose(-1, -2) @ u                  # K~^T U, float32
    carried_bf16_u = bf16(decayed_keys).transpose(-1, -2) @ bf16(u)     # K~^T U from U in bf16 (in the state pass)

    exact = random_state((HEADS, DIM, DIM), "cpu") * 0.2
    two, one, one_bf16_u = exact.clone(), exact.clone(), exact.clone()
    print(f"{length} tokens, state relative Frobenius error against float32 (two products / one product /"
          " one product with U in bf16):")
    for c in range(chunks):
        exact = exact * chunk_decay[:, c] + decayed_keys[:, c].transpose(-1, -2) @ (u[:, c] - w[:, c] @ exact)
        new_values = bf16(u[:, c] - bf16(w[:, c]) @ bf16(two))
        two = two * chunk_decay[:, c] + bf16(decayed_keys[:, c]).transpose(-1, -2) @ new_values
        one = one * chunk_decay[:, c] + carried[:, c] - correction[:, c] @ bf16(one)
        one_bf16_u = one_bf16_u * chunk_decay[:, c] + carried_bf16_u[:, c] - correction[:, c] @ bf16(one_bf16_u)
        if (c + 1) % 16 == 0 or c == chunks - 1:
            errors = [float((s - exact).norm() / exact.norm()) for s in (two, one, one_bf16_u)]
            print(f"  after {c + 1:3d} chunks: " + " / ".join(f"{e:.3e}" for e in errors))


if __name__ == "__main__":
    main()
