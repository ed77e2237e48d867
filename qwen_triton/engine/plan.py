"""Which kernel runs each operator, in each phase and size bucket: the `Plan`, resolved once at load.

`resolve_plan(config, device, options, dtype)` takes the model's shapes, the device's properties and the user's
`Options`, and answers every question the forward pass asks ("which layer tail for a decode of 3 rows?", "PDL
for a prefill of 1,500 tokens?") from fields fixed at load. An option the device cannot take at all is refused
there with a ValueError naming it (pdl=True off Hopper); a variant that cannot serve a shape or a device (the
staged tail on a CPU or past the 0.8B's sizes, the projected DeltaNet step for head dims it does not tile, the
screened LM head past 8,192 columns) is left out, and the plan says what runs instead and, for a shape, why.
`qwen-triton ops` prints `describe()`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, ModelConfig
from ..operators.common import interpreting, sm_count
from ..operators.gated_delta_rule.chunk import chunk_size_for
from ..operators.gated_delta_rule.projected_decode import ROWS as PROJECTED_ROWS
from ..operators.linear import staged_out_projection_mlp as staged
from ..operators.linear.gemm import MAX_SPLIT_ROWS
from ..operators.linear.gemv import MAX_ROWS
from ..operators.linear.resident_gemm import MAX_ROWS as RESIDENT_ROWS
from ..operators.lm_head.screened import MAX_COLUMNS as SCREEN_MAX_COLUMNS
from ..tuning import Tuning, active, for_device_name
from .buffers import bucket
from .device_sampling import TOP_K_MODES

PREFILL_GRAPHS = 8  # CUDA graphs of prefills kept (the most recently captured)
INVARIANT_STEP_TUNING_ROWS = 16  # batch_invariant: every bucket's fused DeltaNet step takes the 16-row bucket's pick


@dataclass(frozen=True)
class DeviceProperties:
    """What the plan needs of a device: its kind, compute capability, SM count, and whether kernels run under
    Triton's interpreter."""

    name: str
    type: str  # "cuda" | "cpu"
    capability: tuple[int, int] | None
    sm_count: int
    interpreter: bool

    @property
    def hopper_or_later(self) -> bool:
        return self.type == "cuda" and self.capability is not None and self.capability[0] >= 9

    @property
    def pdl_available(self) -> bool:
        """Programmatic dependent launch: compute capability 9.0 or newer, not under the interpreter."""
        return self.hopper_or_later and not self.interpreter

    @classmethod
    def of(cls, device) -> "DeviceProperties":
        """The properties of a present device."""
        device = torch.device(device)
        if device.type != "cuda":
            return cls(str(device), device.type, None, sm_count(device), interpreting())
        return cls(torch.cuda.get_device_name(device), "cuda", tuple(torch.cuda.get_device_capability(device)),
                   sm_count(device), interpreting())


# devices a plan can be resolved for without them (qwen-triton ops --gpu)
DEVICES = {
    "h200": DeviceProperties("NVIDIA H200", "cuda", (9, 0), 132, False),
    "cpu": DeviceProperties("cpu (Triton interpreter)", "cpu", None, 8, True),
}


@dataclass(frozen=True)
class Options:
    """The user's choices (TritonModel's and LLM's keywords); None: the device's default."""

    split_k: bool = True  # split-K GEMV / GEMM configs where the tuning allows them
    cuda_graph: bool = True  # decode steps and prefills replayed from CUDA graphs (GPU only)
    # prompts prefilled in packed passes (engine/packed.py), with cuda_graph a graph per token bucket for any prompt's
    # last logits; False: one prefill a prompt, graphs of repeated lengths only (the comparison)
    packed_prefill: bool = True
    fused_delta_decode: bool = True  # a decode step's conv, gating, delta rule (and gated norm) in one kernel
    out_projection_mlp: bool = True  # a decode step's out-projection + residual and MLP as one kernel (<= 16 rows)
    output_norm_in_projection: bool = True  # with it, the DeltaNet output norm in that kernel's prologue
    projected_delta_decode: bool = True  # one sequence: a DeltaNet layer's in-projection and step in one kernel
    staged_out_projection_mlp: bool = True  # one sequence, Hopper, bf16: the layer tail with its weights staged
    screened_lm_head: bool = True  # greedy and top-k sampling, up to 16 rows: the LM heads through the int8 screen
    # several rows (a decode step of 2+ sequences, a prefill of 2-16 tokens): the GEMM, each weight read once for
    # all rows, with the norms folded (False: the GEMV up to 16 rows, each weight read once a row)
    batched_projections: bool = True
    # every decode step, one row's too, runs the kernels of several rows, so that a sequence's ids never depend on
    # how many sequences share its steps (one row then forgoes the GEMV and the fused one-row kernels)
    batch_invariant: bool = False
    # a decode step's rows past the GEMV's, up to the table's resident_most_rows, through the resident-weights GEMM
    # (linear/resident_gemm.py: each program's weight slice loaded before its PDL wait); False: the tiled GEMM.
    # Not with batch_invariant, whose buckets all take the tiled GEMM (one kernel: the same bits at any batch), nor
    # past the table's GEMV hidden limit (its slices were measured at the 0.8B's widths; the 4B's one-row step took
    # 4,642 us through it against 3,442 tiled, H100)
    resident_gemm: bool = True
    # greedy rows past the screened head's buckets, and temperature-only rows past the GEMV's: the argmax (or
    # Gumbel-max) inside a tiled LM head (lm_head/argmax.py, tiled=True: the head read once for all rows, no logits);
    # False: the float32 logits, then the sampler's pass over them
    tiled_argmax_head: bool = True
    # a decode step's tiled GEMMs take their bucket's own pick where the tuning table has one (gemm_decode_by_rows);
    # not with batch_invariant, whose buckets share one pick per K
    bucket_gemm_picks: bool = True
    pdl: bool | None = None  # programmatic dependent launch (None: where the device has it)
    fold_norms: bool | None = None  # the pre-projection norms' (1 + w) folded into the weights (None: yes)
    # the decode attention's one autotuning pick made over the whole cache (TritonModel._tune_decode_attention)
    tune_decode_attention_at_full_length: bool = True
    # the tuning table's engine choices, for comparisons (benchmarks/prefill_options.py, engine_options.py);
    # None: the table's (tuning/h200.py)
    prefill_pdl_tokens: int | None = None  # prefills of up to this many tokens launch with PDL
    lm_head_pdl: bool | None = None  # the decode LM head (not screened) with PDL
    screened_lm_head_pdl: bool | None = None
    resident_most_rows: int | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))


# decode: a layer's out-projection + MLP; a DeltaNet layer's step; the LM head
TAIL_STAGED, TAIL_FUSED, TAIL_LINEAR = "staged", "out_projection_mlp", "linear"
DELTA_PROJECTED, DELTA_FUSED, DELTA_FUSED_NORM, DELTA_UNFUSED = "projected", "fused", "fused+norm", "unfused"
HEAD_SCREENED, HEAD_ARGMAX, HEAD_GUMBEL, HEAD_LOGITS = "screened", "argmax", "gumbel", "logits"
HEAD_SCREENED_TOP_K = "screened-top-k"  # logits exact at the top-k candidates, the penalties applied to them


@dataclass(frozen=True)
class Plan:
    """The resolved choices of one model on one device. Decode questions take the batch bucket (rows), prefill
    questions the prompt length (tokens)."""

    device: DeviceProperties
    tuning: Tuning
    options: Options
    split_k: bool
    cuda_graph: bool
    pdl: bool
    fold_norms: bool
    gemv_rows: int  # projections of up to this many rows run the GEMV (a weight read once a row), more the GEMM
    resident_rows: int  # a decode step's rows past gemv_rows and up to this many: the resident-weights GEMM (0: none)
    fused_tail_rows: int  # decode buckets of up to this many rows run the layer tail as out_projection_mlp (0: none)
    staged_tail: bool  # a one-row decode's layer tail is staged_out_projection_mlp
    delta_step: str  # DELTA_FUSED or DELTA_UNFUSED (several rows, or where the projected step is off)
    # the rows the fused DeltaNet step's autotuning keys every bucket on (None: each bucket its own config). With
    # batch_invariant one config serves every bucket: the configs reduce in different orders
    step_tuning_rows: int | None
    output_norm_in_projection: bool
    projected_delta: bool  # a one-row decode's DeltaNet layer is the projected step
    screened_rows: int  # greedy and top-k decode buckets of up to this many rows use the screened heads (0: none)
    tiled_argmax_head: bool  # greedy / temperature buckets past those heads take the tiled argmax head
    bucket_gemm_picks: bool  # a decode step's tiled GEMMs take their bucket's own pick (gemm(bucket_picks=True))
    lm_head_pdl: bool
    screened_lm_head_pdl: bool
    prefill_pdl_tokens: int  # prefills of up to this many tokens launch with PDL (0: none)
    folded_norm_from: int  # prefills of this many tokens or more apply the folded norms in the GEMM's epilogue
    tune_decode_attention_at_full_length: bool
    packed_prefill: bool = True  # prefill_batch (and, with cuda_graph, every prompt's prefill) in packed passes
    prefill_graphs: int = PREFILL_GRAPHS

    # ---- decode ----------------------------------------------------------------------------------
    def decode_tail(self, rows: int) -> str:
        """A decode step's out-projection + residual and MLP at this bucket."""
        if rows > self.fused_tail_rows:
            return TAIL_LINEAR
        return TAIL_STAGED if self.staged_tail and rows == 1 else TAIL_FUSED

    def decode_delta(self, rows: int) -> str:
        """A decode step's DeltaNet layer at this bucket: the projected step (in-projection included), the fused
        step with the gated norm left to the tail (DELTA_FUSED) or in it (DELTA_FUSED_NORM), or three kernels."""
        if self.projected_delta and rows == 1:
            return DELTA_PROJECTED
        if self.delta_step == DELTA_UNFUSED:
            return DELTA_UNFUSED
        norm_later = self.output_norm_in_projection and self.decode_tail(rows) != TAIL_LINEAR
        return DELTA_FUSED if norm_later else DELTA_FUSED_NORM

    def decode_lm_head(self, rows: int, mode: str) -> str:
        """A decode step's LM head for a sampling mode ("greedy", "temperature", "logits", or a mode whose LM head
        writes logits for the sampling kernels: "min-p", "top-k", "sample", "penalized", "penalized-top-k",
        "penalized-sample"; engine/device_sampling.py). The top-k modes' screened head applies the penalties too.
        Past gemv_rows the argmax heads take their tiled form (the head read once for all rows: `argmax_tiled`), or
        without tiled_argmax_head give way to the logits and the sampler's draw (greedy rows at temperature 0)."""
        if mode == "greedy" and rows <= self.screened_rows:
            return HEAD_SCREENED
        if mode in TOP_K_MODES and rows <= self.screened_rows:
            return HEAD_SCREENED_TOP_K
        if mode in ("greedy", "temperature") and (rows <= self.gemv_rows or self.tiled_argmax_head):
            return HEAD_ARGMAX if mode == "greedy" else HEAD_GUMBEL
        return HEAD_LOGITS

    def argmax_tiled(self, rows: int) -> bool:
        """Whether a decode bucket's argmax and Gumbel heads run tiled (lm_head_argmax(tiled=True))."""
        return rows > self.gemv_rows

    def decode_folded_norm(self, rows: int) -> bool:
        """Whether a decode step of this bucket applies the folded norms in the GEMM's epilogue from the rows'
        sums of squares (its projections run the GEMM), else in the GEMV's prologue."""
        return self.fold_norms and rows > self.gemv_rows

    # ---- prefill ---------------------------------------------------------------------------------
    def prefill_pdl(self, tokens: int) -> bool:
        """Whether a prefill's projections, convs and attention launch with PDL (never the chunked delta rule's
        kernels nor the LM head)."""
        return tokens <= self.prefill_pdl_tokens

    def prefill_folded_norm(self, tokens: int) -> bool:
        """Whether a prefill applies the folded norms in the GEMM's epilogue from the rows' sums of squares (else
        in the projection's prologue: the GEMV, or the GEMM's row pass without folding)."""
        return tokens >= self.folded_norm_from

    # ---- printing --------------------------------------------------------------------------------
    def describe(self, config: ModelConfig, decode_rows=(1, 2, 4, 8, 16, 32),
                 prefill_tokens=(16, 128, 256, 512, 1024, 1500, 2048, 4096, 8192)) -> str:
        """Every operator, which kernel at which bucket, as Markdown tables."""
        return "\n".join(describe_plan(self, config, decode_rows, prefill_tokens))


def staged_tail_fits(config: ModelConfig, device: DeviceProperties) -> bool:
    """Whether staged_out_projection_mlp takes this model's sizes on this device's SMs: one attended width for
    every layer (attention heads x head dim, the DeltaNet value width), a launch plan for the sizes, and a DeltaNet
    value head its head norm takes (a power of two of at least 32)."""
    widths = {config.num_attention_heads * config.head_dim if kind == FULL_ATTENTION else config.linear_value_dim
              for kind in config.layer_types}
    head_dim = config.linear_value_head_dim
    return (len(widths) == 1
            and staged.plan(config.hidden_size, widths.pop(), config.intermediate_size, device.sm_count) is not None
            and head_dim >= 32 and head_dim & (head_dim - 1) == 0)


def screened_head_fits(config: ModelConfig) -> bool:
    """Whether lm_head_argmax_screened takes this model's hidden size (its row statistics and exact check hold a
    whole row of x in one program: at most 8,192 columns, the 27B's 5,120 among them)."""
    return config.hidden_size <= SCREEN_MAX_COLUMNS


def gemv_past_its_limit(config: ModelConfig, tuning) -> bool:
    """Whether this hidden size is past the tuning table's GEMV limit: one sequence's projections then run the
    decode GEMM, without the GEMV's fused paths (the layer tail, the projected DeltaNet step)."""
    return tuning.gemv_hidden_limit is not None and config.hidden_size > tuning.gemv_hidden_limit


def _given(value, default):
    return default if value is None else value


def resolve_plan(config: ModelConfig, device: DeviceProperties, options: Options = Options(),
                 dtype: torch.dtype = torch.bfloat16, tuning: Tuning | None = None) -> Plan:
    """The plan of `config` on `device` with `options`. tuning: the GPU's table (default: the table of this
    process's GPU for the present device, else that of `device`'s name). Raises ValueError for an option the
    device cannot take."""
    if tuning is None:
        tuning = active() if device.interpreter or device.type != "cuda" else for_device_name(device.name)
    pdl = device.pdl_available if options.pdl is None else bool(options.pdl)
    if pdl and not device.pdl_available:
        raise ValueError(f"pdl=True needs an NVIDIA GPU of compute capability 9.0 or newer, not {device.name}")
    if options.batch_invariant and not options.batched_projections:
        raise ValueError("batch_invariant=True needs batched_projections=True (the GEMM for every bucket)")
    if options.batch_invariant:
        gemv_rows = 0
    elif not options.batched_projections:
        gemv_rows = MAX_ROWS
    else:  # the table's rows through the GEMV, up to its hidden size (past it the decode GEMM reads faster)
        gemv_rows = 0 if gemv_past_its_limit(config, tuning) else min(tuning.gemv_most_rows, MAX_ROWS)
    # out_projection_mlp reads its weights once a row, as the GEMV does
    fused_tail_rows = gemv_rows if options.out_projection_mlp else 0
    staged_tail = (options.staged_out_projection_mlp and fused_tail_rows > 0 and device.type == "cuda"
                   and not device.interpreter and device.hopper_or_later and dtype == torch.bfloat16
                   and staged_tail_fits(config, device))
    projected = (gemv_rows >= 1 and options.projected_delta_decode and options.fused_delta_decode
                 and options.output_norm_in_projection
                 and fused_tail_rows >= 1 and config.linear_key_head_dim % PROJECTED_ROWS == 0
                 and config.linear_value_head_dim % PROJECTED_ROWS == 0)
    fold_norms = True if options.fold_norms is None else bool(options.fold_norms)
    return Plan(
        device=device,
        tuning=tuning,
        options=options,
        split_k=options.split_k,
        cuda_graph=options.cuda_graph and device.type == "cuda",
        pdl=pdl,
        fold_norms=fold_norms,
        gemv_rows=gemv_rows,
        resident_rows=(min(_given(options.resident_most_rows, tuning.resident_most_rows), RESIDENT_ROWS)
                       if options.resident_gemm and not options.batch_invariant
                       and not gemv_past_its_limit(config, tuning) else 0),
        fused_tail_rows=fused_tail_rows,
        staged_tail=staged_tail,
        delta_step=DELTA_FUSED if options.fused_delta_decode else DELTA_UNFUSED,
        step_tuning_rows=INVARIANT_STEP_TUNING_ROWS if options.batch_invariant else None,
        output_norm_in_projection=options.output_norm_in_projection,
        projected_delta=projected,
        screened_rows=tuning.screened_rows if options.screened_lm_head and screened_head_fits(config) else 0,
        tiled_argmax_head=options.tiled_argmax_head,
        bucket_gemm_picks=options.bucket_gemm_picks and not options.batch_invariant,
        lm_head_pdl=pdl and _given(options.lm_head_pdl, tuning.lm_head_pdl),
        screened_lm_head_pdl=pdl and _given(options.screened_lm_head_pdl, tuning.screened_lm_head_pdl),
        prefill_pdl_tokens=_given(options.prefill_pdl_tokens, tuning.prefill_pdl_tokens) if pdl else 0,
        folded_norm_from=gemv_rows + 1 if fold_norms else 2**62,
        tune_decode_attention_at_full_length=options.tune_decode_attention_at_full_length,
        packed_prefill=options.packed_prefill,
    )


# ---- the printed plan (qwen-triton ops) ---------------------------------------------------------------
_TAIL_KERNELS = {
    TAIL_STAGED: "linear.staged_out_projection_mlp:_staged_kernel",
    TAIL_FUSED: "linear.out_projection_mlp:_out_projection_mlp_kernel",
    TAIL_LINEAR: "linear.gemv:_gemv_kernel x3",
}
_DELTA_KERNELS = {
    DELTA_PROJECTED: "gated_delta_rule.projected_decode:_projected_step_kernel (in-projection included)",
    DELTA_FUSED: "linear.gemv:_gemv_kernel, gated_delta_rule.fused_decode:_fused_step_kernel (norm in the tail)",
    DELTA_FUSED_NORM: "linear.gemv:_gemv_kernel, gated_delta_rule.fused_decode:_fused_step_kernel (norm in it)",
    DELTA_UNFUSED: "linear.gemv:_gemv_kernel, conv.causal_conv1d:_causal_conv1d_step_kernel, "
                   "gated_delta_rule.recurrent:_recurrent_kernel, "
                   "gated_delta_rule.gated_rms_norm:_gated_rms_norm_kernel",
}
_HEAD_KERNELS = {
    HEAD_SCREENED: "lm_head.screened (int8 screen, exact check)",
    HEAD_ARGMAX: "lm_head.argmax:_lm_head_argmax_kernel + _argmax_reduce_kernel",
    HEAD_SCREENED_TOP_K: "lm_head.screened_top_k (int8 screen, exact check; penalties in it)",
    HEAD_LOGITS: "lm_head logits (linear.gemm:_gemm_kernel past one row; + penalties), then the sampler",
}


def _prefill_rows(plan: Plan, tokens: int) -> dict[str, str]:
    tuning = plan.tuning
    gemm = "linear.gemv:_gemv_kernel" if tokens <= plan.gemv_rows else "linear.gemm:_gemm_kernel"
    if tokens > plan.gemv_rows:
        loads = "TMA" if tokens >= tuning.gemm_tma_rows and plan.device.hopper_or_later else "pointer"
        split = "split-K allowed" if plan.split_k and tokens <= MAX_SPLIT_ROWS else "no split-K"
        gemm += f" ({loads} loads, {split})"
    chunk = chunk_size_for(tokens)
    prepare = "prepare (one kernel)" if tokens <= tuning.chunk_split_prepare_tokens else "inverse + products"
    state = "state pass: Gluon (Hopper, 16-bit)" if plan.device.hopper_or_later else "state pass: Triton"
    return {
        "projections": gemm,
        "norm before a projection": "folded: the GEMM's epilogue from the rows' sums of squares"
        if plan.prefill_folded_norm(tokens) else "the projection's prologue",
        "causal conv1d": "conv.causal_conv1d:_causal_conv1d_kernel"
        + (" (walk)" if triton_bucket(tokens) >= tuning.conv_long_prefill_from else " (tile)"),
        "q/k norm + rotary": "attention.qk_norm_rotary:_qk_norm_rotary_kernel",
        "attention": "attention.prefill:_prefill_kernel",
        "gated delta rule": f"gated_delta_rule.chunk: chunks of {chunk}, {prepare}, {state}, output (+ gated norm)",
        "PDL": "projections, convs, attention" if plan.prefill_pdl(tokens) else "none",
        "LM head": "final norm + linear (logits)",
        "several prompts": "one packed pass (each prompt from a multiple of 64 rows; conv, chunked rule and attention "
                           "take the layout)" if plan.packed_prefill else "one prefill each",
    }


def triton_bucket(tokens: int) -> int:
    """A length rounded up to a power of two, at most 4096 (the kernels' length buckets)."""
    size = 1
    while size < min(tokens, 4096):
        size *= 2
    return size


def _argmax_kernel(plan: Plan, rows: int) -> str:
    return "_lm_head_argmax_tiled_kernel" if plan.argmax_tiled(rows) else "_lm_head_argmax_kernel"


def _decode_rows(plan: Plan, rows: int) -> dict[str, str]:
    tail = plan.decode_tail(rows)
    head = plan.decode_lm_head(rows, "greedy")
    gemv = rows <= plan.gemv_rows
    projection = "linear.gemv:_gemv_kernel" if gemv else "linear.gemm:_gemm_kernel"
    if not gemv and rows <= plan.resident_rows:
        projection = "linear.resident_gemm:_resident_kernel"
    elif not gemv and plan.bucket_gemm_picks and rows in dict(plan.tuning.gemm_decode_by_rows or ()):
        projection += " (the bucket's own picks)"
    top_k_head = plan.decode_lm_head(rows, "penalized-top-k")
    return {
        "attention in-projection": projection + (" (norm in the prologue)" if gemv else " (norm folded)"),
        "q/k norm + rotary": "attention.qk_norm_rotary:_qk_norm_rotary_kernel",
        "attention": "attention.decode:_decode_split_kernel + _decode_merge_kernel"
        + (" (the output gate in the merge)" if tail == TAIL_LINEAR else ""),
        "deltanet layer": _DELTA_KERNELS[plan.decode_delta(rows)].replace("linear.gemv:_gemv_kernel", projection),
        "out-projection + MLP": _TAIL_KERNELS[tail] if tail != TAIL_LINEAR or gemv else projection + " x3",
        "LM head (greedy)": _HEAD_KERNELS[head].replace("_lm_head_argmax_kernel", _argmax_kernel(plan, rows))
        + (", PDL" if (plan.screened_lm_head_pdl if head == HEAD_SCREENED else plan.lm_head_pdl) else ""),
        "LM head (top-k <= 64; penalties)": _HEAD_KERNELS[top_k_head] + (
            ", PDL" if top_k_head == HEAD_SCREENED_TOP_K and plan.screened_lm_head_pdl else "")
        + " + sampling.sample:_top_k_kernel, _draw_kernel",
        "LM head (temperature / top-p)": (f"lm_head.argmax:{_argmax_kernel(plan, rows)} (Gumbel-max)"
                                          if plan.decode_lm_head(rows, "temperature") == HEAD_GUMBEL
                                          else "lm_head logits + sampling.sample")
        + " / lm_head logits + sampling.sample",
        "LM head (min-p / penalties)": "lm_head logits + sampling.sample (stats + draw; the search for top-k, top-p) "
                                       "/ + sampling.penalties:_penalties_kernel before it, _count_kernel after",
        "PDL": "yes" if plan.pdl else "no",
        "CUDA graph": "yes" if plan.cuda_graph else "no",
    }


def _table(title: str, buckets, rows_of) -> list[str]:
    columns = [rows_of(bucket) for bucket in buckets]
    lines = [f"| {title} | " + " | ".join(str(b) for b in buckets) + " |",
             "|---|" + "---|" * len(buckets)]
    for name in columns[0]:
        lines.append(f"| {name} | " + " | ".join(column[name] for column in columns) + " |")
    return lines


def _left_out(plan: Plan, config: ModelConfig) -> list[str]:
    """The variants the options asked for that this model's shape cannot take, with the reason."""
    options, reasons = plan.options, []
    if (options.staged_out_projection_mlp and options.out_projection_mlp and plan.device.hopper_or_later
            and not plan.device.interpreter and not staged_tail_fits(config, plan.device)):
        reasons.append(f"the staged layer tail (hidden {config.hidden_size}, MLP {config.intermediate_size}: its "
                       f"launch plan needs sizes of multiples of 256 whose weights fit the {plan.device.sm_count} "
                       "SMs' shared memory, one attended width)")
    if plan.gemv_rows == 0 and not options.batch_invariant:  # the table's GEMV limit, not an option, took it out
        reasons.append(f"one sequence's GEMV and its fused paths, the layer tail and the projected DeltaNet step "
                       f"(hidden {config.hidden_size} > the {plan.tuning.name} table's {plan.tuning.gemv_hidden_limit}: "
                       "the decode GEMM runs its projections, as for several sequences)")
    if options.screened_lm_head and not screened_head_fits(config):
        serving = ("the bf16 argmax head serves greedy decode, the logits head top-k sampling"
                   if plan.gemv_rows or plan.tiled_argmax_head
                   else "the logits head serves greedy decode and top-k sampling")
        reasons.append(f"the screened LM heads (hidden {config.hidden_size} > their {SCREEN_MAX_COLUMNS} columns; "
                       f"{serving})")
    if options.projected_delta_decode and options.fused_delta_decode and not plan.projected_delta and (
            config.linear_key_head_dim % PROJECTED_ROWS or config.linear_value_head_dim % PROJECTED_ROWS):
        reasons.append(f"the projected DeltaNet step (head dims not multiples of {PROJECTED_ROWS})")
    return reasons


def describe_plan(plan: Plan, config: ModelConfig, decode_rows, prefill_tokens) -> list[str]:
    d = plan.device
    lines = [
        f"Plan for hidden {config.hidden_size}, {config.num_hidden_layers} layers on {d.name} "
        f"(capability {d.capability}, {d.sm_count} SMs{', interpreter' if d.interpreter else ''}); "
        f"tuning table: {plan.tuning.name}",
        "",
        f"split_k={plan.split_k} cuda_graph={plan.cuda_graph} pdl={plan.pdl} fold_norms={plan.fold_norms} "
        f"staged_tail={plan.staged_tail} projected_delta={plan.projected_delta} "
        f"screened_rows={plan.screened_rows} gemv_rows={plan.gemv_rows} prefill_pdl_tokens={plan.prefill_pdl_tokens} "
        f"packed_prefill={plan.packed_prefill}",
        "",
    ]
    left_out = _left_out(plan, config)
    if left_out:
        lines += ["Left out for this shape: " + "; ".join(left_out), ""]
    buckets = list(dict.fromkeys(bucket(rows) for rows in decode_rows))  # a step runs its rows' bucket
    lines += _table("decode rows (bucket)", buckets, lambda rows: _decode_rows(plan, rows))
    lines.append("")
    lines += _table("prefill tokens", prefill_tokens, lambda tokens: _prefill_rows(plan, tokens))
    return lines
