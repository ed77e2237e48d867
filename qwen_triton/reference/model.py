"""The Qwen3.5 text model in readable PyTorch, with static shapes.

It is the oracle of every kernel test and the eager and torch.compile baselines of the benchmark.
Everything a generation needs is preallocated for `max_batch` sequences of up to `max_length` tokens:
the KV cache of the full-attention layers, and the conv state and float32 recurrent state of the Gated
DeltaNet layers. Prefill runs one sequence (its slot) with the chunked gated delta rule; decode runs one
token of each of B sequences (row r: the sequence in slot slots[r], any distinct slots) with the one-step
recurrent form, and has no data-dependent Python control flow, so `torch.compile(model.decode, fullgraph=True)`
compiles it.
"""

from __future__ import annotations

import torch

from ..config import FULL_ATTENTION, ModelConfig
from ..engine.backend import check_decode_slots, check_prefill_batch
from ..state import ModelState
from . import functional as fn


class ReferenceModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_batch: int = 1,
        max_length: int = 4096,
        device="cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.config = config
        self.w = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_batch = max_batch
        self.max_length = max_length
        self.cache = ModelState(config, max_batch, max_length, self.device, dtype)
        self.lm_head = weights["embed_tokens.weight"] if config.tie_word_embeddings else weights["lm_head.weight"]
        # fp32 rotary tables for every position, sliced by position at run time
        self.cos, self.sin = fn.rotary_cos_sin(
            torch.arange(max_length, device=self.device), config.rotary_dim, config.rope_theta
        )

    # ---- the layers -------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w[name].t()

    def _mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        gate = self._linear(x, p + "mlp.gate_proj.weight")
        up = self._linear(x, p + "mlp.up_proj.weight")
        return self._linear(fn.silu_and_multiply(gate, up), p + "mlp.down_proj.weight")

    def _attention_projections(self, x: torch.Tensor, p: str, positions: torch.Tensor):
        """q (normed, rotated) [T, Hq, D], gate [T, Hq*D] or None, k (normed, rotated), v [T, Hkv, D]."""
        c = self.config
        tokens = x.shape[0]
        q = self._linear(x, p + "q_proj.weight")
        gate = None
        if c.attn_output_gate:
            q, gate = q.view(tokens, c.num_attention_heads, 2 * c.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(tokens, -1)
        q = q.reshape(tokens, c.num_attention_heads, c.head_dim)
        k = self._linear(x, p + "k_proj.weight").view(tokens, c.num_key_value_heads, c.head_dim)
        v = self._linear(x, p + "v_proj.weight").view(tokens, c.num_key_value_heads, c.head_dim)
        q = fn.rms_norm(q, self.w[p + "q_norm.weight"], c.rms_norm_eps)
        k = fn.rms_norm(k, self.w[p + "k_norm.weight"], c.rms_norm_eps)
        cos, sin = self.cos[positions], self.sin[positions]
        return fn.apply_rotary(q, cos, sin), gate, fn.apply_rotary(k, cos, sin), v

    def _attention_output(self, out: torch.Tensor, gate: torch.Tensor | None, p: str) -> torch.Tensor:
        out = out.reshape(out.shape[0], -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self._linear(out, p + "o_proj.weight")

    def _delta_net_inputs(self, x: torch.Tensor, p: str):
        mixed = self._linear(x, p + "in_proj_qkv.weight")
        z = self._linear(x, p + "in_proj_z.weight")
        b = self._linear(x, p + "in_proj_b.weight")
        a = self._linear(x, p + "in_proj_a.weight")
        return mixed, z, b, a

    def _split_heads(self, mixed: torch.Tensor):
        c = self.config
        q, k, v = mixed.split([c.linear_key_dim, c.linear_key_dim, c.linear_value_dim], dim=-1)
        rows = mixed.shape[0]
        return (
            q.reshape(rows, c.linear_num_key_heads, c.linear_key_head_dim),
            k.reshape(rows, c.linear_num_key_heads, c.linear_key_head_dim),
            v.reshape(rows, c.linear_num_value_heads, c.linear_value_head_dim),
        )

    def _delta_net_output(self, out: torch.Tensor, z: torch.Tensor, p: str) -> torch.Tensor:
        c = self.config
        rows = out.shape[0]
        z = z.reshape(rows, c.linear_num_value_heads, c.linear_value_head_dim)
        out = fn.gated_rms_norm(out, z, self.w[p + "norm.weight"], c.rms_norm_eps)
        return self._linear(out.reshape(rows, -1), p + "out_proj.weight")

    # ---- prefill: one sequence --------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0, all_logits: bool = True) -> torch.Tensor:
        """Run tokens [T] of the sequence in `slot`, whose first `start` tokens are already cached.

        Returns float32 logits [T, vocab] of every position, or [1, vocab] of the last when not all_logits.
        """
        c = self.config
        tokens = token_ids.shape[0]
        positions = torch.arange(start, start + tokens, device=self.device)
        x = self.w["embed_tokens.weight"][token_ids]
        for i, layer_type in enumerate(c.layer_types):
            p = f"layers.{i}."
            h = fn.rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            if layer_type == FULL_ATTENTION:
                a = p + "self_attn."
                q, gate, k, v = self._attention_projections(h, a, positions)
                self.cache.key[i][slot, :, start:start + tokens] = k.transpose(0, 1)
                self.cache.value[i][slot, :, start:start + tokens] = v.transpose(0, 1)
                out = fn.attention(
                    q, self.cache.key[i][slot], self.cache.value[i][slot], positions, start + tokens
                )
                h = self._attention_output(out, gate, a)
            else:
                a = p + "linear_attn."
                mixed, z, b, a_input = self._delta_net_inputs(h, a)
                conv_weight = self.w[a + "conv1d.weight"][:, 0, :]
                mixed, self.cache.conv[i][slot] = fn.causal_conv1d(mixed, conv_weight, self.cache.conv[i][slot])
                q, k, v = self._split_heads(mixed)
                g, beta = fn.gating(a_input, b, self.w[a + "A_log"], self.w[a + "dt_bias"])
                out, self.cache.recurrent[i][slot] = fn.gated_delta_rule_chunked(
                    q, k, v, g, beta, self.cache.recurrent[i][slot]
                )
                h = self._delta_net_output(out, z, a)
            x = x + h
            h = fn.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + self._mlp(h, p)
        x = fn.rms_norm(x if all_logits else x[-1:], self.w["norm.weight"], c.rms_norm_eps)
        return (x @ self.lm_head.t()).float()

    @torch.no_grad()
    def prefill_batch(self, token_ids: list[torch.Tensor], slots: list[int],
                      starts: list[int] | None = None) -> torch.Tensor:
        """Several prompts, each into its slot after its cached tokens (engine/backend.py): one prefill each,
        float32 logits [S, vocab] of each prompt's last token."""
        starts = check_prefill_batch(token_ids, slots, starts, self.max_batch, self.max_length)
        return torch.cat([self.prefill(ids.to(self.device), slot, start, all_logits=False)
                          for ids, slot, start in zip(token_ids, slots, starts)])

    # ---- decode: one token for each of B sequences -----------------------------------------------
    @torch.no_grad()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor | None = None) -> torch.Tensor:
        """One step of B sequences: row r is token_ids[r] at positions[r] of the sequence in slot slots[r].

        slots: distinct integer slots [B] below max_batch, in any order; None means 0..B-1.
        Returns float32 logits [B, vocab].
        """
        c = self.config
        batch = token_ids.shape[0]
        # the per-slot states are read and written through `rows`: a view when the rows are slots 0..B-1 (no
        # data-dependent indexing, so torch.compile(fullgraph=True) compiles the step), else the slots' indices
        if slots is None:
            rows, slots = slice(0, batch), torch.arange(batch, device=self.device)
        else:
            check_decode_slots(slots, batch, self.max_batch)
            rows = slots = slots.to(device=self.device, dtype=torch.long)
        x = self.w["embed_tokens.weight"][token_ids]
        for i, layer_type in enumerate(c.layer_types):
            p = f"layers.{i}."
            h = fn.rms_norm(x, self.w[p + "input_layernorm.weight"], c.rms_norm_eps)
            if layer_type == FULL_ATTENTION:
                a = p + "self_attn."
                q, gate, k, v = self._attention_projections(h, a, positions)
                key_cache, value_cache = self.cache.key[i], self.cache.value[i]
                key_cache[slots, :, positions] = k
                value_cache[slots, :, positions] = v
                keys, values = key_cache[rows], value_cache[rows]
                out = torch.stack(
                    [fn.attention(q[b:b + 1], keys[b], values[b], positions[b:b + 1])[0] for b in range(batch)]
                )
                h = self._attention_output(out, gate, a)
            else:
                a = p + "linear_attn."
                mixed, z, b_input, a_input = self._delta_net_inputs(h, a)
                conv_weight = self.w[a + "conv1d.weight"][:, 0, :]
                conv_state = self.cache.conv[i]
                mixed, new_conv = fn.causal_conv1d_step(mixed, conv_weight, conv_state[rows])
                conv_state[rows] = new_conv
                q, k, v = self._split_heads(mixed)
                g, beta = fn.gating(a_input, b_input, self.w[a + "A_log"], self.w[a + "dt_bias"])
                state = self.cache.recurrent[i]
                out, new_state = fn.gated_delta_rule_recurrent(q, k, v, g, beta, state[rows])
                state[rows] = new_state
                h = self._delta_net_output(out, z, a)
            x = x + h
            h = fn.rms_norm(x, self.w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
            x = x + self._mlp(h, p)
        x = fn.rms_norm(x, self.w["norm.weight"], c.rms_norm_eps)
        return (x @ self.lm_head.t()).float()

    def reset(self, slot: int | None = None) -> None:
        for s in range(self.max_batch) if slot is None else [slot]:
            self.cache.reset(s)
