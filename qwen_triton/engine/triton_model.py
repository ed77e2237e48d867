"""The Triton backend: Qwen3.5 composed from the kernels in `qwen_triton.operators`.

Same interface as the reference model (`prefill`, `decode`, `reset`), plus `decode_tokens`, the step
generation uses: it samples on the device, inside the CUDA graph. Which kernel runs each operator in each
phase is the table in `qwen_triton.operators.table` (`qwen-triton ops`).

At load, weights that are read by one projection are concatenated so each layer reads its input once:
attention [gate | q | k | v] (the q_proj rows of transformers' per-head [q, gate] layout regrouped so the
gate and the q/k/v part are plain column slices of the output), Gated DeltaNet [qkv | z | b | a], MLP
[gate | up]. The pre-projection RMSNorms' weights are folded into the projections' weights (fold_norms: W * (1 +
w), rounded to bf16 once; the norms' weights the kernels see are then zeros), so a prefill's projection applies its
norm as a scale of its output rows in its epilogue, from the rows' sums of squares that the projection before it
left (linear's norm_squares, squares_out); a decode step's projections normalise x in their prologues. The
residual adds are fused into their epilogues, SwiGLU into the gate/up epilogue and the attention output gate into
the o_proj prologue; in a decode step the DeltaNet output norm too (output_norm_in_projection), and for one
sequence a DeltaNet layer's in-projection, conv, gates and delta rule run as one kernel (projected_delta_decode),
and on Hopper a layer's out-projection and MLP as one launch with every weight in shared memory
(staged_out_projection_mlp).
A greedy step's LM head (up to 16 sequences) reads an int8 copy of the head (made at load) and computes exactly only
the rows whose bound leaves them a chance (screened_lm_head; the exact argmax).

Decode runs slots 0..B-1 with every activation buffer preallocated per batch bucket (1, 2, 4, 8, ...);
with `cuda_graph=True` each bucket's step is captured once after a warm-up (compilation, autotuning) and
replayed: inputs are copied into static buffers, nothing is allocated and nothing waits on the host.
With `feedback=True` the step ends with a kernel that writes its chosen ids back as the next step's inputs,
so generation can launch the next step before reading this one's ids (engine/decode_pipeline.py).
With `pdl=True` (the default on Hopper and newer) the decode kernels use programmatic dependent launch:
each starts while the previous one drains, streams its weights, and waits before reading its input
(operators/common.py); so do a short prefill's projections, convs and attention (PREFILL_PDL). A prefill
from position 0 whose length repeats is replayed from a CUDA graph too.

Each operator call is named with `_operator` / `_linear` (kind, layer, the bytes and FLOPs of its floor):
a no-op unless `qwen-triton profile` sets `trace`, which then records which kernels each operator
launched (engine/trace.py).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, ModelConfig
from ..operators.common import hopper_or_later, interpreting, pdl_available, sm_count
from ..operators.attention import attention_decode, attention_prefill, decode_splits, qk_norm_rotary, rotary_table
from ..operators.conv import causal_conv1d, causal_conv1d_step
from ..operators.embedding import embedding
from ..operators.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_decode_fused,
    gated_delta_rule_recurrent,
    gated_delta_rule_decode_projected,
    gated_delta_rule_decode_projected_cost,
    gated_rms_norm,
)
from ..operators.gated_delta_rule.chunk import chunk_size_for
from ..operators.gated_delta_rule.projected_decode import ROWS as PROJECTED_ROWS
from ..operators.lm_head import lm_head_argmax, lm_head_logits
from ..operators.lm_head.screened import build_screen, lm_head_argmax_screened, screened_lm_head_bytes
from ..operators.linear import linear, out_projection_mlp, out_projection_mlp_cost
from ..operators.linear import staged_out_projection_mlp as staged
from ..operators.linear.fusion import SQUARES_COLUMNS
from ..operators.linear.gemv import MAX_ROWS
from ..operators.memory import ZeroPlan
from ..operators.norm import row_squares
from ..operators.sampling import feed_back, sample
from ..state import ModelState
from ..progress import progress_printer
from .trace import KernelTrace


@dataclass
class AttentionWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [gate (Hq*D, when gated) | q (Hq*D) | k | v] x hidden
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    out: torch.Tensor


@dataclass
class DeltaNetWeights:
    input_norm: torch.Tensor
    projection: torch.Tensor  # [qkv (conv_dim) | z (Hv*Dv) | b (Hv) | a (Hv)] x hidden
    conv: torch.Tensor  # [conv_dim, W]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out: torch.Tensor


@dataclass
class MLPWeights:
    input_norm: torch.Tensor
    gate_up: torch.Tensor  # [gate | up] x hidden
    down: torch.Tensor


PREFILL_GRAPHS = 8  # CUDA graphs of prefills kept (the most recently captured)
# The decode step's LM head is launched without PDL (the step's other kernels with it, where they are): with
# PDL the step took 22.6 us longer at context 128 after the staged tail, 12.4 after the three-launch one
# (benchmarks/engine_options.py; docs/perf-notes.md, fourteenth session). Alone after a tail, with PDL, its
# kernel ran 19-21 us longer after the staged tail (benchmarks/after_staged_tail.py).
LM_HEAD_PDL = False
# The screened LM head's four kernels (lm_head/screened.py) with PDL: the first is one program, not a grid of
# thousands placed early behind a staged layer tail.
SCREENED_LM_HEAD_PDL = True
# A prefill of up to PREFILL_PDL_TOKENS tokens launches its projections (GEMMs, their prologues, the q/k norm),
# convs and attention with PDL where the model uses it; the chunked delta rule's kernels and the LM head
# without. Measured on the H200 (benchmarks/prefill_options.py, the graph's replay, docs/perf-notes.md
# seventeenth session): 128 tokens 1,797 us without PDL, 1,772 so, 1,893 with the delta rule's kernels too
# (its next kernel's programs placed beside its latency-bound ones); 4096 tokens no gain (13.56-13.73 ms).
PREFILL_PDL = True
PREFILL_PDL_TOKENS = 256
# The decode attention's autotuning on a call over the whole cache (TritonModel._tune_decode_attention)
TUNE_DECODE_ATTENTION_AT_FULL_LENGTH = True
SCREENED_ROWS = 16  # the screened head's batch limit: one pass over its int8 copy serves up to 16 rows
# Fold the pre-projection norms' (1 + w) into the projections' weights at load (TritonModel(fold_norms=None)):
# a prefill of more than 16 tokens then has no prologue pass before its in-projections and gate/up (see
# linear.py, "The folded norm"; measured in docs/perf-notes.md, twenty-third session).
FOLD_NORMS = True


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] * (1 + norm_weight [K]) over its columns, in float32, rounded once to weight's dtype: the
    projection of a zero-centred RMSNorm's output with the norm's weight folded in (linear.py)."""
    return (weight.float() * (1.0 + norm_weight.float())).to(weight.dtype)


def bucket(batch: int) -> int:
    """The CUDA-graph batch bucket of a batch: the next power of two."""
    size = 1
    while size < batch:
        size *= 2
    return size


class TritonModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_batch: int = 1,
        max_length: int = 4096,
        device="cuda",
        dtype: torch.dtype = torch.bfloat16,
        split_k: bool = True,
        cuda_graph: bool = True,
        fused_delta_decode: bool = True,
        out_projection_mlp: bool = True,
        output_norm_in_projection: bool = True,
        projected_delta_decode: bool = True,
        staged_out_projection_mlp: bool = True,
        screened_lm_head: bool = True,
        pdl: bool | None = None,
        progress: bool = False,
        fold_norms: bool | None = None,
    ):
        self.config = c = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_length = max_length
        self.split_k = split_k
        self.cuda_graph = cuda_graph and self.device.type == "cuda"
        self.fused_delta_decode = fused_delta_decode
        # a decode step's out-projection + residual and MLP by out_projection_mlp.py (one program per SM)
        self.out_projection_mlp = out_projection_mlp
        # with it, a DeltaNet layer's gated RMSNorm in out_projection_mlp's prologue, not in the decode step
        self.output_norm_in_projection = output_norm_in_projection
        # with it, a one-sequence decode step's DeltaNet in-projection and step in one kernel (projected_decode.py)
        self.projected_delta_decode = projected_delta_decode
        # with it, a one-sequence decode step's out-projection and MLP as one launch whose programs hold every
        # weight of the layer tail in shared memory (staged_out_projection_mlp.py: Gluon, Hopper, bfloat16)
        self.staged_out_projection_mlp = staged_out_projection_mlp
        # programmatic dependent launch between the decode kernels (Hopper and newer; default there)
        self.pdl = pdl_available(self.device) if pdl is None else bool(pdl)
        if self.pdl and not pdl_available(self.device):
            raise ValueError(f"pdl=True needs an NVIDIA GPU of compute capability 9.0 or newer, not {self.device}")
        # the pre-projection norms' weights in the projections' (FOLD_NORMS; their own weights then zeros)
        self.fold_norms = FOLD_NORMS if fold_norms is None else bool(fold_norms)

        def norm_and_weight(norm_weight, weight):
            if not self.fold_norms:
                return norm_weight, weight
            return torch.zeros_like(norm_weight), fold_norm(weight, norm_weight).contiguous()

        self.embed = weights["embed_tokens.weight"]
        self.lm_head = self.embed if c.tie_word_embeddings else weights["lm_head.weight"]
        self.final_norm = weights["norm.weight"]
        # with screened_lm_head, a greedy decode step's LM head (up to 16 sequences) reads an int8 copy of the head
        # and only the rows it cannot rule out (lm_head/screened.py: the exact argmax; the copy, 1 byte a weight)
        self.lm_head_screen = build_screen(self.lm_head) if screened_lm_head else None
        self.layers: list = []
        self.mlps: list[MLPWeights] = []
        for i, layer_type in enumerate(c.layer_types):
            p = f"layers.{i}."
            if layer_type == FULL_ATTENTION:
                a = p + "self_attn."
                q_rows = weights[a + "q_proj.weight"]
                if c.attn_output_gate:
                    per_head = q_rows.view(c.num_attention_heads, 2, c.head_dim, c.hidden_size)
                    q_rows = torch.cat([per_head[:, 1].reshape(-1, c.hidden_size),
                                        per_head[:, 0].reshape(-1, c.hidden_size)])
                input_norm, qkv = norm_and_weight(
                    weights[p + "input_layernorm.weight"],
                    torch.cat([q_rows, weights[a + "k_proj.weight"], weights[a + "v_proj.weight"]]).contiguous())
                self.layers.append(AttentionWeights(
                    input_norm=input_norm,
                    qkv=qkv,
                    q_norm=weights[a + "q_norm.weight"],
                    k_norm=weights[a + "k_norm.weight"],
                    out=weights[a + "o_proj.weight"],
                ))
            else:
                a = p + "linear_attn."
                input_norm, projection = norm_and_weight(
                    weights[p + "input_layernorm.weight"],
                    torch.cat([weights[a + "in_proj_qkv.weight"], weights[a + "in_proj_z.weight"],
                               weights[a + "in_proj_b.weight"], weights[a + "in_proj_a.weight"]]).contiguous())
                self.layers.append(DeltaNetWeights(
                    input_norm=input_norm,
                    projection=projection,
                    conv=weights[a + "conv1d.weight"][:, 0, :].contiguous(),
                    A_log=weights[a + "A_log"].float().contiguous(),
                    dt_bias=weights[a + "dt_bias"].float().contiguous(),
                    norm=weights[a + "norm.weight"],
                    out=weights[a + "out_proj.weight"],
                ))
            input_norm, gate_up = norm_and_weight(
                weights[p + "post_attention_layernorm.weight"],
                torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]).contiguous())
            self.mlps.append(MLPWeights(
                input_norm=input_norm,
                gate_up=gate_up,
                down=weights[p + "mlp.down_proj.weight"],
            ))
        self._staged_descriptors: list = []
        self._staged_counters = None
        if self._staged_tail_applies():
            # the TMA descriptors of each layer's three weights, and each layer's barrier counters (zero, and left
            # zero by every launch; a layer's own row, so no two launches in flight share one)
            self._staged_descriptors = [staged.weight_descriptors(layer.out, mlp.gate_up, mlp.down)
                                        for layer, mlp in zip(self.layers, self.mlps)]
            self._staged_counters = staged.new_counters(self.device, len(self.layers))
        self.rotary = rotary_table(max_length, c.rotary_dim, c.rope_theta, self.device)
        # the split-KV count of batch 1 for every batch: a sequence's attention is then summed in the same
        # order whatever batch it decodes in (batched generation equals one at a time)
        self.decode_splits = decode_splits(1, c.num_key_value_heads, max_length, self.device)
        self.state = ModelState(config, max_batch, max_length, self.device, dtype)
        self._reset_plans: dict[int, ZeroPlan] = {}  # slot -> the one launch that zeroes its states
        self._buffers: dict[int, DecodeBuffers] = {}
        self._graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._decode_attention_tuned = False  # _tune_decode_attention has run
        # progress of the warm-ups on stderr (the first prefill, each decode graph's first step): they compile
        # and autotune the kernels, once per machine (the choices are cached on disk)
        self.progress = progress
        self._layer_done = None
        self._prefilled = False
        self._prefill_graphs: dict[tuple, tuple] = {}  # (tokens, slot, all_logits) -> (graph, ids, logits)
        self._prefill_seen: dict[tuple, int] = {}
        self._prefill_pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self.trace: KernelTrace | None = None  # set by qwen-triton profile while it records launches
        self.trace_context = 0  # the decode context the trace's attention bytes are counted at

    def reset(self, slot: int | None = None) -> None:
        """Forget the sequence in `slot` (all slots when None): its conv and recurrent states zeroed, one launch a
        slot (`ZeroPlan`, built on the slot's first reset; the KV cache needs no zeroing, see ModelState.reset)."""
        for s in range(self.max_batch) if slot is None else [slot]:
            if s not in self._reset_plans:
                self._reset_plans[s] = ZeroPlan(self.state.slot_states(s))
            self._reset_plans[s]()

    # ---- tracing: which operator launched which kernel (qwen-triton profile) -------------------------
    def _operator(self, kind: str, layer: int | None, cost=None):
        """Name the kernels launched inside for `qwen-triton profile`; cost() -> (bytes, flops) of the
        operator's floor, evaluated only while tracing. A no-op otherwise."""
        if self.trace is None:
            return nullcontext()
        moved, flops = cost() if cost is not None else (0, 0)
        return self.trace.operator(kind, layer, moved, flops)

    def _linear(self, kind: str, layer: int | None, x, weight, out=None, pdl=False, **options):
        """`linear` with the model's split-K switch, traced as one operator."""
        def cost():
            rows, width = x.shape[0], weight.shape[0] // (2 if options.get("activation") else 1)
            activations = rows * (x.shape[1] + width * (2 if options.get("residual") is not None else 1))
            return weight.numel() * weight.element_size() + activations * x.element_size(), 2 * rows * weight.numel()

        with self._operator(kind, layer, cost):
            return linear(x, weight, out=out, split_k=self.split_k, pdl=pdl, **options)

    # ---- the layers, shared by prefill and decode ------------------------------------------------
    def _norm(self, norm_weight, squares) -> dict:
        """A projection's norm options: its weight in the prologue, or with squares (a prefill's rows' sums of
        squares) the folded norm in the epilogue (see the module docstring)."""
        if squares is None:
            return dict(norm_weight=norm_weight, eps=self.config.rms_norm_eps)
        return dict(norm_squares=squares, eps=self.config.rms_norm_eps)

    def _attention(self, i, w: AttentionWeights, mlp: MLPWeights, x, positions, slots, attend, scratch=None,
                   pdl=False, squares=None):
        c = self.config
        qkv = self._linear("attention in-projection", i, x, w.qkv, **self._norm(w.input_norm, squares),
                           out=None if scratch is None else scratch["attention_qkv"], pdl=pdl)
        gate_width = c.num_attention_heads * c.head_dim if c.attn_output_gate else 0
        rows, heads = x.shape[0], c.num_attention_heads + 2 * c.num_key_value_heads
        with self._operator("q/k norm + rotary + KV write", i,
                            lambda: (2 * rows * heads * c.head_dim * x.element_size(), 10 * rows * heads * c.head_dim)):
            q = qk_norm_rotary(
                qkv[:, gate_width:], w.q_norm, w.k_norm, self.rotary, positions, slots,
                self.state.key[i], self.state.value[i],
                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                gated=False, eps=c.rms_norm_eps, out=None if scratch is None else scratch["attention_q"], pdl=pdl,
            )
        attended = attend(i, q, self.state.key[i], self.state.value[i])
        gate = qkv[:, :gate_width] if c.attn_output_gate else None
        return self._layer_tail(i, "attention gate + out-projection", attended.view(attended.shape[0], -1), w.out,
                                x, mlp, scratch, gate=gate, pdl=pdl, squares=squares)

    def _split_projection(self, projection):
        c = self.config
        conv_dim, value_dim, heads = c.linear_conv_dim, c.linear_value_dim, c.linear_num_value_heads
        mixed = projection[:, :conv_dim]
        z = projection[:, conv_dim:conv_dim + value_dim]
        b = projection[:, conv_dim + value_dim:conv_dim + value_dim + heads]
        a = projection[:, conv_dim + value_dim + heads:]
        return mixed, z, b, a

    def _heads(self, mixed):
        c = self.config
        rows = mixed.shape[0]
        q = mixed[:, :c.linear_key_dim].view(rows, c.linear_num_key_heads, c.linear_key_head_dim)
        k = mixed[:, c.linear_key_dim:2 * c.linear_key_dim].view(rows, c.linear_num_key_heads, c.linear_key_head_dim)
        v = mixed[:, 2 * c.linear_key_dim:].view(rows, c.linear_num_value_heads, c.linear_value_head_dim)
        return q, k, v

    def _state_bytes(self, rows: int) -> int:
        """The recurrent and conv state of `rows` sequences of one DeltaNet layer, read and written."""
        c = self.config
        recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * self.embed.element_size()
        return 2 * rows * (recurrent + conv)

    def _fused_tail(self, rows: int, scratch) -> bool:
        """Whether a layer's out-projection and MLP run as `out_projection_mlp` (a decode step of up to 16
        rows, option out_projection_mlp)."""
        return scratch is not None and self.out_projection_mlp and rows <= MAX_ROWS

    def _staged_tail_applies(self) -> bool:
        """Whether this model can run `staged_out_projection_mlp` at all (option staged_out_projection_mlp): a
        Hopper GPU (not the interpreter), bfloat16, sizes its launch plan takes and a DeltaNet value head its
        head norm takes (a power of two of at least 32)."""
        c = self.config
        head_dim = c.linear_value_head_dim
        return (self.staged_out_projection_mlp and self.out_projection_mlp and self.device.type == "cuda"
                and not interpreting() and hopper_or_later(self.device) and self.dtype == torch.bfloat16
                and staged.plan(c.hidden_size, self.layers[0].out.shape[1], c.intermediate_size,
                                sm_count(self.device)) is not None
                and all(layer.out.shape[1] == self.layers[0].out.shape[1] for layer in self.layers)
                and head_dim >= 32 and head_dim & (head_dim - 1) == 0)

    def _layer_tail(self, i, kind: str, attended, out_weight, x, mlp: MLPWeights, scratch=None, gate=None,
                    pdl=False, head_norm=None, squares=None):
        """x + out-projection(attended) (+ residual), then + MLP: `out_projection_mlp` (one program per SM per
        phase) where _fused_tail, else the three `linear` projections. head_norm (z, weight): attended is the
        delta rule's output, normed by out_projection_mlp's prologue (the fused path only). squares: the prefill's
        rows' sums of squares, which each residual add rewrites for the norm folded into the next projection."""
        c = self.config
        if self._fused_tail(x.shape[0], scratch):
            def cost():
                return out_projection_mlp_cost(x.shape[0], c.hidden_size, attended.shape[1], c.intermediate_size,
                                               gate=gate is not None, element_size=x.element_size())

            with self._operator(f"{kind} + residual + MLP", i, cost):
                if self._staged_counters is not None and x.shape[0] == 1:
                    return staged.staged_out_projection_mlp(
                        attended, out_weight, x, mlp.input_norm, mlp.gate_up, mlp.down, c.rms_norm_eps,
                        self._staged_counters[i], gate=gate, act=scratch["mlp_hidden"], pdl=pdl,
                        head_norm=head_norm, descriptors=self._staged_descriptors[i])
                return out_projection_mlp(attended, out_weight, x, mlp.input_norm, mlp.gate_up, mlp.down,
                                          c.rms_norm_eps, gate=gate, act=scratch["mlp_hidden"], pdl=pdl,
                                          head_norm=head_norm)
        if head_norm is not None:
            raise ValueError("head_norm needs out_projection_mlp (a decode step of up to 16 rows)")
        x = self._linear(kind + (" + residual" if gate is None else ""), i, attended, out_weight, gate=gate,
                         residual=x, out=x, pdl=pdl, squares_out=squares)
        return self._mlp(i, mlp, x, scratch, pdl=pdl, squares=squares)

    def _mlp(self, i, w: MLPWeights, x, scratch=None, pdl=False, squares=None):
        hidden = self._linear("mlp norm + gate/up + swiglu", i, x, w.gate_up, **self._norm(w.input_norm, squares),
                              activation="swiglu", out=None if scratch is None else scratch["mlp_hidden"], pdl=pdl)
        return self._linear("mlp down-projection + residual", i, hidden, w.down, residual=x, out=x, pdl=pdl,
                            squares_out=squares)

    def _lm_head_cost(self, rows: int, logits: bool, screened: bool = False):
        weight = self.lm_head.numel() * self.lm_head.element_size()
        if screened:  # the int8 copy and the per-row floats, not the candidates' rows (few, data-dependent)
            weight = screened_lm_head_bytes(*self.lm_head.shape)
        return lambda: (weight + rows * self.lm_head.shape[0] * 4 * logits, 2 * rows * self.lm_head.numel())

    # ---- prefill: one sequence ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0, all_logits: bool = True):
        """Tokens [T] of the sequence in `slot` after `start` cached ones: float32 logits [T or 1, vocab].

        With cuda_graph, a prefill from position 0 that repeats an earlier (length, slot, all_logits) is
        captured in a CUDA graph on its second call and replayed from then on: the ~180 launches of a
        prefill cost the host far more than the GPU work at short lengths. A length seen once runs eagerly
        (no capture cost for one-off prompts); at most PREFILL_GRAPHS graphs are kept, sharing one pool.
        """
        token_ids = token_ids.to(self.device)
        if not (self.cuda_graph and start == 0):
            return self._prefill(token_ids, slot, start, all_logits)
        key = (token_ids.shape[0], slot, all_logits)
        entry = self._prefill_graphs.get(key)
        if entry is None:
            self._prefill_seen[key] = self._prefill_seen.get(key, 0) + 1
            if self._prefill_seen[key] < 2:
                return self._prefill(token_ids, slot, start, all_logits)  # also the warm-up of this shape
            if len(self._prefill_graphs) >= PREFILL_GRAPHS:
                self._prefill_graphs.pop(next(iter(self._prefill_graphs)))
            static_ids = token_ids.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._prefill_pool):
                logits = self._prefill(static_ids, slot, start, all_logits)
            entry = self._prefill_graphs[key] = (graph, static_ids, logits)
        graph, static_ids, logits = entry
        static_ids.copy_(token_ids)
        graph.replay()
        return logits.clone()

    def _prefill(self, token_ids: torch.Tensor, slot: int, start: int, all_logits: bool):
        c = self.config
        tokens = token_ids.shape[0]
        positions = torch.arange(start, start + tokens, device=self.device, dtype=torch.int32)
        slots = torch.full((tokens,), slot, device=self.device, dtype=torch.int32)
        element = self.embed.element_size()
        if self.progress and not self._prefilled:
            self._layer_done = progress_printer("first prefill: compiling and autotuning (cached on disk), layers")
        self._prefilled = True
        with self._operator("embedding", None, lambda: (2 * tokens * c.hidden_size * element, 0)):
            x = embedding(token_ids, self.embed)
        pdl = self.pdl and PREFILL_PDL and tokens <= PREFILL_PDL_TOKENS  # not for the delta rule (above)
        squares = None  # the rows' sums of squares, for the folded norms of a prompt the GEMM serves
        if self.fold_norms and tokens > MAX_ROWS:
            squares = torch.empty(tokens, -(-c.hidden_size // SQUARES_COLUMNS), device=self.device,
                                  dtype=torch.float32)
            with self._operator("embedding's sums of squares", None, lambda: (tokens * c.hidden_size * element, 0)):
                row_squares(x, out=squares)

        def attend(i, q, key_cache, value_cache):
            def cost():
                keys = start + tokens
                visible = tokens * start + tokens * (tokens + 1) // 2
                moved = (2 * tokens * c.num_attention_heads * c.head_dim
                         + 2 * keys * c.num_key_value_heads * c.head_dim) * element
                return moved, 4 * c.num_attention_heads * c.head_dim * visible

            with self._operator("attention (flash prefill)", i, cost):
                return attention_prefill(q, key_cache, value_cache, slot=slot, start=start, pdl=pdl)

        for i, (w, mlp) in enumerate(zip(self.layers, self.mlps)):
            if isinstance(w, AttentionWeights):
                x = self._attention(i, w, mlp, x, positions, slots, attend, pdl=pdl, squares=squares)
            else:
                projection = self._linear("deltanet in-projection", i, x, w.projection,
                                          **self._norm(w.input_norm, squares), pdl=pdl)
                mixed, z, b, a = self._split_projection(projection)
                with self._operator("deltanet conv + silu", i,
                                    lambda: (2 * tokens * c.linear_conv_dim * element,
                                             2 * tokens * c.linear_conv_dim * c.linear_conv_kernel_dim)):
                    mixed = causal_conv1d(mixed, w.conv, self.state.conv[i][slot], pdl=pdl)
                q, k, v = self._heads(mixed)

                def delta_cost():  # q, k, v and z in, the normed output out (the chunk size: chunk.py's choice)
                    chunk = chunk_size_for(tokens)
                    per_token_head = 2 * chunk * (c.linear_key_head_dim + c.linear_value_head_dim) + \
                        6 * c.linear_key_head_dim * c.linear_value_head_dim
                    return (self._state_bytes(1) + tokens * (c.linear_conv_dim + 2 * c.linear_value_dim) * element,
                            tokens * c.linear_num_value_heads * per_token_head)

                # the gated RMSNorm in the chunked rule's output kernel (each of its programs holds whole head rows)
                with self._operator("gated delta rule (chunked) + gated norm", i, delta_cost):
                    out = gated_delta_rule_chunked(q, k, v, a, b, w.A_log, w.dt_bias, self.state.recurrent[i][slot],
                                                   output_norm=(z, w.norm, c.rms_norm_eps))
                x = self._layer_tail(i, "deltanet out-projection", out.view(tokens, -1), w.out, x, mlp, pdl=pdl,
                                     squares=squares)
            if self._layer_done is not None:
                self._layer_done(i + 1, len(self.layers))
        self._layer_done = None
        rows = x if all_logits else x[-1:]
        with self._operator("final norm + lm head", None, self._lm_head_cost(rows.shape[0], logits=True)):
            return lm_head_logits(rows, self.lm_head, norm_weight=self.final_norm, eps=c.rms_norm_eps)

    # ---- decode: one token for each of slots 0..B-1 ---------------------------------------------
    def _projected_step(self, rows: int, scratch) -> bool:
        """Whether a DeltaNet layer's decode step runs as `gated_delta_rule_decode_projected` (one sequence, the
        step's output normed by out_projection_mlp's prologue; option projected_delta_decode)."""
        c = self.config
        return (self.projected_delta_decode and rows == 1 and self.fused_delta_decode
                and self.output_norm_in_projection and self._fused_tail(rows, scratch)
                and c.linear_key_head_dim % PROJECTED_ROWS == 0 and c.linear_value_head_dim % PROJECTED_ROWS == 0)

    def _projected_delta_layer(self, i, w: DeltaNetWeights, mlp: MLPWeights, x, scratch):
        """A one-sequence DeltaNet layer's decode: in-projection and step in one kernel, then its tail."""
        c = self.config

        def cost():
            return gated_delta_rule_decode_projected_cost(
                c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                c.linear_value_head_dim, c.linear_conv_kernel_dim, self.embed.element_size())

        with self._operator("deltanet in-projection + step (conv, gating, delta rule)", i, cost):
            out = gated_delta_rule_decode_projected(
                x, w.input_norm, c.rms_norm_eps, w.projection, w.conv, self.state.conv[i][:1], w.A_log, w.dt_bias,
                self.state.recurrent[i][:1], scratch["delta_projection"], scratch["delta_qk"], scratch["delta_out"],
                pdl=self.pdl)
        _, z, _, _ = self._split_projection(scratch["delta_projection"])
        return self._layer_tail(i, "deltanet gated norm + out-projection", out.view(1, -1), w.out, x, mlp, scratch,
                                pdl=self.pdl, head_norm=(z, w.norm))

    def _buffers_for(self, batch: int) -> DecodeBuffers:
        size = bucket(batch)
        if size > self.max_batch:
            raise ValueError(f"batch {batch} exceeds max_batch {self.max_batch}")
        if size not in self._buffers:
            self._buffers[size] = DecodeBuffers(self, size)
        return self._buffers[size]

    def _decode_body(self, buffers: DecodeBuffers, mode: str, feedback: bool = False) -> None:
        """One decode step on static buffers; allocation-free once every kernel has been warmed up. With
        feedback, its last kernel makes the chosen ids the next step's inputs (positions + 1)."""
        c = self.config
        pdl = self.pdl
        size = buffers.size
        element = self.embed.element_size()
        with self._operator("embedding", None, lambda: (2 * size * c.hidden_size * element, 0)):
            x = embedding(buffers.token_ids, self.embed, out=buffers.hidden)

        def attend(i, q, key_cache, value_cache):
            def cost():  # the KV cache at the traced context, q and the output
                keys = self.trace_context + 1
                moved = size * (2 * keys * c.num_key_value_heads + 2 * c.num_attention_heads) * c.head_dim * element
                return moved, 4 * size * c.num_attention_heads * c.head_dim * keys

            with self._operator("attention (split-KV decode + merge)", i, cost):
                return attention_decode(q, key_cache, value_cache, buffers.lengths, out=buffers.attention_out,
                                        num_splits=self.decode_splits, pdl=pdl)

        for i, (w, mlp) in enumerate(zip(self.layers, self.mlps)):
            if isinstance(w, AttentionWeights):
                x = self._attention(i, w, mlp, x, buffers.positions, buffers.slots, attend, buffers.scratch, pdl=pdl)
            elif self._projected_step(size, buffers.scratch):
                x = self._projected_delta_layer(i, w, mlp, x, buffers.scratch)
            else:
                projection = self._linear("deltanet in-projection", i, x, w.projection, norm_weight=w.input_norm,
                                          eps=c.rms_norm_eps, out=buffers.scratch["delta_projection"], pdl=pdl)
                mixed, z, b, a = self._split_projection(projection)
                conv_state, state = self.state.conv[i][:size], self.state.recurrent[i][:size]

                def delta_cost():
                    moved = self._state_bytes(size) + w.conv.numel() * element + \
                        size * (projection.shape[1] + c.linear_value_dim) * element
                    return moved, 8 * size * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim

                head_norm = None
                if self.fused_delta_decode:
                    # the gated norm in the out-projection's prologue where that is out_projection_mlp
                    norm_later = self.output_norm_in_projection and self._fused_tail(size, buffers.scratch)
                    kind = "deltanet step (conv, gating, delta rule" + (")" if norm_later else ", gated norm)")
                    with self._operator(kind, i, delta_cost):
                        out = gated_delta_rule_decode_fused(
                            mixed, z, a, b, w.conv, conv_state, w.A_log, w.dt_bias, w.norm, c.rms_norm_eps, state,
                            out=buffers.scratch["delta_normed"], delta_out=buffers.scratch["delta_out"], pdl=pdl,
                            normalize=not norm_later,
                        )
                    if norm_later:
                        out, head_norm = out.view(size, -1), (z, w.norm)
                else:
                    with self._operator("deltanet step (unfused: conv, delta rule, gated norm)", i, delta_cost):
                        mixed = causal_conv1d_step(mixed, w.conv, conv_state, out=buffers.scratch["conv_out"])
                        q, k, v = self._heads(mixed)
                        out = gated_delta_rule_recurrent(q, k, v, a, b, w.A_log, w.dt_bias, state,
                                                         out=buffers.scratch["delta_out"])
                        out = gated_rms_norm(out, z, w.norm, c.rms_norm_eps, out=buffers.scratch["delta_normed"])
                x = self._layer_tail(i, "deltanet " + ("gated norm + " if head_norm else "") + "out-projection",
                                     out, w.out, x, mlp, buffers.scratch, pdl=pdl, head_norm=head_norm)
            if self._layer_done is not None:
                self._layer_done(i + 1, len(self.layers))
        final = dict(norm_weight=self.final_norm, eps=c.rms_norm_eps, pdl=pdl and LM_HEAD_PDL)
        screened = mode == "greedy" and size <= SCREENED_ROWS and self.lm_head_screen is not None
        kind = "final norm + lm head" + (" (int8 screen, exact check)" if screened else "")
        with self._operator(kind + (" + argmax" if mode in ("greedy", "temperature") else ""), None,
                            self._lm_head_cost(size, logits=mode not in ("greedy", "temperature"), screened=screened)):
            if screened:
                lm_head_argmax_screened(x, self.lm_head, self.lm_head_screen, out=buffers.next_tokens,
                                        **dict(final, pdl=pdl and SCREENED_LM_HEAD_PDL))
            elif mode == "greedy":
                lm_head_argmax(x, self.lm_head, out=buffers.next_tokens, **final)
            elif mode == "temperature":  # Gumbel-max inside the LM head: no logits written
                lm_head_argmax(x, self.lm_head, out=buffers.next_tokens, temperature=buffers.temperature,
                               seed=buffers.seed, step=buffers.step, **final)
            else:
                lm_head_logits(x, self.lm_head, out=buffers.logits, **final)
        if mode == "sample":
            with self._operator("sampling (top-k / top-p)", None, lambda: (2 * size * c.vocab_size * 4, 0)):
                sample(buffers.logits, buffers.temperature, buffers.top_k, buffers.top_p, buffers.seed,
                       buffers.step, out=buffers.next_tokens)
        if feedback:
            with self._operator("feedback: chosen ids -> next inputs", None, lambda: (72 * size, 0)):
                feed_back(buffers.next_tokens, buffers.token_ids, buffers.positions, buffers.lengths, buffers.step,
                          self.max_length - 1, pdl=pdl, host_ids=buffers.host_ids)

    def _tune_decode_attention(self, buffers: DecodeBuffers) -> None:
        """Let the split-KV attention's autotuner make its one pick (cached on disk, then used at every context)
        on a call over the longest context this model serves, where its config matters, rather than on the
        first step's few keys, where the configs differ by noise: the pick no longer depends on the context of
        the process's first step. Measured (benchmarks/engine_options.py, four processes each tuning afresh,
        docs/perf-notes.md, seventeenth session): this pick (16-key tiles, 2 warps, 4 stages, both times) 687.2
        and 687.3 us a step at context 32768, the first step's picks 690.2 and 693.0; at 128, 566.3-566.6
        against 566.9-571.6. The call reads the cache's whole length (its values do not matter) into the step's
        own output buffer, which the step then overwrites; under the interpreter (one config, nothing to tune)
        it only costs its time, and the CPU tests check it that way."""
        if self._decode_attention_tuned or not TUNE_DECODE_ATTENTION_AT_FULL_LENGTH:
            return
        self._decode_attention_tuned = True
        attention = next((i for i, w in enumerate(self.layers) if isinstance(w, AttentionWeights)), None)
        if attention is None:
            return
        lengths = torch.full((buffers.size,), self.max_length, device=self.device, dtype=torch.int32)
        attention_decode(buffers.scratch["attention_q"], self.state.key[attention], self.state.value[attention],
                         lengths, out=buffers.attention_out, num_splits=self.decode_splits, pdl=self.pdl)

    def _run(self, buffers: DecodeBuffers, mode: str, feedback: bool = False) -> None:
        self._tune_decode_attention(buffers)
        if not self.cuda_graph:
            self._decode_body(buffers, mode, feedback)
            return
        key = (buffers.size, mode, feedback)
        graph = self._graphs.get(key)
        if graph is None:
            # warm-up outside the graph: compiles, autotunes and allocates every workspace. It runs the
            # step once for real, so the states it advances are restored before capture and replay.
            saved = self._save_state(buffers.size)
            inputs = [t.clone() for t in (buffers.token_ids, buffers.positions, buffers.lengths, buffers.step)]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            if self.progress:
                self._layer_done = progress_printer(
                    f"decode warm-up (batch {buffers.size}, {mode}): compiling and autotuning (cached on disk), layers")
            try:
                with torch.cuda.stream(stream):
                    self._decode_body(buffers, mode, feedback)
            finally:
                self._layer_done = None
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._decode_body(buffers, mode, feedback)
            self._restore_state(buffers.size, saved)
            for buffer, value in zip((buffers.token_ids, buffers.positions, buffers.lengths, buffers.step), inputs):
                buffer.copy_(value)
            self._graphs[key] = graph
        graph.replay()

    def _save_state(self, size: int):
        return ({i: t[:size].clone() for i, t in self.state.conv.items()},
                {i: t[:size].clone() for i, t in self.state.recurrent.items()})

    def _restore_state(self, size: int, saved) -> None:
        conv, recurrent = saved
        for i, t in conv.items():
            self.state.conv[i][:size].copy_(t)
        for i, t in recurrent.items():
            self.state.recurrent[i][:size].copy_(t)

    def _load_inputs(self, buffers: DecodeBuffers, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        batch = token_ids.shape[0]
        buffers.fed_back = 0
        buffers.token_ids[:batch].copy_(token_ids)
        buffers.positions[:batch].copy_(positions)
        buffers.lengths[:batch].copy_(positions + 1)
        if batch < buffers.size:
            # padding rows of the bucket: run on their own slots at position 0, their results unused
            buffers.token_ids[batch:].zero_()
            buffers.positions[batch:].zero_()
            buffers.lengths[batch:].fill_(1)

    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step for slots 0..B-1: float32 logits [B, vocab]."""
        buffers = self._buffers_for(token_ids.shape[0])
        self._load_inputs(buffers, token_ids, positions)
        self._run(buffers, "logits")
        return buffers.logits[: token_ids.shape[0]].clone()

    @torch.no_grad()
    def decode_tokens(self, token_ids, positions, sampling: "DeviceSampling", step,
                      feedback: bool = False) -> torch.Tensor:
        """One step for slots 0..B-1, choosing the next ids on the device: int64 [B], a view of a static
        buffer. sampling holds the rows' parameters (device tensors) and the mode the host chose from
        them; step [B] is each row's draw counter (its number of generated tokens).

        feedback=True ends the step with the feedback kernel: the chosen ids, positions + 1 and step + 1
        become the next step's inputs on the device, and the next call may pass token_ids, positions and
        step as None to continue from them without any host input (how generation runs ahead of the host:
        engine/decode_pipeline.py)."""
        batch = sampling.temperature.shape[0]
        buffers = self._buffers_for(batch)
        if token_ids is None:
            if positions is not None or step is not None:
                raise ValueError("continuing from the fed-back inputs: pass token_ids, positions and step all as None")
            if buffers.fed_back != batch:
                raise ValueError("nothing to continue from: the previous step of this batch did not run with feedback")
        else:
            if token_ids.shape[0] != batch:
                raise ValueError(f"token_ids has {token_ids.shape[0]} rows, the sampling parameters {batch}")
            self._load_inputs(buffers, token_ids, positions)
            if step is not None:
                buffers.step[:batch].copy_(step)
        if sampling.mode != "greedy":
            buffers.temperature[:batch].copy_(sampling.temperature)
            buffers.top_k[:batch].copy_(sampling.top_k)
            buffers.top_p[:batch].copy_(sampling.top_p)
            buffers.seed[:batch].copy_(sampling.seed)
        self._run(buffers, sampling.mode, feedback)
        buffers.fed_back = batch if feedback else 0
        return buffers.next_tokens[:batch]

    def chosen_on_host(self, batch: int) -> torch.Tensor:
        """int64 [2, bucket(batch)]: where the steps with feedback of this batch leave their ids, row r's id of a
        step in row (its step counter before the step) % 2 (pinned host memory on a GPU); read it after the
        step is done (an event recorded after decode_tokens)."""
        return self._buffers_for(batch).host_ids

    @torch.no_grad()
    def choose_first(self, logits: torch.Tensor, sampling: "DeviceSampling", row: int) -> torch.Tensor:
        """The first generated id of row `row` from its prefill logits [1, V], drawn as decode draws
        (same noise stream at step 0)."""
        if sampling.mode == "greedy":
            return lm_argmax_rows(logits)
        pick = slice(row, row + 1)
        step = torch.zeros(1, device=self.device, dtype=torch.int64)
        return sample(logits, sampling.temperature[pick], sampling.top_k[pick], sampling.top_p[pick],
                      sampling.seed[pick], step, filtering=sampling.mode == "sample")


def lm_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice from materialised logits: the sampler at temperature 0 (argmax, lowest id on ties)."""
    rows = logits.shape[0]
    zeros = torch.zeros(rows, device=logits.device)
    return sample(logits, zeros, torch.zeros(rows, device=logits.device, dtype=torch.int32),
                  torch.ones(rows, device=logits.device), torch.zeros(1, device=logits.device, dtype=torch.int64),
                  torch.zeros(rows, device=logits.device, dtype=torch.int64), filtering=False)


@dataclass
class DeviceSampling:
    """The sampling parameters of a batch's rows as device tensors, and the decode mode they need."""

    mode: str  # "greedy" | "temperature" (Gumbel-max in the LM head) | "sample" (top-k / top-p filtering)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def build(cls, rows, device) -> "DeviceSampling":
        """rows: one SamplingParams per batch row."""
        if all(p.temperature == 0 for p in rows):
            mode = "greedy"
        elif all(p.top_k == 0 and p.top_p >= 1.0 for p in rows):
            mode = "temperature"
        else:
            mode = "sample"
        return cls(
            mode=mode,
            temperature=torch.tensor([p.temperature for p in rows], device=device, dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in rows], device=device, dtype=torch.int32),
            top_p=torch.tensor([p.top_p for p in rows], device=device, dtype=torch.float32),
            seed=torch.tensor([p.seed for p in rows], device=device, dtype=torch.int64),
        )


class DecodeBuffers:
    """Every tensor a decode step of `size` rows reads or writes, allocated once."""

    def __init__(self, model: TritonModel, size: int):
        c, device, dtype = model.config, model.device, model.dtype
        self.size = size
        self.token_ids = torch.zeros(size, device=device, dtype=torch.int64)
        self.positions = torch.zeros(size, device=device, dtype=torch.int32)
        self.lengths = torch.ones(size, device=device, dtype=torch.int32)
        self.slots = torch.arange(size, device=device, dtype=torch.int32)
        self.hidden = torch.zeros(size, c.hidden_size, device=device, dtype=dtype)
        self.attention_out = torch.zeros(size, c.num_attention_heads, c.head_dim, device=device, dtype=dtype)
        gate_width = c.num_attention_heads * c.head_dim if c.attn_output_gate else 0
        qkv_width = gate_width + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        projection_width = c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads

        def zeros(*shape):
            return torch.zeros(*shape, device=device, dtype=dtype)

        self.scratch = {
            "attention_qkv": zeros(size, qkv_width),
            "attention_q": zeros(size, c.num_attention_heads, c.head_dim),
            "delta_projection": zeros(size, projection_width),
            "conv_out": zeros(size, c.linear_conv_dim),
            "delta_qk": zeros(size, 2 * c.linear_key_dim),
            "delta_out": zeros(size, c.linear_num_value_heads, c.linear_value_head_dim),
            "delta_normed": zeros(size, c.linear_value_dim),
            "mlp_hidden": zeros(size, c.intermediate_size),
        }
        self.logits = torch.zeros(size, c.vocab_size, device=device, dtype=torch.float32)
        self.next_tokens = torch.zeros(size, device=device, dtype=torch.int64)
        self.temperature = torch.zeros(size, device=device, dtype=torch.float32)
        self.top_k = torch.zeros(size, device=device, dtype=torch.int32)
        self.top_p = torch.ones(size, device=device, dtype=torch.float32)
        self.seed = torch.zeros(size, device=device, dtype=torch.int64)
        self.step = torch.zeros(size, device=device, dtype=torch.int64)
        # the ids of a step with feedback, written by its last kernel into row step % 2 (pinned host memory on a
        # GPU, read by the host once the step is done: engine/decode_pipeline.py)
        self.host_ids = torch.zeros(2, size, dtype=torch.int64, pin_memory=device.type == "cuda")
        if device.type != "cuda":
            self.host_ids = self.host_ids.to(device)
        self.fed_back = 0  # rows whose inputs the last step wrote (feedback); 0 when the host must give them
