"""`export`: a language model's checkpoint of ours as a Hugging Face directory.

    python -m mpishard export --checkpoint ckpt --hf out              # then, in transformers:
    python -m mpishard export --checkpoint ckpt --hf out --dtype bfloat16
    python -m mpishard export --checkpoint old-ft --hf gpt2-ft --source ./gpt2   # no record
    python -m mpishard export --checkpoint ckpt --hf out --max-shard-size 2GB
    AutoModelForCausalLM.from_pretrained("out"); AutoTokenizer.from_pretrained("out")

One process reads the checkpoint (each array once, whatever layout saved it) and writes a
complete Hugging Face directory with ms.hf.save: `config.json`, the weights
(`model.safetensors`, or shards of at most --max-shard-size, default 5GB, named by
`model.safetensors.index.json`), `generation_config.json`, and the tokenizer's files. The
tokenizer is --tokenizer DIR's, else the one the checkpoint carries (train --tokenizer,
--init-from-hf, tokens:DIR), else --source DIR's tokenizer.json when it has one; a
checkpoint of bytes, or of no recorded tokenizer, exports without one (the line printed says
so). The source is `--source DIR` (the
Hugging Face directory the checkpoint's model came from; it must hold the same model), else
the record `import` and `train --init-from-hf DIR` keep in the checkpoint's extra["hf"], else
none. The dtype is --dtype, else the source's, else float32; the source's config fields
(token ids, dropout) are kept. Run it without mpiexec.
"""
from __future__ import annotations

import numpy as np

from .. import hf
from ..checkpoint.format import CheckpointError, model_spec, spec_text
from ..hf.convert import DTYPE_NAMES, MAX_SHARD_SIZE, shard_size
from ..hf.tokenizer import carried, from_files, is_bytes
from ..train.tokenizer import HFTokenizer, read_tokenizer_files
from .infer import open_checkpoint
from .usage import KEYED, UsageError, print_report, world_comm


def add_export_arguments(p):
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="a language model's "
                   f"checkpoint ({', '.join(KEYED)}; any layout and world size)")
    p.add_argument("--hf", metavar="OUT", required=True, help="the Hugging Face directory to "
                   "write (config.json + model.safetensors)")
    p.add_argument("--dtype", choices=tuple(DTYPE_NAMES), help="the file's dtype "
                   "(default: the source's, else float32)")
    p.add_argument("--source", metavar="DIR", help="the Hugging Face directory the checkpoint "
                   "was fine-tuned from: its config fields and dtype are kept (default: the "
                   "checkpoint's record of import or train --init-from-hf, if any)")
    p.add_argument("--tokenizer", metavar="DIR", help="the directory (or tokenizer.json) whose "
                   "tokenizer files to write (default: the checkpoint's own, else --source's)")
    p.add_argument("--max-shard-size", default=MAX_SHARD_SIZE, metavar="SIZE",
                   help=f"largest weight file, e.g. 500MB or a number of bytes (default "
                   f"{MAX_SHARD_SIZE}); a larger model is saved in shards with an index")
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


def tokenizer_of(args, ckpt):
    """(files, eos id, where from) of the tokenizer to write: --tokenizer's, the
    checkpoint's, --source's tokenizer.json, or ({}, None, why there is none)."""
    try:
        record, files = carried(ckpt)
        if args.tokenizer is not None:
            files = read_tokenizer_files(args.tokenizer)
            eos = HFTokenizer(from_files(files), args.tokenizer).eos_id   # EOS_TOKENS' first
            return files, eos, f"--tokenizer {args.tokenizer}"
        if files:
            from_files(files, record)
            return files, record.get("eos_id"), f"the checkpoint's {record['name']}"
        if args.source is not None and hf.tokenizer(args.source) is not None:
            return read_tokenizer_files(args.source), None, f"--source {args.source}"
    except (OSError, ValueError, ImportError) as exc:
        flag = "--tokenizer" if args.tokenizer is not None else "--checkpoint"
        raise UsageError(f"{flag}: its tokenizer: {exc}") from None
    if is_bytes(record):
        return {}, None, "none (the model reads bytes)"
    if record is not None:
        return {}, None, (f"none: the checkpoint records {record.get('name')} but does not "
                          f"carry its files (give --tokenizer DIR)")
    return {}, None, "none recorded (give --tokenizer DIR to include one)"


def run_export(args) -> int:
    if world_comm().Get_size() > 1:        # the same on every rank, before any file is touched
        raise UsageError("export runs as one process (python -m mpishard export ..., without "
                         "mpiexec): every rank would write the same files at once")
    ckpt, model = open_checkpoint(args.checkpoint)
    if not model.generates:
        raise UsageError(f"--checkpoint {args.checkpoint} holds "
                         f"{ckpt.model_spec.get('class')}; only a language model "
                         f"({', '.join(KEYED)}) exports to Hugging Face")
    try:
        max_bytes = shard_size(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    source = source_of(args, ckpt)
    files, eos_id, where = tokenizer_of(args, ckpt)
    try:
        if source is not None:
            hf.set_source(model, source)
        path = hf.save(args.hf, model, {k: np.asarray(v) for k, v in ckpt.items()},
                       dtype=args.dtype, tokenizer=files or None, max_shard_size=max_bytes,
                       eos_id=eos_id)
    except (OSError, ValueError) as exc:
        kind = "--checkpoint" if isinstance(exc, CheckpointError) else "export"
        raise UsageError(f"{kind}: {exc}") from None
    return print_report(f"exported {args.checkpoint} ({model!r}) to {path}; tokenizer: "
                        f"{where}")
