"""The Triton backend: Qwen3.5 composed from the kernels in `qwen_triton.operators`.

The same interface as the reference model (engine/backend.py: `prefill`, `decode`, `reset`), plus
`decode_tokens`, the step generation uses: it samples on the device, inside the CUDA graph. Which kernel runs
each operator in each phase and size bucket is the `Plan` (engine/plan.py, resolved once at load from the
config, the device and the options; `qwen-triton ops` prints it and the operator table).

The jobs around the layers live beside this file: weight packing and norm folding (packing.py), the decode
step's buffers (buffers.py), the CUDA-graph manager (graphs.py), the sampling glue (device_sampling.py), the
cost model of each operator's floor (costs.py) and the trace that names each operator's kernels (trace.py).

The layers: a prefill's projection applies its (folded) norm as a scale of its output rows in its epilogue, from
the rows' sums of squares that the projection before it left (linear's norm_squares, squares_out); a decode
step's projections normalise x in their prologues. The residual adds are fused into their epilogues, SwiGLU into
the gate/up epilogue and the attention output gate into the o_proj prologue; in a decode step the DeltaNet output
norm too, and, as the plan says, a one-sequence DeltaNet layer's in-projection, conv, gates and delta rule run as
one kernel, and a layer's out-projection and MLP as one launch (on Hopper for one sequence with every weight in
shared memory). A greedy step's LM head (up to 16 sequences) reads an int8 copy of the head made at load and
computes exactly only the rows whose bound leaves them a chance (the exact argmax); a top-k sampling step's
computes only the rows that can reach the top k (lm_head/screened_top_k.py).

With `feedback=True` the step ends with a kernel that writes its chosen ids back as the next step's inputs, so
generation can launch the next step before reading this one's ids (engine/decode_pipeline.py). With PDL (the
default on Hopper and newer) the decode kernels start while the previous one drains, stream their weights, and
wait before reading their input (operators/common.py); so do a short prefill's projections, convs and attention.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..operators.common import interpreting
from ..operators.attention import (attention_decode, attention_prefill, attention_prefill_packed, decode_splits,
                                   qk_norm_rotary, rotary_table)
from ..operators.conv import causal_conv1d, causal_conv1d_packed, causal_conv1d_step
from ..operators.embedding import embedding
from ..operators.gated_delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_chunked_packed,
    gated_delta_rule_decode_fused,
    gated_delta_rule_decode_projected,
    gated_delta_rule_recurrent,
    gated_rms_norm,
)
from ..operators.lm_head import lm_head_argmax, lm_head_logits
from ..operators.lm_head.screened import build_screen, lm_head_argmax_screened
from ..operators.lm_head.screened_top_k import lm_head_screened_top_k
from ..operators.linear import linear, out_projection_mlp
from ..operators.linear import staged_out_projection_mlp as staged
from ..operators.linear.fusion import SQUARES_COLUMNS
from ..operators.memory import ZeroPlan
from ..operators.norm import row_squares
from ..operators.sampling import apply_penalties, count_tokens, feed_back, sample
from ..progress import progress_printer
from ..state import ModelState
from ..tuning import active
from ..tuning.picks import install as install_picks
from . import costs
from .backend import check_decode_slots, check_prefill_batch
from .buffers import DecodeBuffers, PenaltyHistory, bucket
from .device_sampling import (LOGITS_MODES, PENALIZED_MODES, SEARCH_MODES, TOP_K_MODES, DeviceSampling, choose_first,
                              sample_options)
from . import packed as prefill_packing
from .graphs import DecodeGraphs, PackedPrefillGraphs, PrefillGraphs
from .packing import AttentionWeights, DeltaNetWeights, MLPWeights, pack_weights
from .plan import (DELTA_FUSED, DELTA_FUSED_NORM, DELTA_PROJECTED, HEAD_ARGMAX, HEAD_GUMBEL, HEAD_LOGITS,
                   HEAD_SCREENED, HEAD_SCREENED_TOP_K, TAIL_LINEAR, TAIL_STAGED, DeviceProperties, Options,
                   resolve_plan)
from .trace import KernelTrace

__all__ = ["TritonModel", "DeviceSampling", "DecodeBuffers", "bucket"]


@dataclass
class ForwardPass:
    """What the layers of one forward pass need beside their weights and x: prefill (one sequence in `slot`
    after `start` cached tokens, or with `packed` the sequences of a packed layout: its blocks, operators/packed.py)
    or a decode step on `buffers` (row r: the sequence in slot slots[r])."""

    rows: int
    positions: torch.Tensor
    slots: torch.Tensor
    pdl: bool
    buffers: DecodeBuffers | None = None  # a decode step's
    squares: torch.Tensor | None = None  # a prefill's rows' sums of squares (the folded norms)
    slot: int = 0
    start: int = 0
    packed: torch.Tensor | None = None  # a packed prefill's blocks [T / 64, 4]
    sequences: tuple = ()  # a packed prefill's (length, start) of each prompt (the floors of a trace)

    @property
    def scratch(self) -> dict | None:
        return None if self.buffers is None else self.buffers.scratch

    def out(self, name: str):
        """A decode step's static output buffer `name`; None (allocate) in a prefill."""
        return None if self.buffers is None else self.buffers.scratch[name]


class TritonModel:
    """options: the fields of `plan.Options` (split_k, cuda_graph, pdl, fold_norms, ...)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_batch: int = 1,
        max_length: int = 4096,
        device="cuda",
        dtype: torch.dtype = torch.bfloat16,
        progress: bool = False,
        **options,
    ):
        self.config = c = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_length = max_length
        self.plan = plan = resolve_plan(config, DeviceProperties.of(self.device), Options(**options), dtype,
                                        tuning=active())
        if self.device.type == "cuda" and not interpreting():
            install_picks(torch.cuda.get_device_name(self.device))  # tuning/picks.py: this GPU's recorded picks
        packed = pack_weights(config, weights, plan.fold_norms)
        self.embed, self.lm_head, self.final_norm = packed.embed, packed.lm_head, packed.final_norm
        self.layers, self.mlps = packed.layers, packed.mlps
        # the screened heads' int8 copy (1 byte a weight) for a greedy or top-k step of up to plan.screened_rows rows
        self.lm_head_screen = build_screen(self.lm_head) if plan.screened_rows else None
        self._staged_descriptors: list = []
        self._staged_counters = None
        if plan.staged_tail:
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
        self.history = PenaltyHistory(max_batch, c.vocab_size, self.device)  # each slot's, for the penalties
        self.decode_graphs = DecodeGraphs(self.device, self.state, self.history) if plan.cuda_graph else None
        self.prefill_graphs = PrefillGraphs(plan.prefill_graphs) if plan.cuda_graph else None
        # a packed pass's token buckets (engine/packed.py) and, with cuda_graph, a graph per bucket
        self.packed_buckets = prefill_packing.token_buckets(max_length)
        # the LM head's sequence buckets: a pass holds at most max_batch prompts, one per aligned block
        self.packed_head_buckets = prefill_packing.sequence_buckets(
            min(max_batch, self.packed_buckets[-1] // prefill_packing.ALIGN))
        self.packed_graphs = (PackedPrefillGraphs(self.device, self.packed_buckets[-1], self.packed_head_buckets[-1],
                                                  c.hidden_size, dtype)
                              if plan.cuda_graph and plan.packed_prefill else None)
        self._decode_attention_tuned = False  # _tune_decode_attention has run
        # progress of the warm-ups on stderr (the first prefill, each decode graph's first step): they compile
        # and autotune the kernels, once per machine (the choices are cached on disk)
        self.progress = progress
        self._layer_done = None
        self._prefilled = False
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
    def _traced(self, kind: str, layer: int | None, cost=None, *cost_args, **cost_options):
        """Name the kernels launched inside for `qwen-triton profile`, with the operator's floor
        cost(*cost_args, **cost_options) -> (bytes, flops) from costs.py, evaluated only while tracing."""
        if self.trace is None:
            return nullcontext()
        moved, flops = cost(*cost_args, **cost_options) if cost is not None else (0, 0)
        return self.trace.operator(kind, layer, moved, flops)

    def _linear(self, kind: str, layer: int | None, x, weight, step: ForwardPass, out=None, **options):
        """`linear` with the plan's choices (split-K; the GEMV or, past plan.gemv_rows, the GEMM, in a decode step
        its resident-weights form up to plan.resident_rows) and the pass's PDL, traced as one operator. A prefill
        keeps the tiled GEMM at any length: a prompt then gets the same bits alone (its own rows) as in a packed
        pass (the rows of its token bucket)."""
        rows = x.shape[0]
        decode = step.buffers is not None
        resident = decode and self.plan.gemv_rows < rows <= self.plan.resident_rows
        with self._traced(kind, layer, costs.linear, x, weight, **options):
            return linear(x, weight, out=out, split_k=self.plan.split_k, pdl=step.pdl, gemv=rows <= self.plan.gemv_rows,
                          resident=resident, bucket_picks=decode and self.plan.bucket_gemm_picks, **options)

    # ---- the layers, shared by prefill and decode ------------------------------------------------
    def _norm(self, norm_weight, squares) -> dict:
        """A projection's norm options: its weight in the prologue, or with squares (a prefill's rows' sums of
        squares) the folded norm in the epilogue."""
        if squares is None:
            return dict(norm_weight=norm_weight, eps=self.config.rms_norm_eps)
        return dict(norm_squares=squares, eps=self.config.rms_norm_eps)

    def _attention_layer(self, i, w: AttentionWeights, mlp: MLPWeights, x, step: ForwardPass):
        c = self.config
        gate_width = c.num_attention_heads * c.head_dim if c.attn_output_gate else 0
        qkv = self._linear("attention in-projection", i, x, w.qkv, step, **self._norm(w.input_norm, step.squares),
                           out=step.out("attention_qkv"))
        with self._traced("q/k norm + rotary + KV write", i, costs.qk_norm_rotary, c, step.rows, x.element_size()):
            q = qk_norm_rotary(
                qkv[:, gate_width:], w.q_norm, w.k_norm, self.rotary, step.positions, step.slots,
                self.state.key[i], self.state.value[i],
                num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                gated=False, eps=c.rms_norm_eps, out=step.out("attention_q"), pdl=step.pdl,
            )
        gate = qkv[:, :gate_width] if c.attn_output_gate else None
        # a decode step whose tail is three projections gates the attention's output in its merge, one launch fewer
        merge_gate = step.buffers is not None and self.plan.decode_tail(step.rows) == TAIL_LINEAR
        attended = self._attend(i, q, step, gate=gate if merge_gate else None)
        return self._layer_tail(i, "attention " + ("" if merge_gate else "gate + ") + "out-projection",
                                attended.view(step.rows, -1), w.out, x, mlp, step, gate=None if merge_gate else gate)

    def _attend(self, i, q, step: ForwardPass, gate=None):
        """The attention of q over layer i's cache; gate (a decode step's): its output gate applied in the merge."""
        c, element = self.config, self.embed.element_size()
        key, value = self.state.key[i], self.state.value[i]
        if step.packed is not None:
            with self._traced("attention (flash prefill, packed)", i, costs.attention_prefill_packed, c,
                              step.sequences, element):
                return attention_prefill_packed(q, key, value, step.packed, pdl=step.pdl)
        if step.buffers is None:
            with self._traced("attention (flash prefill)", i, costs.attention_prefill, c, step.rows, step.start,
                              element):
                return attention_prefill(q, key, value, slot=step.slot, start=step.start, pdl=step.pdl)
        with self._traced("attention (split-KV decode + merge)", i, costs.attention_decode, c, step.rows,
                          self.trace_context, element):
            return attention_decode(q, key, value, step.buffers.lengths, out=step.buffers.attention_out,
                                    slots=step.slots, num_splits=self.decode_splits, gate=gate, pdl=step.pdl)

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

    def _deltanet_layer_prefill(self, i, w: DeltaNetWeights, mlp: MLPWeights, x, step: ForwardPass):
        c, tokens, element = self.config, step.rows, self.embed.element_size()
        projection = self._linear("deltanet in-projection", i, x, w.projection, step,
                                  **self._norm(w.input_norm, step.squares))
        mixed, z, b, a = self._split_projection(projection)
        conv_state, state, norm = self.state.conv[i], self.state.recurrent[i], (z, w.norm, c.rms_norm_eps)
        if step.packed is not None:  # each sequence from and into its slot's states
            valid = sum(length for length, _ in step.sequences)  # the floors count the prompts' tokens
            with self._traced("deltanet conv + silu (packed)", i, costs.conv_prefill, c, valid, element):
                mixed = causal_conv1d_packed(mixed, w.conv, conv_state, step.packed, pdl=step.pdl)
            with self._traced("gated delta rule (chunked, packed) + gated norm", i, costs.delta_rule_chunked, c,
                              valid, element):
                out = gated_delta_rule_chunked_packed(*self._heads(mixed), a, b, w.A_log, w.dt_bias, state,
                                                      step.packed, output_norm=norm)
            return self._layer_tail(i, "deltanet out-projection", out.view(tokens, -1), w.out, x, mlp, step)
        with self._traced("deltanet conv + silu", i, costs.conv_prefill, c, tokens, element):
            mixed = causal_conv1d(mixed, w.conv, conv_state[step.slot], pdl=step.pdl)
        q, k, v = self._heads(mixed)
        # the gated RMSNorm in the chunked rule's output kernel (each of its programs holds whole head rows)
        with self._traced("gated delta rule (chunked) + gated norm", i, costs.delta_rule_chunked, c, tokens, element):
            out = gated_delta_rule_chunked(q, k, v, a, b, w.A_log, w.dt_bias, state[step.slot], output_norm=norm)
        return self._layer_tail(i, "deltanet out-projection", out.view(tokens, -1), w.out, x, mlp, step)

    def _deltanet_layer_decode(self, i, w: DeltaNetWeights, mlp: MLPWeights, x, step: ForwardPass):
        c, size, scratch, element = self.config, step.rows, step.scratch, self.embed.element_size()
        variant = self.plan.decode_delta(size)
        if variant == DELTA_PROJECTED:  # in-projection and step in one kernel, the gated norm in the tail
            with self._traced("deltanet in-projection + step (conv, gating, delta rule)", i,
                              costs.delta_projected_step, c, element):
                out = gated_delta_rule_decode_projected(
                    x, w.input_norm, c.rms_norm_eps, w.projection, w.conv, self.state.conv[i], w.A_log,
                    w.dt_bias, self.state.recurrent[i], scratch["delta_projection"], scratch["delta_qk"],
                    scratch["delta_out"], pdl=step.pdl, slots=step.slots)
            _, z, _, _ = self._split_projection(scratch["delta_projection"])
            return self._layer_tail(i, "deltanet gated norm + out-projection", out.view(1, -1), w.out, x, mlp, step,
                                    head_norm=(z, w.norm))
        projection = self._linear("deltanet in-projection", i, x, w.projection, step,
                                  **self._norm(w.input_norm, step.squares), out=scratch["delta_projection"])
        mixed, z, b, a = self._split_projection(projection)
        conv_state, state = self.state.conv[i], self.state.recurrent[i]  # row r's at slot step.slots[r]
        cost = (costs.delta_step, c, size, w.conv.numel(), projection.shape[1], element)
        head_norm = None
        if variant in (DELTA_FUSED, DELTA_FUSED_NORM):
            norm_later = variant == DELTA_FUSED  # the gated norm in the layer tail's prologue
            kind = "deltanet step (conv, gating, delta rule" + (")" if norm_later else ", gated norm)")
            with self._traced(kind, i, *cost):
                out = gated_delta_rule_decode_fused(
                    mixed, z, a, b, w.conv, conv_state, w.A_log, w.dt_bias, w.norm, c.rms_norm_eps, state,
                    out=scratch["delta_normed"], delta_out=scratch["delta_out"], pdl=step.pdl,
                    normalize=not norm_later, slots=step.slots, tuning_batch=self.plan.step_tuning_rows,
                )
            if norm_later:
                out, head_norm = out.view(size, -1), (z, w.norm)
        else:
            with self._traced("deltanet step (unfused: conv, delta rule, gated norm)", i, *cost):
                mixed = causal_conv1d_step(mixed, w.conv, conv_state, out=scratch["conv_out"], slots=step.slots)
                q, k, v = self._heads(mixed)
                out = gated_delta_rule_recurrent(q, k, v, a, b, w.A_log, w.dt_bias, state, out=scratch["delta_out"],
                                                 slots=step.slots)
                out = gated_rms_norm(out, z, w.norm, c.rms_norm_eps, out=scratch["delta_normed"])
        return self._layer_tail(i, "deltanet " + ("gated norm + " if head_norm else "") + "out-projection", out,
                                w.out, x, mlp, step, head_norm=head_norm)

    def _layer_tail(self, i, kind: str, attended, out_weight, x, mlp: MLPWeights, step: ForwardPass, gate=None,
                    head_norm=None):
        """x + out-projection(attended) (+ residual), then + MLP: one kernel where the plan says so (a decode
        step: staged_out_projection_mlp or out_projection_mlp), else the three `linear` projections. head_norm
        (z, weight): attended is the delta rule's output, normed by that kernel's prologue. step.squares: the
        prefill's rows' sums of squares, which each residual add rewrites for the norm folded into the next
        projection."""
        c = self.config
        tail = TAIL_LINEAR if step.buffers is None else self.plan.decode_tail(step.rows)
        if tail != TAIL_LINEAR:
            with self._traced(f"{kind} + residual + MLP", i, costs.layer_tail, c, step.rows, attended.shape[1],
                              gate is not None, x.element_size()):
                if tail == TAIL_STAGED:
                    return staged.staged_out_projection_mlp(
                        attended, out_weight, x, mlp.input_norm, mlp.gate_up, mlp.down, c.rms_norm_eps,
                        self._staged_counters[i], gate=gate, act=step.scratch["mlp_hidden"], pdl=step.pdl,
                        head_norm=head_norm, descriptors=self._staged_descriptors[i])
                return out_projection_mlp(attended, out_weight, x, mlp.input_norm, mlp.gate_up, mlp.down,
                                          c.rms_norm_eps, gate=gate, act=step.scratch["mlp_hidden"], pdl=step.pdl,
                                          head_norm=head_norm)
        if head_norm is not None:
            raise ValueError("head_norm needs out_projection_mlp (a decode step of up to 16 rows)")
        x = self._linear(kind + (" + residual" if gate is None else ""), i, attended, out_weight, step, gate=gate,
                         residual=x, out=x, squares_out=step.squares)
        return self._mlp(i, mlp, x, step)

    def _mlp(self, i, w: MLPWeights, x, step: ForwardPass):
        hidden = self._linear("mlp norm + gate/up + swiglu", i, x, w.gate_up, step,
                              **self._norm(w.input_norm, step.squares), activation="swiglu", out=step.out("mlp_hidden"))
        return self._linear("mlp down-projection + residual", i, hidden, w.down, step, residual=x, out=x,
                            squares_out=step.squares)

    def _layers(self, x, step: ForwardPass):
        decode = step.buffers is not None
        for i, (w, mlp) in enumerate(zip(self.layers, self.mlps)):
            if isinstance(w, AttentionWeights):
                x = self._attention_layer(i, w, mlp, x, step)
            elif decode:
                x = self._deltanet_layer_decode(i, w, mlp, x, step)
            else:
                x = self._deltanet_layer_prefill(i, w, mlp, x, step)
            if self._layer_done is not None:
                self._layer_done(i + 1, len(self.layers))
        return x

    # ---- prefill: one sequence, or several in a packed pass ------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0, all_logits: bool = True):
        """Tokens [T] of the sequence in `slot` after `start` cached ones: float32 logits [T or 1, vocab].
        The last token's logits (all_logits=False) with the packed graphs (plan.packed_prefill with cuda_graph): a
        packed pass, its bucket's CUDA graph replayed (`prefill_packed`), whatever the length. Otherwise the
        one-sequence kernels: with cuda_graph, a prefill from position 0 whose (length, slot, all_logits) repeats is
        replayed from a CUDA graph (graphs.PrefillGraphs)."""
        if not all_logits and self.packed_graphs is not None:
            check_prefill_batch([token_ids], [slot], [start], self.max_batch, self.max_length)
            return self.prefill_packed([token_ids], [slot], [start])
        token_ids = token_ids.to(self.device)
        if self.prefill_graphs is None or start != 0:
            return self.prefill_eager(token_ids, slot, start, all_logits)
        return self.prefill_graphs.run(token_ids, slot, all_logits,
                                       lambda ids: self.prefill_eager(ids, slot, start, all_logits))

    @torch.no_grad()
    def prefill_batch(self, token_ids: list[torch.Tensor], slots: list[int],
                      starts: list[int] | None = None) -> torch.Tensor:
        """Several prompts, each into its slot after its cached tokens (engine/backend.py): float32 logits
        [S, vocab] of each prompt's last token. With plan.packed_prefill, in packed passes (`prefill_packed`; one
        prompt without the packed graphs: `prefill`); else one prefill each."""
        starts = check_prefill_batch(token_ids, slots, starts, self.max_batch, self.max_length)
        if self.plan.packed_prefill and (len(token_ids) > 1 or self.packed_graphs is not None):
            return self.prefill_packed(token_ids, slots, starts)
        return torch.cat([self.prefill(ids, slot, start, all_logits=False)
                          for ids, slot, start in zip(token_ids, slots, starts)])

    def prefill_packed(self, token_ids: list[torch.Tensor], slots: list[int], starts: list[int],
                       graphs: bool = True) -> torch.Tensor:
        """Prompts (arguments checked by the caller: check_prefill_batch) in packed passes (engine/packed.py: as
        many as fit the largest token bucket each), each pass over its token bucket's rows: replayed from the
        bucket's CUDA graph with the packed graphs (captured on the bucket's first pass), else (or with
        graphs=False) launched now. float32 logits [S, vocab] of each prompt's last token. Ids on the host are laid
        out there; ids on the device are copied into their rows on the device."""
        lengths = [ids.shape[0] for ids in token_ids]
        logits = []
        for group in prefill_packing.passes(lengths, self.packed_buckets[-1]):
            logits.append(self._packed_pass([token_ids[i] for i in group], [slots[i] for i in group],
                                            [starts[i] for i in group], graphs))
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _packed_pass(self, token_ids, slots, starts, graphs: bool) -> torch.Tensor:
        rows = sum(prefill_packing.aligned(ids.shape[0]) for ids in token_ids)
        tokens = prefill_packing.token_bucket(rows, self.packed_buckets)
        if graphs and self.packed_graphs is not None:
            return self.packed_graphs.run(token_ids, slots, starts, tokens, self._packed_body, self._packed_head)
        head_rows = prefill_packing.head_rows(len(token_ids))
        host, layout = prefill_packing.pack_inputs(token_ids, starts, slots, tokens, head_rows)
        inputs = prefill_packing.PackedInputs.view(host.to(self.device), tokens, head_rows, layout)
        prefill_packing.copy_device_prompts(inputs, token_ids, layout)
        hidden = torch.empty(head_rows, self.config.hidden_size, device=self.device, dtype=self.dtype)
        self._packed_body(inputs, hidden)
        return self._packed_head(hidden)[:len(token_ids)]

    def _first_run_work(self) -> str:
        """What a first run of the kernels costs, in the progress line's words."""
        if self.plan.device.interpreter:
            return "the kernels run under Triton's interpreter (nothing is compiled or tuned)"
        return "compiling and autotuning (cached on disk)"

    def _prefill_layers(self, token_ids: torch.Tensor, step: ForwardPass) -> torch.Tensor:
        """The embedding (and its rows' sums of squares for the folded norm) and every layer of a prefill."""
        c, tokens = self.config, step.rows
        element = self.embed.element_size()
        if self.progress and not self._prefilled:
            self._layer_done = progress_printer(f"first prefill: {self._first_run_work()}, layers")
        self._prefilled = True
        with self._traced("embedding", None, costs.rows_read, tokens, c.hidden_size, element):
            x = embedding(token_ids, self.embed)
        if self.plan.prefill_folded_norm(tokens):
            step.squares = torch.empty(tokens, -(-c.hidden_size // SQUARES_COLUMNS), device=self.device,
                                       dtype=torch.float32)
            with self._traced("embedding's sums of squares", None, costs.rows_read, tokens, c.hidden_size, element, 1):
                row_squares(x, out=step.squares)
        x = self._layers(x, step)
        self._layer_done = None
        return x

    def prefill_eager(self, token_ids: torch.Tensor, slot: int, start: int, all_logits: bool):
        """The prefill's kernels launched now (no graph)."""
        c, tokens = self.config, token_ids.shape[0]
        step = ForwardPass(rows=tokens, slot=slot, start=start, pdl=self.plan.prefill_pdl(tokens),
                           positions=torch.arange(start, start + tokens, device=self.device, dtype=torch.int32),
                           slots=torch.full((tokens,), slot, device=self.device, dtype=torch.int32))
        x = self._prefill_layers(token_ids, step)
        rows = x if all_logits else x[-1:]
        with self._traced("final norm + lm head", None, costs.lm_head, self.lm_head, rows.shape[0], True):
            return lm_head_logits(rows, self.lm_head, norm_weight=self.final_norm, eps=c.rms_norm_eps,
                                  gemv=rows.shape[0] <= self.plan.gemv_rows)

    def _packed_body(self, inputs: prefill_packing.PackedInputs, hidden: torch.Tensor) -> None:
        """A packed pass's layers over its bucket's rows (padding rows computed and never read), then each
        sequence's last row gathered into hidden [S, H] (the embedding kernel's gather): launches only, reading
        the pass from `inputs` (what a packed graph captures)."""
        tokens = inputs.tokens
        step = ForwardPass(rows=tokens, positions=inputs.positions, slots=inputs.slots,
                           pdl=self.plan.prefill_pdl(tokens), packed=inputs.blocks,
                           sequences=() if inputs.layout is None else tuple(zip(inputs.layout.lengths,
                                                                                inputs.layout.starts)))
        x = self._prefill_layers(inputs.token_ids, step)
        with self._traced("each sequence's last row", None, costs.rows_read, hidden.shape[0], x.shape[1],
                          x.element_size()):
            embedding(inputs.last_rows, x, out=hidden)

    def _packed_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head of a packed pass's last rows hidden [S, H]: float32 logits [S, vocab]. Past
        plan.gemv_rows rows the GEMM reads the head once for all of them (the GEMV reads it once a row: 2.6 ms
        of a 16-prompt pass on the H100, D152)."""
        with self._traced("final norm + lm head", None, costs.lm_head, self.lm_head, hidden.shape[0], True):
            return lm_head_logits(hidden, self.lm_head, norm_weight=self.final_norm, eps=self.config.rms_norm_eps,
                                  gemv=hidden.shape[0] <= self.plan.gemv_rows)

    def warm_up_packed_head(self, rows: int) -> None:
        """The LM head of a packed pass of `rows` head rows (a sequence bucket), run once (and captured with the
        packed graphs) on zero rows: what a pass of that many prompts meets."""
        if self.packed_graphs is not None:
            self.packed_graphs.head(rows, self._packed_head)
        else:
            self._packed_head(torch.zeros(rows, self.config.hidden_size, device=self.device, dtype=self.dtype))

    # ---- decode: one token for each of B sequences, row r's in slot slots[r] --------------------
    def buffers_for(self, batch: int) -> DecodeBuffers:
        """The static buffers of batch's bucket."""
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds max_batch {self.max_batch}")
        size = bucket(batch, self.max_batch)
        if size not in self._buffers:
            self._buffers[size] = DecodeBuffers(self.config, size, self.device, self.dtype)
        return self._buffers[size]

    def decode_step(self, buffers: DecodeBuffers, mode: str, feedback: bool = False) -> None:
        """One decode step on static buffers, its kernels launched now (row r: the sequence in slot
        buffers.slots[r], read by the kernels); allocation-free once every kernel has been warmed up. With
        feedback, its last kernel makes the chosen ids the next step's inputs (positions + 1)."""
        c, plan = self.config, self.plan
        size = buffers.size
        with self._traced("embedding", None, costs.rows_read, size, c.hidden_size, self.embed.element_size()):
            x = embedding(buffers.token_ids, self.embed, out=buffers.hidden)
        step = ForwardPass(rows=size, positions=buffers.positions, slots=buffers.slots, pdl=plan.pdl, buffers=buffers)
        if plan.decode_folded_norm(size):  # the GEMM's folded norms, from the rows' sums of squares
            step.squares = buffers.squares
            with self._traced("embedding's sums of squares", None, costs.rows_read, size, c.hidden_size,
                              self.embed.element_size(), 1):
                row_squares(x, out=step.squares)
        x = self._layers(x, step)
        final = dict(norm_weight=self.final_norm, eps=c.rms_norm_eps, pdl=plan.lm_head_pdl)
        head = plan.decode_lm_head(size, mode)
        penalized = mode in PENALIZED_MODES
        kind = "final norm + lm head" + (" (int8 screen, exact check)" if head == HEAD_SCREENED else "")
        if head == HEAD_SCREENED_TOP_K:
            kind += " (int8 screen, exact check of the top-k candidates" + (" + penalties)" if penalized else ")")
        with self._traced(kind + (" + argmax" if mode in ("greedy", "temperature") else ""), None, costs.lm_head,
                          self.lm_head, size, head == HEAD_LOGITS, head == HEAD_SCREENED,
                          head == HEAD_SCREENED_TOP_K, penalized):
            if head == HEAD_SCREENED:
                lm_head_argmax_screened(x, self.lm_head, self.lm_head_screen, out=buffers.next_tokens,
                                        **dict(final, pdl=plan.screened_lm_head_pdl))
            elif head == HEAD_SCREENED_TOP_K:  # the penalties too, on the candidates: no penalties kernel below
                penalties = dict(counts=self.history.counts, prompt_mask=self.history.prompt_mask,
                                 repetition=buffers.repetition_penalty, frequency=buffers.frequency_penalty,
                                 presence=buffers.presence_penalty, slots=buffers.slots) if penalized else {}
                lm_head_screened_top_k(x, self.lm_head, self.lm_head_screen, buffers.logits, buffers.temperature,
                                       buffers.top_k, top_k_bound=sample_options(mode)["top_k_bound"], **penalties,
                                       **dict(final, pdl=plan.screened_lm_head_pdl))
            elif head == HEAD_ARGMAX:
                lm_head_argmax(x, self.lm_head, out=buffers.next_tokens, tiled=plan.argmax_tiled(size), **final)
            elif head == HEAD_GUMBEL:  # Gumbel-max inside the LM head: no logits written
                lm_head_argmax(x, self.lm_head, out=buffers.next_tokens, temperature=buffers.temperature,
                               seed=buffers.seed, step=buffers.step, tiled=plan.argmax_tiled(size), **final)
            else:
                lm_head_logits(x, self.lm_head, out=buffers.logits, gemv=size <= plan.gemv_rows, **final)
        if penalized and head != HEAD_SCREENED_TOP_K:
            with self._traced("penalties (repetition, frequency, presence)", None, costs.penalties, c, size):
                apply_penalties(buffers.logits, self.history.counts, self.history.prompt_mask,
                                buffers.repetition_penalty, buffers.frequency_penalty, buffers.presence_penalty,
                                slots=buffers.slots)
        if mode in LOGITS_MODES:
            filters = ("top-k / top-p" if mode in SEARCH_MODES else
                       "top-k candidates" if mode in TOP_K_MODES else "min-p / temperature")
            with self._traced(f"sampling ({filters})", None, costs.sampling, c, size):
                sample(buffers.logits, buffers.temperature, buffers.top_k, buffers.top_p, buffers.seed,
                       buffers.step, out=buffers.next_tokens, min_p=buffers.min_p, **sample_options(mode))
        elif head == HEAD_LOGITS and mode != "logits":  # greedy or temperature rows past the argmax heads' buckets
            temperature = buffers.temperature if mode == "temperature" else buffers.greedy_temperature
            with self._traced("sampling (argmax / temperature)", None, costs.sampling, c, size):
                sample(buffers.logits, temperature, buffers.top_k, buffers.top_p, buffers.seed, buffers.step,
                       out=buffers.next_tokens, filtering=False)
        if penalized:
            with self._traced("penalties: count the chosen ids", None, costs.token_count, size):
                count_tokens(buffers.next_tokens, self.history.counts, slots=buffers.slots)
        if feedback:
            with self._traced("feedback: chosen ids -> next inputs", None, costs.feedback, size):
                feed_back(buffers.next_tokens, buffers.token_ids, buffers.positions, buffers.lengths, buffers.step,
                          self.max_length - 1, pdl=plan.pdl, host_ids=buffers.host_ids)

    def _tune_decode_attention(self, buffers: DecodeBuffers) -> None:
        """Let the split-KV attention's autotuner make its one pick (cached on disk, then used at every context)
        on a call over the longest context this model serves, where its config matters, rather than on the
        first step's few keys, where the configs differ by noise: the pick no longer depends on the context of
        the process's first step. Measured (benchmarks/engine_options.py, four processes each tuning afresh,
        docs/decisions.md, D43): this pick (16-key tiles, 2 warps, 4 stages, both times) 687.2
        and 687.3 us a step at context 32768, the first step's picks 690.2 and 693.0; at 128, 566.3-566.6
        against 566.9-571.6. The call reads the cache's whole length (its values do not matter) into the step's
        own output buffer, which the step then overwrites; under the interpreter (one config, nothing to tune)
        it only costs its time, and the CPU tests check it that way."""
        if self._decode_attention_tuned or not self.plan.tune_decode_attention_at_full_length:
            return
        self._decode_attention_tuned = True
        attention = next((i for i, w in enumerate(self.layers) if isinstance(w, AttentionWeights)), None)
        if attention is None:
            return
        lengths = torch.full((buffers.size,), self.max_length, device=self.device, dtype=torch.int32)
        attention_decode(buffers.scratch["attention_q"], self.state.key[attention], self.state.value[attention],
                         lengths, out=buffers.attention_out, num_splits=self.decode_splits, pdl=self.plan.pdl)

    def run_step(self, buffers: DecodeBuffers, mode: str, feedback: bool = False) -> None:
        """One decode step as generation runs it: replayed from its CUDA graph with cuda_graph (captured on its
        first call), else launched now."""
        self._tune_decode_attention(buffers)
        if self.decode_graphs is None:
            self.decode_step(buffers, mode, feedback)
            return

        def warm_up(step):
            if self.progress:
                self._layer_done = progress_printer(
                    f"decode warm-up (batch {buffers.size}, {mode}): {self._first_run_work()}, layers")
            try:
                step()
            finally:
                self._layer_done = None

        self.decode_graphs.run((buffers.size, mode, feedback), buffers,
                               lambda: self.decode_step(buffers, mode, feedback), warm_up)

    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor | None = None) -> torch.Tensor:
        """One step of B sequences, row r token_ids[r] at positions[r] of the sequence in slot slots[r] (distinct
        slots below max_batch, any order; None: slot r): float32 logits [B, vocab]."""
        check_decode_slots(slots, token_ids.shape[0], self.max_batch)
        buffers = self.buffers_for(token_ids.shape[0])
        buffers.load(token_ids, positions, slots)
        self.run_step(buffers, "logits")
        return buffers.logits[: token_ids.shape[0]].clone()

    @torch.no_grad()
    def decode_tokens(self, token_ids, positions, sampling: DeviceSampling, step,
                      feedback: bool = False, slots: torch.Tensor | None = None) -> torch.Tensor:
        """One step of B sequences, row r's in slot slots[r] (as `decode`; None: slot r), choosing the next ids
        on the device: int64 [B], a view of a static buffer. sampling holds the rows' parameters (device
        tensors) and the mode the host chose from them; step [B] is each row's draw counter (its number of
        generated tokens). A penalized row reads and advances its slot's history (`choose_first_rows` starts it).

        feedback=True ends the step with the feedback kernel: the chosen ids, positions + 1 and step + 1
        become the next step's inputs on the device, and the next call may pass token_ids, positions and
        step (and slots) as None to continue from them without any host input, each row on the same slot
        (how generation runs ahead of the host: engine/decode_pipeline.py)."""
        batch = sampling.temperature.shape[0]
        buffers = self.buffers_for(batch)
        if token_ids is None:
            if positions is not None or step is not None or slots is not None:
                raise ValueError("continuing from the fed-back inputs: pass token_ids, positions, step and slots all "
                                 "as None")
            if buffers.fed_back != batch:
                raise ValueError("nothing to continue from: the previous step of this batch did not run with feedback")
        else:
            if token_ids.shape[0] != batch:
                raise ValueError(f"token_ids has {token_ids.shape[0]} rows, the sampling parameters {batch}")
            check_decode_slots(slots, batch, self.max_batch)
            buffers.load(token_ids, positions, slots)
            if step is not None:
                buffers.step[:batch].copy_(step)
        if sampling.mode != "greedy":
            buffers.temperature[:batch].copy_(sampling.temperature)
            buffers.top_k[:batch].copy_(sampling.top_k)
            buffers.top_p[:batch].copy_(sampling.top_p)
            buffers.seed[:batch].copy_(sampling.seed)
        if sampling.mode in LOGITS_MODES:
            buffers.min_p[:batch].copy_(sampling.min_p)
        if sampling.mode in PENALIZED_MODES:
            self.history.tensors()  # (made on a prompt by choose_first_rows; here only if none was)
            buffers.repetition_penalty[:batch].copy_(sampling.repetition_penalty)
            buffers.frequency_penalty[:batch].copy_(sampling.frequency_penalty)
            buffers.presence_penalty[:batch].copy_(sampling.presence_penalty)
        self.run_step(buffers, sampling.mode, feedback)
        buffers.fed_back = batch if feedback else 0
        return buffers.next_tokens[:batch]

    def chosen_on_host(self, batch: int) -> torch.Tensor:
        """int64 [2, bucket(batch, max_batch)]: where the steps with feedback of this batch leave their ids, row r's
        id of a step in row (its step counter before the step) % 2 (pinned host memory on a GPU); read it after the
        step is done (an event recorded after decode_tokens)."""
        return self.buffers_for(batch).host_ids

    @torch.no_grad()
    def choose_first_rows(self, logits: torch.Tensor, sampling: DeviceSampling,
                          prompt_ids: list[torch.Tensor] | None = None,
                          slots: list[int] | None = None) -> torch.Tensor:
        """The first generated ids of every row of the batch at once from its prompts' last logits [B, V] (row r
        with the batch's row r's sampling parameters), each drawn as decode draws it (the same noise stream, at
        step 0). A penalized mode needs each row's prompt_ids [T]: they start the history of the row's slot
        (slots[r], default r; its prompt's tokens marked, nothing counted), which the decode steps then advance in
        whatever row the slot decodes."""
        if sampling.mode not in PENALIZED_MODES:
            return choose_first(logits, sampling)
        if prompt_ids is None or len(prompt_ids) != logits.shape[0]:
            raise ValueError(f"prompt_ids: mode {sampling.mode!r} (penalties) needs each row's prompt")
        slots = list(range(logits.shape[0])) if slots is None else list(slots)
        if len(slots) != logits.shape[0]:
            raise ValueError(f"slots: {len(slots)} for {logits.shape[0]} rows")
        for slot, ids in zip(slots, prompt_ids):
            self.history.start(slot, ids)
        counts, prompt_mask = self.history.tensors()
        rows_slots = torch.tensor(slots, device=logits.device, dtype=torch.int32)  # (the decode's kernels)
        return choose_first(logits, sampling, None, counts, prompt_mask, rows_slots)

    # ---- the warm-up (engine/warmup.py) ------------------------------------------------------------
    @torch.no_grad()
    def warm_up_step(self, buffers: DecodeBuffers, mode: str, feedback: bool = False) -> None:
        """One decode step on `buffers` launched now, as run_step's first step of a graph runs it (the decode
        attention's one pick over the whole cache before it), nothing captured."""
        self._tune_decode_attention(buffers)
        self.decode_step(buffers, mode, feedback)
