"""Small model configs and the transformers oracle, shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys

import torch

from qwen_triton.checkpoint import PRESETS, make_checkpoint


def small_config(**overrides) -> dict:
    """A text config small enough for the CPU: sizes deliberately not powers of two."""
    config = copy.deepcopy(PRESETS["tiny"])
    config.update(
        vocab_size=301, hidden_size=48, intermediate_size=88, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12, linear_value_head_dim=20,
        eos_token_id=300, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    )
    config["rope_parameters"] = dict(config["rope_parameters"], partial_rotary_factor=0.25, mrope_section=[1, 1, 1])
    config.update(overrides)
    return config


@contextlib.contextmanager
def tiny_vocabulary(size: int = 4096):
    """The tiny preset with a vocabulary of `size` rows while the block runs (its end-of-turn ids then fall outside
    it, so no row stops early): for the CPU tests of the bench and the profile, which test their plumbing and whose
    interpreted time went mostly to the LM head and the sampler over the real 248,320 rows."""
    original = PRESETS["tiny"]
    PRESETS["tiny"] = dict(original, vocab_size=size)
    try:
        yield
    finally:
        PRESETS["tiny"] = original


def write_checkpoint(directory, config: dict, layout: str = "conditional", **options):
    options.setdefault("tokenizer", False)
    options.setdefault("dtype", torch.float32)
    return make_checkpoint(directory, config, layout=layout, **options)


def transformers_model(directory):
    from transformers import Qwen3_5ForCausalLM

    model = Qwen3_5ForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    return model.eval()


def transformers_logits(model, token_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def transformers_score(model, token_ids, prefill: int) -> torch.Tensor:
    """transformers' logits computed the way LLM.score computes them: the first `prefill` ids in one
    forward pass, then one cached step at a time (so both sides use the same form of the delta rule)."""
    rows = []
    cache = None
    with torch.no_grad():
        if prefill:
            out = model(torch.tensor([token_ids[:prefill]]), use_cache=True)
            cache, rows = out.past_key_values, [out.logits[0]]
        for token in token_ids[prefill:]:
            out = model(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            rows.append(out.logits[0])
    return torch.cat(rows).float()


def run_without_interpreter(script: str, timeout: int = 600):
    """Run `script` in a new Python process with TRITON_INTERPRET=0 (kernels there are real Triton kernels,
    compiled rather than interpreted; nothing needs a GPU unless the script launches one) and return the JSON
    value printed on its last line."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """max |ours - reference| / max |reference|."""
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


def graph_replays_as_eager(step, output: torch.Tensor, replays: int = 3) -> torch.Tensor:
    """Run step() once eagerly (on a side stream, as capture wants), capture it in a CUDA graph, then replay the
    graph `replays` times from output's value before the eager run, asserting each replay leaves output equal to
    the eager result bit for bit; returns the eager result."""
    start = output.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    eager = output.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(replays):
        output.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(output, eager)
    return eager
