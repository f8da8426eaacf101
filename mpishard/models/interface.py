"""What generic code may ask a model spec: the one interface every architecture implements.

Generic code (nn/, parallel/, the cost models, engine.py, train/, checkpoint/, hf/, cli/) never
asks which model it holds: no `isinstance` on a spec class, no predicate on its kind. It calls
the methods below, and may read the numbers they expose (an expert count, a head count).
A new architecture is a folder `models/<name>/` whose spec implements this protocol, plus one
line in the registry (models/__init__.py).

Every spec subclasses nn/params.ParamSpec (param_names, num_params, check_params), and the
engine refuses anything else; this Protocol documents the rest, method by method, with what
the generic code does with each. Besides these, generic code reads `n_layers` (the layers a
pipeline balances: parallel/stages.py, parallel/compose.py), `num_params()` (cli/) and
`check_params(params)` (engine, checkpoint/, hf/). Decoders also provide the contract in
parallel/decoder.py's docstring (d_model, n_heads, d_ff, tied, vocab_size, seq_len,
embed_param_shapes, head_param_shapes) that the shared decoder plan reads.
"""
from __future__ import annotations

from typing import Protocol


class HFMap(Protocol):
    """One transformers architecture's config fields and name map (models/<name>/hf*.py, built
    from hfmap/'s helpers). hf/ loads, loads into an engine and saves through it alone, so
    the directions cannot disagree."""

    ARCHITECTURE: str
    """config.json's `architectures` entry: "GPT2LMHeadModel", "LlamaForCausalLM", ..."""
    MODEL_TYPE: str
    """config.json's `model_type`, read when a config has no `architectures`."""
    SIZE_FIELDS: tuple
    """The fields to_config writes (the math); save copies the source config's others."""
    DEFAULTS: dict
    """The transformers config class's default of each field read: what an absent one means."""

    def spec_args(self, cfg: dict) -> dict:
        """The spec's constructor keywords a config.json describes (ValueError naming a field)."""

    def to_config(self, model) -> dict:
        """The config.json fields of `model` (SIZE_FIELDS' values)."""

    def fresh_config(self) -> dict:
        """The other fields of a spec built in code (no dropout, no token ids)."""

    def name_map(self, model, keys=None) -> dict:
        """{our name: (file key, transposed) or an hfmap.views entry}; `keys` (a file's, or None
        to save) picks among the layouts files hold."""

    def ignored(self, key: str, model) -> bool:
        """File keys that are no parameter (buffers, a tied head's copy)."""

    def tiny_config(self) -> dict:
        """A tiny config of this architecture: tests/hf/test_architectures.py builds a random
        transformers model from it and checks load, save and layouts against it."""


class ModelSpec(Protocol):
    """A model spec: sizes and parameter names, no weights."""

    # -- identity and shapes (nn/params.ParamSpec gives names, counts and the checkpoint check)
    kind: str
    """The registry key (`--model KIND:...`, checkpoints' `kind`): "mlp", "gpt", ..."""

    def param_shapes(self) -> dict:
        """name -> full shape, in the checkpoint's order."""

    def init(self, seed: int = 0) -> dict:
        """The full checkpoint (float64 numpy arrays), identical on every rank for a seed."""

    def check_input(self, x, dtype):
        """The array to feed for input `x`, or ValueError (the engine, before any collective)."""

    def output_shape(self, lead_shape) -> tuple:
        """The output's shape for a batch whose inputs or targets start with `lead_shape`."""

    def layers(self) -> list:
        """Specs a pipeline can cut (with `n_layers`): the units it cuts between
        (stages.assign_stages balances their parameters). A spec whose plan_params refuses pp
        (ms.MoE, one layer) has neither."""

    # -- data and command line (cli/, train/: what data a model reads, how --model builds it)
    takes_tokens: bool
    """True: integer token ids (batch, T) in, T <= seq_len, ids below vocab_size, logits
    (batch, T, vocab_size) out; False: rows of `d_in` real numbers in, (batch, d_out) out."""

    generates: bool
    """A decoder with a vocabulary: `generate` samples from it and `export` writes it as a
    Hugging Face directory."""

    default_loss: str
    """The loss (nn/losses.LOSSES name) a run uses when nothing else chooses one."""

    flag_defaults: dict | None
    """`--model KIND:KEY=VALUE,...`: every key it takes -> its default (None: the spec's own),
    in the order messages list them; None when no such spelling builds this architecture."""

    flag_types: dict
    """The keys of flag_defaults that are not positive integers -> "number" (positive),
    "weight" (a number >= 0) or "switch" (0 or 1)."""

    @classmethod
    def from_flag(cls, table: dict, vocab_size=None):
        """The spec of a parsed flag_defaults table (specs that have one; `vocab_size`: the
        data set's, instead of the table's `vocab`)."""

    def flag_args(self) -> dict | None:
        """The command-line flags {dest: value} that rebuild this spec (`model`, the --model
        text, and any other, e.g. an MLP's activation); None when no flag spells it."""

    def log_name(self) -> str:
        """The model in one line, as the training log names it."""

    # -- Hugging Face (hf/ reads and writes directories through these; see HFMap above)
    @classmethod
    def hf_maps(cls) -> tuple:
        """The Hugging Face name maps (HFMap) this spec class reads, one per transformers
        architecture (ms.Llama: LlamaForCausalLM and MixtralForCausalLM); () when the
        architecture has no Hugging Face form. A subclass names its own (never inherits)."""

    @classmethod
    def from_hf_config(cls, cfg: dict, hf_map):
        """The spec config.json `cfg` describes, read by `hf_map` (one of hf_maps(); specs
        without a Hugging Face form need none): ValueError naming a field mpishard lacks."""

    def hf_map(self):
        """The name map this spec saves with (one of hf_maps()), or None when it has no
        Hugging Face form (hf.save refuses it)."""

    # -- parallel plan (parallel/compose.py and nn/recompute.py ask these; parallel/decode.py
    #    reads only `generates`, `vocab_size` and `seq_len`; models/<name>/parallelize.py answers)
    def plan_params(self, layout) -> dict:
        """name -> parallel.placement.ParamInfo (full shape, Placement) of every parameter under
        `layout`; ValueError, the same on every rank before any collective, for a layout the
        model cannot run. Checkpoints, `inspect` and the cost models read the same plan."""

    def build(self, layout, comm, access, stats: dict):
        """This rank's parallel.compose.RankUnits: its units (one list per virtual stage it
        holds), the output seam (the loss and gather_batch, e.g. vocab-parallel logits) and
        an auxiliary-loss hook for the runner (parallel/aux_loss.py) or None. comm: the
        engine's Comm; access: the parameter-access policy; stats: where measurements land."""

    def grads_overlap(self, layout) -> bool:
        """Whether each gradient is final after one add_grad, so the data-parallel sync may
        overlap the backward (False for a tied head or experts exchanged over ep)."""

    def supports_recompute(self) -> bool:
        """Whether recompute=1|attn applies: the units hold blocks that say
        `recomputable = True` (and attention cores that say `attention_core = True`)."""

    def kv_width(self, tp: int) -> int:
        """Decoders: the columns of k (and of v) per tp rank, what a cp ring sends."""

    # -- cost model (costs/: memory, bytes, calls and step time of a layout, with no MPI; and the
    # runtime's ZeRO buckets and pipeline buffers: parallel/fsdp.py, parallel/pipeline.py)
    def param_uses(self, layout, name: str, held=None) -> tuple:
        """(gets, gradients added) of parameter `name` per microbatch: FSDP ZeRO-3 all-gathers
        it per get, ZeRO-2/3 reduce-scatter each gradient. held: the names the rank holds,
        when they tell its pp stage (parallel/unit_costs.py has the generic table)."""

    def grad_order(self, names) -> list:
        """The order in which one microbatch's backward adds the gradients of `names` (a
        stage's parameters, in model order); ZeRO-2/3 bucket them in that order."""

    def boundary_width(self, layout, layer) -> int:
        """Elements per batch row of the activation a pipeline stage ending with `layer` (one
        of layers()) sends on, and of the gradient that comes back (specs a pipeline can cut;
        the others raise ValueError)."""

    def check_costs(self, layout) -> None:
        """ValueError for a layout the cost models cannot price, beyond plan_params' refusals
        (costs.rank_costs.check_fit)."""

    def cost_parts(self) -> dict:
        """The model's own strategies' costs, {"tp": parts priced first, "ep": parts priced
        after the data-parallel gradient sync}: parallel/unit_costs.CostPart each."""

    calibration_key: str
    """Which calibration factors price its step (the calibration's "mlp" or "gpt" entries)."""

    def step_gemms(self, view) -> list:
        """(flops per call, calls per train_step, curve 'gemm' or 'bgemm') of each GEMM a
        RankView's rank runs; ValueError where the step-time model does not price the model."""

    def step_elementwise(self, view, op, fixed: dict) -> float:
        """Seconds of a RankView's rank's element-wise work per train_step; op(name, elements):
        the calibrated seconds of one call; fixed: the calibration's per-call costs."""

    def step_flops(self, batch: int) -> int:
        """Model FLOPs of one training step on `batch` rows (bench's GFLOP/s); ValueError for a
        spec the step-time model cannot price (ms.MoE)."""

    def activation_elements(self, view, recompute: str) -> dict:
        """Optional (costs/peak_memory.py): per batch row, the elements a RankView's rank keeps
        for backward ('saved', its pp stage's units under recompute '0', '1' or 'attn'; and
        'per_microbatch', optional: elements kept once per microbatch whatever its rows), its
        largest backward transient ('workspace'), the loss's logits ('logits', 0 off the last
        stage), the head's weight block ('head_weights'), whether the loss is vocab-parallel
        ('vocab_parallel'), the bytes of one row of
        the batch ('input_bytes'), and optionally whether the logits and their gradients
        stay alive through the backward beyond 'workspace' ('backward_holds_logits'). A spec
        without it is priced without activations. Optional, for a compute dtype
        (costs/storage.py; without them every element is priced at the itemsize):
        'saved_wide' and 'saved_low', what a rounding policy keeps instead of 'saved' (low:
        the matmul inputs, 2 bytes on a device), 'workspace_wide' and 'workspace_low' alike,
        'saved_probs', 'workspace_probs' and 'lse' (the probabilities among them and the
        log-sum-exp a device's fused attention keeps instead), 'saved_out' and
        'workspace_out' (attention outputs cuDNN writes in 16 bits), 'ds' (the attention
        backward's probabilities-sized ds) and 'fused_attention' (whether a device's fused
        attention takes the blocks): models/gpt/costs.py."""

    def planned_experts(self) -> int | None:
        """The expert count the planner may split over ep (None: it tries no ep layout)."""
