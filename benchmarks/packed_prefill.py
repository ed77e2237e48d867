"""Several prompts prefilled together through the engine (`LLM.generate`, then `prefill_batch` alone), under a
setting of the chunked delta rule: where kernel 1 splits (`--split-prepare-tokens`, tuning's
chunk_split_prepare_tokens) and how many parts a packed state pass runs (`--parts`, state_pass.PACKED_PARTS; 1:
one chain through every sequence). One setting a process (the kernel modules read them at import); run it once per
setting on the same machine:

    python3 benchmarks/packed_prefill.py --parts 16 --out parts16.json
    python3 benchmarks/packed_prefill.py --parts 1 --out parts1.json

Prints, per case COUNT x LENGTH (random ids, never-seen lengths aside), the time to first tokens of four
`LLM.generate` calls (the first compiles: no warm-up) and the median of seven `prefill_batch` calls timed from
launch to synchronisation (the GPU's work and the launch), in ms. The 0.8B shape, random weights, bf16."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

CASES = ((16, 128), (4, 1024), (1, 2048), (2, 1024), (8, 256))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split-prepare-tokens", type=int, default=None, help="default: the GPU's tuning table's")
    parser.add_argument("--parts", type=int, default=None, help="default: state_pass.PACKED_PARTS")
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args()

    from qwen_triton import tuning
    if args.split_prepare_tokens is not None:  # before any kernel module reads the table
        table = dataclasses.replace(tuning.active(), chunk_split_prepare_tokens=args.split_prepare_tokens)
        tuning._ACTIVE[0] = table
    from qwen_triton.operators.gated_delta_rule import state_pass
    if args.parts is not None:
        state_pass.PACKED_PARTS = args.parts

    import torch

    from qwen_triton.benchmark.models import random_llm
    from qwen_triton.tokenizer import Tokenizer

    llm = random_llm("0.8b", max_length=4096, max_batch=16, warm_up=False, tokenizer=Tokenizer.default())
    model, generator = llm.model, torch.Generator().manual_seed(0)
    result = dict(gpu=torch.cuda.get_device_name(), split_prepare_tokens=tuning.active().chunk_split_prepare_tokens,
                  parts=state_pass.PACKED_PARTS, cases={})
    for count, length in CASES:
        def prompts():
            return [torch.randint(0, 240000, (length,), generator=generator).tolist() for _ in range(count)]

        first_tokens = [llm.generate(prompts(), max_new_tokens=1)[0].timings["time_to_first_token_s"] * 1e3
                        for _ in range(4)]
        waits = []
        for _ in range(7):
            ids = [torch.tensor(p, dtype=torch.int64) for p in prompts()]
            for slot in range(count):
                model.reset(slot)
            torch.cuda.synchronize()
            started = time.perf_counter()
            model.prefill_batch(ids, list(range(count)))
            torch.cuda.synchronize()
            waits.append((time.perf_counter() - started) * 1e3)
        case = dict(generate_first_token_ms=first_tokens, prefill_batch_ms_median=statistics.median(waits))
        result["cases"][f"{count}x{length}"] = case
        print(f"{count} x {length}: generate's first tokens {[round(t, 2) for t in first_tokens]} ms, "
              f"prefill_batch {case['prefill_batch_ms_median']:.3f} ms", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
