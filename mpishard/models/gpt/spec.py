"""The GPT spec: a decoder-only transformer's sizes and parameter names. No weights live here.

`GPT(vocab_size, seq_len, d_model, n_heads, n_layers, d_ff=None, tied=False)`, with D = d_model,
F = d_ff (default 4 D), V = vocab_size, S = seq_len, has the parameters (names and shapes are
a contract, in this order)

    embed/tokens (V, D), embed/positions (S, D)
    block_{i}/ln_1/scale (D,), block_{i}/ln_1/shift (D,)
    block_{i}/attn/qkv/weights (D, 3D), block_{i}/attn/qkv/bias (3D,)
    block_{i}/attn/proj/weights (D, D), block_{i}/attn/proj/bias (D,)
    block_{i}/ln_2/scale (D,), block_{i}/ln_2/shift (D,)
    block_{i}/mlp/fc/weights (D, F), block_{i}/mlp/fc/bias (F,)
    block_{i}/mlp/proj/weights (F, D), block_{i}/mlp/proj/bias (D,)
    ln_f/scale (D,), ln_f/shift (D,), head/weights (D, V)   (no head/weights when tied)

Forward on integer tokens (B, T), T <= S: h = tokens' rows of embed/tokens + embed/positions[:T];
each block is pre-LayerNorm GPT-2, h += proj(attn(ln_1(h))), h += mlp(ln_2(h)) with
mlp(x) = gelu_tanh(x fc + b) proj + b; attention splits x qkv + b into q | k | v columns and
each into n_heads heads of Dh = D / n_heads columns, causal softmax(q k^T / sqrt(Dh)) v, heads
concatenated in order. Logits = ln_f(h) head/weights (or ln_f(h) embed/tokens^T when tied),
shape (B, T, V). LayerNorm is PyTorch's (biased variance, eps 1e-5); no dropout.

`init(seed)` is GPT-2's: N(0, 0.02) for the embeddings, qkv, fc and head weights, N(0, 0.02 /
sqrt(2 n_layers)) for the two residual projections of each block (attn/proj, mlp/proj),
LayerNorm scale 1 and shift 0, biases 0; float64 numpy, the same on every rank for a seed.
The layers that compute all this are in units.py. `DecoderSpec` is what the GPT shares
with every decoder spec (llama.Llama): the size checks, d_head, layers, param_shapes,
check_input and output_shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...nn.params import ParamSpec
from . import parallelize
from . import costs
from . import hf

INIT_STD = 0.02
RESIDUAL_PROJECTIONS = ("attn/proj/weights", "mlp/proj/weights")


@dataclass(frozen=True)
class BlockSpec:
    """Transformer block `index`: what a pipeline balances and places (`param_shapes`)."""

    index: int
    param_shapes: dict

    @property
    def prefix(self) -> str:
        return f"block_{self.index}"


def positive_int(what, v, who="GPT") -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{who} {what} must be a positive integer, got {v!r}")
    return int(v)


class DecoderSpec(ParamSpec):
    """What every decoder spec (GPT, llama.Llama) shares: blocks between an embedding and a
    head (`embed_param_shapes`, `block_param_shapes(i)`, `head_param_shapes`), token ids in,
    (B, T, vocab_size) logits out."""

    def __init__(self, vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, tied):
        """The sizes every decoder has, checked (ValueError naming the spec's class)."""
        who = type(self).__name__
        self.vocab_size = positive_int("vocab_size", vocab_size, who)
        self.seq_len = positive_int("seq_len", seq_len, who)
        self.d_model = positive_int("d_model", d_model, who)
        self.n_heads = positive_int("n_heads", n_heads, who)
        self.n_layers = positive_int("n_layers", n_layers, who)
        self.d_ff = 4 * self.d_model if d_ff is None else positive_int("d_ff", d_ff, who)
        if self.d_model % self.n_heads:
            raise ValueError(f"{who} d_model={self.d_model} does not divide into "
                             f"n_heads={self.n_heads} heads")
        if not isinstance(tied, (bool, np.bool_)):
            raise ValueError(f"{who} tied must be True or False, got {tied!r}")
        self.tied = bool(tied)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def layers(self) -> list:
        """The blocks, as a pipeline balances and places them (stages.assign_stages)."""
        return [BlockSpec(i, self.block_param_shapes(i)) for i in range(self.n_layers)]

    def param_shapes(self) -> dict:
        shapes = self.embed_param_shapes()
        for i in range(self.n_layers):
            shapes.update(self.block_param_shapes(i))
        shapes.update(self.head_param_shapes())
        return shapes

    # -- what the engine feeds and gets back ---------------------------------------------------
    def check_input(self, x, dtype=None):
        """The array to feed for token ids `x` (B, T) on the device: `x` itself, integers kept
        as integers (`dtype`, the engine's float type, applies to activations only).
        TypeError for non-integer ids, ValueError for a wrong shape or an id out of range."""
        if x.dtype.kind not in "iu":
            raise TypeError(f"{type(self).__name__} input must be integer token ids, got dtype "
                            f"{x.dtype}")
        if x.ndim != 2 or not 1 <= x.shape[1] <= self.seq_len:
            raise ValueError(f"input has shape {tuple(x.shape)}, expected token ids (batch, T) "
                             f"with 1 <= T <= seq_len={self.seq_len} for {self!r}")
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, vocab_size={self.vocab_size}), got "
                             f"[{int(x.min())}, {int(x.max())}]")
        return x

    def output_shape(self, lead_shape) -> tuple:
        """Shape of the logits for a batch whose inputs (or targets) have leading dims
        `lead_shape` = (B, T, ...): (B, T, vocab_size)."""
        if len(lead_shape) < 2 or not 1 <= lead_shape[1] <= self.seq_len:
            raise ValueError(f"{type(self).__name__} outputs (batch, T, {self.vocab_size}) "
                             f"logits with T <= seq_len={self.seq_len}: inputs and targets "
                             f"need (batch, T) leading dims, got shape {tuple(lead_shape)}")
        return (lead_shape[0], lead_shape[1], self.vocab_size)

    # -- parallel plan (interface.py): what every decoder shares --------------------------------
    def supports_recompute(self) -> bool:
        return True

    # -- cost model (interface.py): what every decoder shares (costs.py) ----------------------
    calibration_key = "gpt"

    def param_uses(self, layout, name: str, held=None) -> tuple:
        return costs.param_uses(self, layout, name, held)

    def grad_order(self, names) -> list:
        return costs.grad_order(self, names)

    def boundary_width(self, layout, layer) -> int:
        return costs.boundary_width(self, layout, layer)

    def check_costs(self, layout) -> None:
        costs.check_costs(self, layout)

    def step_flops(self, batch: int) -> int:
        return costs.gpt_flops(self, batch)

    # -- Hugging Face (interface.py): each decoder names its maps (hf_maps, hf_map) ------------
    @classmethod
    def from_hf_config(cls, cfg: dict, hf_map):
        """The spec of config.json `cfg`: `hf_map` reads its fields into our keywords."""
        return cls(**hf_map.spec_args(cfg))

    # -- data and command line (interface.py) --------------------------------------------------
    takes_tokens = True
    generates = True
    default_loss = "cross_entropy"

    @classmethod
    def from_flag(cls, table: dict, vocab_size=None):
        """The spec of a parsed `--model KIND:KEY=VALUE,...` table over flag_defaults (tied as
        0/1; `vocab_size`: the data set's, instead of the table's vocab)."""
        kw = {k: v for k, v in table.items() if k != "vocab"}
        return cls(vocab_size=vocab_size or table["vocab"], **{**kw, "tied": bool(kw["tied"])})

    def flag_args(self) -> dict:
        """{"model": "KIND:KEY=VALUE,..."}: every flag key but vocab (the data set's), booleans
        as 0/1, keys whose value is None left out."""
        values = {k: getattr(self, k) for k in self.flag_defaults if k != "vocab"}
        text = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}"
                        for k, v in values.items() if v is not None)
        return {"model": f"{self.kind}:{text}"}

    def log_name(self) -> str:
        return repr(self)


class GPT(DecoderSpec):
    """A decoder-only transformer spec (GPT-2 style); see the module docstring."""

    kind = "gpt"
    # -- data and command line (interface.py): `--model gpt:KEY=VALUE,...`
    flag_defaults = {"d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64, "d_ff": None,
                     "tied": 0, "vocab": 256}
    flag_types = {"tied": "switch"}

    def __init__(self, vocab_size, seq_len, d_model, n_heads, n_layers, d_ff=None,
                 tied=False):
        super().__init__(vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, tied)

    # -- parallel plan (interface.py): parallelize.py -------------------------------------------
    def plan_params(self, layout) -> dict:
        return parallelize.plan_params(self, layout)

    def build(self, layout, comm, access, stats: dict):
        return parallelize.build(self, layout, comm, access, stats)

    def grads_overlap(self, layout) -> bool:
        """Not when tied: embed/tokens gets the embedding's and the head's gradient."""
        return not self.tied

    def kv_width(self, tp: int) -> int:
        """D / tp: k and v have as many heads as q."""
        return self.d_model // tp

    # -- Hugging Face (interface.py): GPT2LMHeadModel (hf.py) -----------------------------------
    @classmethod
    def hf_maps(cls) -> tuple:
        return (hf,)

    def hf_map(self):
        return hf

    # -- cost model (interface.py): costs.py ---------------------------------------------------
    def cost_parts(self) -> dict:
        return {"tp": (costs.DecoderTensorParallel(),), "ep": ()}

    def step_gemms(self, view) -> list:
        return costs.gemms(self, view)

    def step_elementwise(self, view, op, fixed: dict) -> float:
        return costs.elementwise(self, view, op, fixed)

    def planned_experts(self):
        return None

    def activation_elements(self, view, recompute: str) -> dict:
        return costs.activation_elements(self, view, recompute)

    # -- parameters ----------------------------------------------------------------------------
    def block_param_shapes(self, i: int) -> dict:
        d, f, p = self.d_model, self.d_ff, f"block_{i}"
        return {f"{p}/ln_1/scale": (d,), f"{p}/ln_1/shift": (d,),
                f"{p}/attn/qkv/weights": (d, 3 * d), f"{p}/attn/qkv/bias": (3 * d,),
                f"{p}/attn/proj/weights": (d, d), f"{p}/attn/proj/bias": (d,),
                f"{p}/ln_2/scale": (d,), f"{p}/ln_2/shift": (d,),
                f"{p}/mlp/fc/weights": (d, f), f"{p}/mlp/fc/bias": (f,),
                f"{p}/mlp/proj/weights": (f, d), f"{p}/mlp/proj/bias": (d,)}

    def embed_param_shapes(self) -> dict:
        return {"embed/tokens": (self.vocab_size, self.d_model),
                "embed/positions": (self.seq_len, self.d_model)}

    def head_param_shapes(self) -> dict:
        """ln_f and the head (the tied head reuses embed/tokens and adds nothing)."""
        shapes = {"ln_f/scale": (self.d_model,), "ln_f/shift": (self.d_model,)}
        if not self.tied:
            shapes["head/weights"] = (self.d_model, self.vocab_size)
        return shapes

    def init(self, seed: int = 0) -> dict:
        """Full checkpoint, float64, the same on every rank for the same seed (GPT-2 init)."""
        rng = np.random.default_rng(seed)
        residual_std = INIT_STD / np.sqrt(2 * self.n_layers)
        params = {}
        for name, shape in self.param_shapes().items():
            if name.endswith("/scale"):
                params[name] = np.ones(shape)
            elif name.endswith(("/shift", "/bias")):
                params[name] = np.zeros(shape)
            else:
                std = residual_std if name.endswith(RESIDUAL_PROJECTIONS) else INIT_STD
                params[name] = rng.normal(0.0, std, shape)
        return params

    def __repr__(self) -> str:
        return (f"GPT(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
                f"d_model={self.d_model}, n_heads={self.n_heads}, n_layers={self.n_layers}, "
                f"d_ff={self.d_ff}, tied={self.tied})")
