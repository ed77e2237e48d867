"""Zeroing a list of tensors in one launch (operators/memory/zero.py), the Triton engine's reset.

What must hold: every listed tensor all zeros afterwards, every byte around them untouched (the slots before and
after), whether the words are 4 bytes (every address and size a multiple of 16) or 2 (otherwise); the plan's
errors name the tensor. GPU: a slot's states at the Qwen3.5-0.8B shape (aligned, 16-byte stores), other slots
untouched, and a CUDA graph's replays zeroing again.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.config import parse_config
from qwen_triton.operators.memory import ZeroPlan
from qwen_triton.state import ModelState


def filled(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("channels, aligned", [(96, True), (95, False)])
def test_zeroes_the_listed_tensors_and_nothing_else(device, channels, aligned):
    states = filled(4, 16, 8, 8, dtype=torch.float32, device=device, seed=0)
    conv = filled(4, channels, 3, dtype=torch.bfloat16, device=device, seed=1)  # 95 x 3 x 2 bytes: not 16-aligned
    whole = filled(4096, dtype=torch.float32, device=device, seed=2)
    before = [states.clone(), conv.clone()]
    plan = ZeroPlan([states[1], conv[2], whole])
    assert plan.aligned == aligned
    plan()
    assert not states[1].any() and not conv[2].any() and not whole.any()
    assert torch.equal(states[0], before[0][0]) and torch.equal(states[2:], before[0][2:])
    assert torch.equal(conv[:2], before[1][:2]) and torch.equal(conv[3], before[1][3])
    states[1].fill_(1.0)
    plan()  # the table stays valid: a second call zeroes again
    assert not states[1].any()


def test_plan_errors(device):
    with pytest.raises(ValueError, match="at least one"):
        ZeroPlan([])
    with pytest.raises(ValueError, match="tensor 1 is not contiguous"):
        ZeroPlan([torch.zeros(8, device=device), torch.zeros(8, 8, device=device).t()])
    with pytest.raises(ValueError, match="tensor 0 is torch.int8"):
        ZeroPlan([torch.zeros(8, dtype=torch.int8, device=device)])


@pytest.mark.gpu
def test_gpu_a_slot_of_the_real_model_state():
    config = parse_config(official_config(PRESETS["0.8b"]))
    state = ModelState(config, 3, 64, "cuda", torch.bfloat16)
    for tensors in (state.conv, state.recurrent):
        for tensor in tensors.values():
            tensor.normal_()
    before = {i: (state.conv[i].clone(), state.recurrent[i].clone()) for i in state.conv}
    plan = ZeroPlan(state.slot_states(1))
    assert plan.aligned and len(plan.tensors) == 36
    plan()
    torch.cuda.synchronize()
    for i, (conv, recurrent) in before.items():
        assert not state.conv[i][1].any() and not state.recurrent[i][1].any()
        for slot in (0, 2):
            assert torch.equal(state.conv[i][slot], conv[slot]) and torch.equal(state.recurrent[i][slot],
                                                                                   recurrent[slot])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    for _ in range(2):
        for tensor in state.slot_states(1):
            tensor.fill_(3.0)
        graph.replay()
        torch.cuda.synchronize()
        assert not any(tensor.any() for tensor in state.slot_states(1))
