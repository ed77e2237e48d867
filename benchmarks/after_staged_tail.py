"""Do the kernels after a staged layer tail run slower? The decode step's tail-to-next-kernel pairs, timed apart.

The thirteenth session's profiles had the LM head kernel at 126.3 us after the three-launch tail
(out_projection_mlp) and 145.1 us after staged_out_projection_mlp, the same tuned config, and the DeltaNet
in-projection + step and the attention in-projection 2.4 and 1.4 us longer. (Measured here, fourteenth session:
the LM head launched with PDL 19-21 us longer after the staged tail, the other two not slower; the engine has
launched the LM head without PDL since then, docs/perf-notes.md.)

At Qwen3.5-0.8B's shapes (bf16, random weights), CUDA graphs of each tail alone, each follower alone, and each
tail followed by each follower, the follower launched with and without PDL (the tails always with), each case
ending with a plain PyTorch kernel (no PDL), so that no case's next tail launches while its follower runs
(without it the shares came out within 1.6 us of these). A follower's share after a tail is the pair's time
less the tail's alone. Followers: the LM head (final norm + argmax, `lm_head_argmax`), the DeltaNet
in-projection + step (`gated_delta_rule_decode_projected`), the attention in-projection (`linear` with its
input norm).

    python3 benchmarks/after_staged_tail.py [--calls 10] [--out after-tail.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from qwen_triton.benchmark.harness import time_graph
from qwen_triton.operators.gated_delta_rule import gated_delta_rule_decode_projected
from qwen_triton.operators.linear import linear
from qwen_triton.operators.linear import staged_out_projection_mlp as staged
from qwen_triton.operators.linear.out_projection_mlp import out_projection_mlp
from qwen_triton.operators.lm_head import lm_head_argmax

H, A, I, V = 1024, 2048, 3584, 248320
HEADS, D = 16, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()

    def random(*shape, scale=0.02, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    x, gate, hidden = random(1, A, scale=1.0), random(1, A, scale=1.0), random(1, H, scale=1.0)
    out_weight, norm, gate_up, down = random(H, A), random(H, scale=0.1), random(2 * I, H), random(H, I)
    act = torch.empty(1, I, device="cuda", dtype=torch.bfloat16)
    counters = staged.new_counters("cuda")[0]
    descriptors = staged.weight_descriptors(out_weight, gate_up, down)
    embedding, final_norm = random(V, H), random(H, scale=0.1)
    ids = torch.empty(1, device="cuda", dtype=torch.int64)
    projection_weight, conv = random(4 * A + 2 * HEADS, H), random(3 * A, 4, scale=0.3)
    conv_state, state = random(1, 3 * A, 3, scale=1.0), random(1, HEADS, D, D, scale=0.1, dtype=torch.float32)
    a_log, dt_bias = torch.rand(HEADS, device="cuda") + 0.5, torch.randn(HEADS, device="cuda")
    projection = torch.empty(1, 4 * A + 2 * HEADS, device="cuda", dtype=torch.bfloat16)
    qk, o = torch.empty(1, 2 * A, device="cuda", dtype=torch.bfloat16), torch.empty(1, HEADS, D, device="cuda",
                                                                                    dtype=torch.bfloat16)
    qkv_weight = random(5120, H)
    qkv = torch.empty(1, 5120, device="cuda", dtype=torch.bfloat16)

    tails = {
        "staged tail": lambda: staged.staged_out_projection_mlp(x, out_weight, hidden, norm, gate_up, down, 1e-6,
                                                                counters, gate=gate, act=act, pdl=True,
                                                                descriptors=descriptors),
        "three-launch tail": lambda: out_projection_mlp(x, out_weight, hidden, norm, gate_up, down, 1e-6, gate=gate,
                                                        act=act, pdl=True),
    }
    followers = {
        "LM head": lambda pdl: lm_head_argmax(hidden, embedding, ids, norm_weight=final_norm, eps=1e-6, pdl=pdl),
        "DeltaNet in-projection + step": lambda pdl: gated_delta_rule_decode_projected(
            hidden, norm, 1e-6, projection_weight, conv, conv_state, a_log, dt_bias, state, projection, qk, o,
            pdl=pdl),
        "attention in-projection": lambda pdl: linear(hidden, qkv_weight, norm_weight=norm, eps=1e-6, out=qkv,
                                                      pdl=pdl),
    }
    separator = torch.zeros(1, device="cuda")
    cases = {f"{name} alone": lambda before=before: (before(), separator.add_(1))
             for name, before in tails.items()}
    for follower, run in followers.items():
        cases[f"{follower} alone"] = lambda run=run: (run(True), separator.add_(1))
        for tail, before in tails.items():
            for pdl in (True, False):
                cases[f"{tail}, {follower}" + ("" if pdl else " without PDL")] = \
                    lambda before=before, run=run, pdl=pdl: (before(), run(pdl), separator.add_(1))
    for function in cases.values():  # compile and tune first
        function()
    torch.cuda.synchronize()
    times = {name: time_graph(function, calls=args.calls, replays=10) * 1e3 for name, function in cases.items()}
    if counters[3]:
        raise RuntimeError("a grid barrier gave up (the counters' error flag)")
    shares = {}
    for follower in followers:
        for tail in tails:
            for suffix in ("", " without PDL"):
                shares[f"{follower} after the {tail}{suffix}"] = times[f"{tail}, {follower}{suffix}"] - \
                    times[f"{tail} alone"]
    for name, us in times.items():
        print(f"{name}: {us:.2f} us")
    for name, us in shares.items():
        print(f"share of the {name}: {us:.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(times_us=times, shares_us=shares), f, indent=2)


if __name__ == "__main__":
    main()
