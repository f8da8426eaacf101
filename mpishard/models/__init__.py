"""One folder per architecture: its spec, units, parallel plan, cost model and Hugging Face
name map. Generic code (nn/, parallel/, the cost models, engine, train/, checkpoint/, hf/, cli/)
reaches a model only through the interface its spec implements (interface.py)."""
from .gpt.spec import GPT
from .llama.spec import Llama, Mixtral
from .mlp.spec import MLP
from .moe.spec import MoE
from .qwen2.spec import Qwen2

# The registry: kind (`--model KIND:...`, a checkpoint's "kind") -> spec class, one line each.
ARCHITECTURES = {
    MLP.kind: MLP,
    MoE.kind: MoE,
    GPT.kind: GPT,
    Llama.kind: Llama,
    Qwen2.kind: Qwen2,
}

__all__ = ["ARCHITECTURES", "GPT", "Llama", "Mixtral", "MLP", "MoE", "Qwen2"]
