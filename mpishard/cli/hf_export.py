"""`export`: a GPT or Llama checkpoint of ours as a Hugging Face directory.

    python -m mpishard export --checkpoint ckpt --hf out              # then, in transformers:
    python -m mpishard export --checkpoint ckpt --hf out --dtype bfloat16
    python -m mpishard export --checkpoint old-ft --hf gpt2-ft --source ./gpt2   # no record
    AutoModelForCausalLM.from_pretrained("out")

One process reads the checkpoint (each array once, whatever layout saved it) and writes
`config.json` and `model.safetensors` with ms.hf.save. The source is `--source DIR` (the
Hugging Face directory the checkpoint's model came from; it must hold the same model), else
the record `import` and `train --init-from-hf DIR` keep in the checkpoint's extra["hf"], else
none. The dtype is --dtype, else the source's, else float32; the source's config fields
(token ids, dropout) are kept. Run it without mpiexec.
"""
from __future__ import annotations

import numpy as np

from .. import hf
from ..checkpoint.format import model_spec, spec_text
from ..hf.convert import DTYPE_NAMES
from .infer import open_checkpoint
from .usage import UsageError, print_report, world_comm


def add_export_arguments(p):
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="a GPT or Llama "
                   "checkpoint (any layout and world size)")
    p.add_argument("--hf", metavar="OUT", required=True, help="the Hugging Face directory to "
                   "write (config.json + model.safetensors)")
    p.add_argument("--dtype", choices=tuple(DTYPE_NAMES), help="the file's dtype "
                   "(default: the source's, else float32)")
    p.add_argument("--source", metavar="DIR", help="the Hugging Face directory the checkpoint "
                   "was fine-tuned from: its config fields and dtype are kept (default: the "
                   "checkpoint's record of import or train --init-from-hf, if any)")
    return p


def source_of(args, ckpt):
    """The source record: --source DIR's (the same model as the checkpoint's, else
    UsageError), else the checkpoint's extra["hf"], else None."""
    if args.source is None:
        return (ckpt.extra or {}).get("hf")
    try:
        model = hf.read_model(args.source)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--source {args.source}: {exc}") from None
    if model_spec(model) != ckpt.model_spec:
        raise UsageError(f"--source {args.source} holds {spec_text(model_spec(model))}, the "
                         f"checkpoint {spec_text(ckpt.model_spec)}")
    return hf.source(model)


def run_export(args) -> int:
    if world_comm().Get_size() > 1:        # the same on every rank, before any file is touched
        raise UsageError("export runs as one process (python -m mpishard export ..., without "
                         "mpiexec): every rank would write the same files at once")
    ckpt, model = open_checkpoint(args.checkpoint)
    if getattr(model, "kind", None) not in ("gpt", "llama"):
        raise UsageError(f"--checkpoint {args.checkpoint} holds "
                         f"{ckpt.model_spec.get('class')}; only GPT and Llama export to "
                         f"Hugging Face")
    source = source_of(args, ckpt)
    try:
        if source is not None:
            hf.set_source(model, source)
        path = hf.save(args.hf, model, {k: np.asarray(v) for k, v in ckpt.items()},
                       dtype=args.dtype)
    except (OSError, ValueError) as exc:
        raise UsageError(f"export: {exc}") from None
    return print_report(f"exported {args.checkpoint} ({model!r}) to {path}")
