"""Sample text: `python -m mpishard generate` (a checkpoint of ours, or a Hugging Face directory).

    python -m mpishard generate --checkpoint ckpt --prompt "def " --max-new-tokens 200 \\
        --temperature 0.8 --top-k 40 --top-p 0.95 --seed 0
    mpiexec -n 4 python -m mpi4py -m mpishard generate --hf ./gpt2 --layout tp=2,pp=2 \\
        --prompt "Hello" --prompt "The capital of France is" --temperature 0
    python -m mpishard generate --checkpoint ckpt --prompts prompts.txt   # a prompt per line
    python -m mpishard generate --hf ./llama-sft --prompt-file prompt.txt  # the file is one

    python -m mpishard generate --hf ./llama-sft --chat "Hello"   # rendered with its template

`--prompt-file` keeps its file's content byte for byte: `--prompt "$(cat prompt.txt)"` loses
the trailing newline to the shell, and a chat prompt must end with the assistant's header
and its newline (ChatML's "<|im_start|>assistant\n") for the model to answer. `--chat MESSAGE`
makes that prompt itself: a one-turn user conversation rendered with the tokenizer's chat
template (train/chat_template.py; `--chat-template FILE` overrides it) and the generation
prompt, encoded without adding special tokens, as transformers' apply_chat_template(
add_generation_prompt=True) does.

Every rank builds the model (the checkpoint's index, or --hf's config.json), makes the engine
for `--layout` (default dp; auto: cli/auto_layout.py) and loads its shard. Prompts are encoded
by `--tokenizer DIR|bytes`, else the directory's tokenizer.json with --hf, else the
one the checkpoint carries (train --tokenizer, --init-from-hf, tokens:DIR: its files, checked
against the sha256 it records), else bytes (UTF-8) for a model of vocabulary 256. Bytes for a
model of another vocabulary, not trained on bytes, is refused: its ids are not bytes, and the
text would be garbage. All prompts are generated together by `engine.generate`
(parallel/decode.py: one forward per step for the whole batch, left padding, a KV cache where
the layout allows it, otherwise the context recomputed every step; `--no-kv-cache` forces
that), and every rank draws the same ids. Rank 0 prints: with one prompt the text as it comes,
with several each prompt's text and completion after a `--- prompt i ---` line.

--temperature 0 is greedy (argmax); --top-k K keeps the K largest logits (0: all); --top-p P
keeps the smallest set of most likely tokens whose probability reaches P (1: all), as
transformers does. `--eos ID` (repeatable) ends a prompt's completion at that id (included);
with --hf the default is config.json's eos_token_id, with --checkpoint the end-of-text id of
the tokenizer it carries.
"""
from __future__ import annotations

import codecs
import json
import os
import sys

import numpy as np

from .. import hf
from ..checkpoint.format import CheckpointError
from ..engine import make_engine
from ..hf.tokenizer import carried, from_files, is_bytes
from ..parallel.decode import Decoder
from ..train.chat_template import chat_template_for, render_chat, template_tokens
from ..train.memory import PhasePeaks, gather_peaks
from ..train.tokenizer import read_tokenizer_files
from ..validate import check_number
from .auto_layout import add_auto_arguments, agree_choice, agree_memory_limit, chosen
from .infer import add_compute_arguments, checkpoint_engine, open_checkpoint
from .model_flag import HF_NAMES
from .device_options import engine_options
from .usage import (KEYED, UsageError, agreed, check_directory, check_flags, checked_layout,
                    default_layout, world_comm)

DEFAULT_NEW_TOKENS = 200
BYTES = "bytes"


def add_generate_arguments(p):
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a language model's checkpoint "
                        f"directory ({', '.join(KEYED)}), e.g. from train --model gpt (any "
                        "layout and world size)")
    source.add_argument("--hf", metavar="DIR", help="a Hugging Face model directory "
                        f"(config.json + safetensors: {HF_NAMES}): no conversion step")
    p.add_argument("--layout", help="mesh layout, e.g. dp=2 or tp=2,pp=2, or auto: fits in "
                   "--max-memory, then the fewest bytes per token (default: dp over all ranks)")
    add_auto_arguments(p.add_argument, calibration=False)     # --max-memory
    p.add_argument("--prompt", action="append", help="a text to continue (UTF-8; repeatable: "
                   "the prompts are generated as one batch; default a newline)")
    p.add_argument("--prompt-file", action="append", metavar="FILE", help="a file whose whole "
                   "content, byte for byte (trailing newlines kept), is one prompt: a chat "
                   "prompt ending in the assistant's header and its newline (repeatable; after "
                   "the --prompt ones)")
    p.add_argument("--chat", action="append", metavar="MESSAGE", help="a user message, "
                   "rendered with the tokenizer's chat template and its generation prompt as "
                   "one prompt (repeatable; after the --prompt-file ones)")
    p.add_argument("--chat-template", metavar="FILE", help="with --chat: this template (.jinja, "
                   "or .json with a chat_template key) instead of the tokenizer's")
    p.add_argument("--prompts", metavar="FILE", help="a file of prompts, one per line (empty "
                   "lines skipped); with --prompt/--prompt-file/--chat, these come after")
    p.add_argument("--tokenizer", metavar="DIR|bytes", help="a directory with tokenizer.json "
                   "or `bytes` (default: the --hf directory's, or the one the checkpoint "
                   "carries; bytes for a vocabulary of 256)")
    p.add_argument("--max-new-tokens", "--tokens", dest="max_new_tokens", type=int,
                   default=DEFAULT_NEW_TOKENS, metavar="N",
                   help=f"tokens to generate per prompt (default {DEFAULT_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="divide the logits by this (default 1; 0: greedy)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample among the K most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the most likely tokens whose probability reaches P "
                   "(nucleus; default 1: all)")
    p.add_argument("--eos", type=int, action="append", metavar="ID",
                   help="end a completion at this token id (repeatable; default: config.json's "
                   "eos_token_id with --hf, the carried tokenizer's with --checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed (0)")
    p.add_argument("--metrics-json", metavar="PATH", help="write the ids generated and each "
                   "rank's peak memory while generating (bytes above its memory once the model "
                   "is loaded) here (rank 0)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context "
                   "every step instead of decoding with a KV cache")
    add_compute_arguments(p)
    return p


# -- library helpers (tests use them) -----------------------------------------------------------
def generate_tokens(engine, prompt: list, n_new: int, *, temperature=1.0, top_k=0, top_p=1.0,
                    seed=0, on_token=None, kv_cache=True, refill=None) -> list:
    """Collective: `n_new` ids continuing one `prompt` (engine.generate of a batch of one);
    on_token(id) is called with each id as it is drawn."""
    show = None if on_token is None else (lambda row, token: on_token(token))
    return engine.generate([prompt], n_new, temperature=temperature, top_k=top_k,
                           top_p=top_p, seed=seed, kv_cache=kv_cache, refill=refill,
                           on_token=show)[0]


def last_logits(engine, tokens: list, cache=None):
    """Collective: the float64 logits (V,) after `tokens` (one row), on every rank. cache
    None: the tokens are the whole context (recomputed); a KVCache: they are the new positions
    after the cached ones, and are cached too."""
    decoder, v = Decoder.of(engine), engine.model.vocab_size
    ids = np.repeat(np.asarray(tokens, dtype=np.int64)[None, :], decoder.rows, axis=0)
    if cache is None:
        return decoder.recomputed_step(ids, np.full(decoder.rows, len(tokens) - 1), v)[0]
    return decoder.cached_step(ids, np.ones(ids.shape, dtype=bool), cache, v)[0]


# -- text <-> ids -------------------------------------------------------------------------------
class Text:
    """encode(str) -> ids and an incremental decode(ids so far) -> the new printable text, for
    bytes (UTF-8, vocab 256) or a tokenizers.Tokenizer.

    A completion is decoded as the continuation of its prompt (`context`): the text of
    prompt + ids less the text of the prompt. Decoding the new ids alone would drop a leading
    space that sentencepiece-style tokenizers (Metaspace: "▁Paris") strip at the start of a
    text, printing "...France isParis"."""

    def __init__(self, tokenizer=None, files=None, name=BYTES):
        self.tok, self.files, self.name = tokenizer, dict(files or {}), name
        self.vocab = 256 if tokenizer is None else tokenizer.get_vocab_size()
        self.reset()

    def reset(self, context=()):
        """Start a completion of the prompt ids `context`."""
        self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.shown = ""
        self.context = list(context)

    def encode(self, text: str, special=True) -> list:
        """The ids of `text`; special=False: without the tokenizer's added special tokens (a
        rendered chat holds its own)."""
        if self.tok is None:
            return list(text.encode("utf-8"))
        return self.tok.encode(text, add_special_tokens=special).ids

    def __repr__(self) -> str:
        return f"the tokenizer {self.name}"

    def _after(self, ids: list, context: list) -> str:
        """The tokenizer's text of `ids` as they continue `context`."""
        if not context:
            return self.tok.decode(ids)
        head, text = self.tok.decode(context), self.tok.decode(context + list(ids))
        return text[len(head):] if text.startswith(head) else self.tok.decode(ids)

    def check_ids(self, rows: list, vocab_size: int) -> None:
        """UsageError (every rank: `rows` are the same on each) for a sampled id that bytes
        cannot decode: a model of another vocabulary recorded as trained on bytes."""
        bad = [i for row in rows for i in row if not 0 <= i < 256] if self.tok is None else []
        if bad:
            raise UsageError(f"the model sampled id {bad[0]}, which is no byte: the bytes "
                             f"tokenizer decodes ids 0..255, the model's vocabulary has "
                             f"{vocab_size} ids; give --tokenizer DIR (the model's tokenizer)")

    def whole(self, ids: list, context=()) -> str:
        """The text of `ids` at once (continuing the prompt ids `context`)."""
        if self.tok is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._after(ids, list(context))

    def decode(self, ids: list, final=False) -> str:
        """The text of `ids` not returned before (ids: all new ids so far, in order); bytes
        show nothing for an id that is no byte (check_ids then refuses the run)."""
        if self.tok is None:
            last = ids[-1:] if ids and 0 <= ids[-1] < 256 else []
            return self.bytes.decode(bytes(last), final=final)
        text = self._after(ids, self.context)
        if not final:                        # a split multi-byte character: wait for it
            text = text.rstrip("\ufffd")
        new = text[len(self.shown):] if text.startswith(self.shown) else text
        self.shown = text
        return new


def read_prompts(args) -> list:
    """The prompts' texts: each --prompt, each --prompt-file's whole content, then the lines
    of --prompts; UsageError for a file that does not read or an empty prompt."""
    prompts = list(args.prompt or [])
    for path in args.prompt_file or []:
        try:
            with open(path, encoding="utf-8", newline="") as f:
                prompts.append(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--prompt-file {path}: {exc}") from None
        if prompts[-1] == "":
            raise UsageError(f"--prompt-file {path} is empty; give at least one character")
    if args.prompts is not None:
        try:
            with open(args.prompts, encoding="utf-8") as f:
                prompts += [line.rstrip("\r\n") for line in f if line.strip("\r\n")]
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--prompts {args.prompts}: {exc}") from None
    if not prompts and args.prompts is not None:
        raise UsageError(f"--prompts {args.prompts}: no prompt in the file")
    if any(p == "" for p in prompts):
        raise UsageError("--prompt is empty; give at least one character")
    return prompts or ([] if args.chat else ["\n"])


def all_prompts(args, text) -> list:
    """[(prompt text, whether encoding adds special tokens)]: read_prompts' texts, the --chat
    messages rendered with `text`'s chat template (the --prompts lines last)."""
    texts = read_prompts(args)
    if not args.chat:
        return [(p, True) for p in texts]
    if text.tok is None:
        raise UsageError("--chat needs a tokenizer with a chat template (give --tokenizer DIR); "
                         "bytes have none")
    try:
        template = chat_template_for(text, args.chat_template)
        chats = [render_chat(template, [{"role": "user", "content": m}], True,
                             template_tokens(text.files)) for m in args.chat]
    except (OSError, ValueError) as exc:
        raise UsageError(f"--chat: {exc}") from None
    first = len(args.prompt or []) + len(args.prompt_file or [])
    return [(p, True) for p in texts[:first]] + [(c, False) for c in chats] + \
        [(p, True) for p in texts[first:]]


def open_tokenizer(args, model, ckpt=None):
    """Text for --tokenizer, else the --hf directory's tokenizer.json, else the one checkpoint
    `ckpt` carries, else bytes; UsageError for bytes where `model`'s ids are not bytes."""
    record = None if ckpt is None else (ckpt.extra or {}).get("tokenizer")
    if ckpt is not None and args.tokenizer is None:
        try:
            record, files = carried(ckpt)
            if files:
                return Text(from_files(files, record), files, record.get("name"))
        except (CheckpointError, ValueError, ImportError) as exc:
            raise UsageError(f"--checkpoint {args.checkpoint}: its tokenizer: {exc}") from None
        if record is not None and not is_bytes(record):
            raise UsageError(f"--checkpoint {args.checkpoint} was trained with the tokenizer "
                             f"{record['name']} (sha256 {str(record.get('sha256'))[:16]}) but "
                             f"does not carry its files; give --tokenizer DIR")
    where = args.tokenizer or args.hf
    if where is None or where == BYTES:
        if model.vocab_size != 256 and not is_bytes(record):
            given = "--tokenizer bytes" if where == BYTES else "bytes (no tokenizer given)"
            raise UsageError(f"{given}: the model's vocabulary has {model.vocab_size} ids, "
                             f"bytes have 256, and it was not trained on bytes; give "
                             f"--tokenizer DIR")
        return Text()
    tok = hf.tokenizer(where)
    if tok is None:
        raise UsageError(f"{'--tokenizer' if args.tokenizer else '--hf'} {where}: no "
                         f"tokenizer.json (give --tokenizer DIR or --tokenizer bytes)")
    return Text(tok, read_tokenizer_files(where), where)


def carried_eos(ckpt) -> list:
    """The end-of-text id of the tokenizer a checkpoint carries, as a list (none: [])."""
    eos = ((ckpt.extra or {}).get("tokenizer") or {}).get("eos_id")
    return [] if eos is None else [int(eos)]


def hf_eos(path) -> list:
    """config.json's eos_token_id of a Hugging Face directory, as a list (none: [])."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError):
        return []
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


# -- the command --------------------------------------------------------------------------------
def hf_engine(args, model, layout, comm):
    """The engine of --hf DIR's `model` on `layout` (--dtype, default float32), each rank
    reading its slices."""
    dtype = np.dtype(args.dtype or "float32")
    engine = make_engine(model, layout, dtype=dtype, comm=comm, **engine_options(args, dtype))
    hf.load_into(engine, args.hf)
    return engine


def prepare_generator(args, comm):
    """Validate argv, the tokenizer, the prompts and the model's spec: no collective, so a
    rank that raises here (a file its node lacks) cannot leave the others waiting inside
    make_engine. Returns (layout, Text, prompt id lists, eos ids, model, checkpoint or None)."""
    check_flags(args, ("max_new_tokens", "top_k", "seed"), low=0)
    check_number("--temperature", args.temperature, low=0, error=UsageError)
    check_number("--top-p", args.top_p, low=0, low_open=True, error=UsageError)
    if args.top_p > 1:
        raise UsageError(f"--top-p must lie in (0, 1], got {args.top_p:g}")
    if args.hf is not None:
        check_directory("--hf", args.hf)
    if args.metrics_json:
        check_directory("--metrics-json", os.path.dirname(os.path.abspath(args.metrics_json)))
    ckpt = None
    if args.hf is not None:
        eos = args.eos or hf_eos(args.hf)
        try:
            model = hf.read_model(args.hf)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--hf {args.hf}: {exc}") from None
    else:
        ckpt, model = open_checkpoint(args.checkpoint)
        if not model.generates:
            raise UsageError(f"--checkpoint {args.checkpoint} holds "
                             f"{ckpt.model_spec.get('class')}, not a language model "
                             f"({', '.join(KEYED)}); generate samples from language models")
        eos = args.eos or carried_eos(ckpt)
    text = open_tokenizer(args, model, ckpt)
    prompts = [text.encode(p, special) for p, special in all_prompts(args, text)]
    empty = [i for i, ids in enumerate(prompts) if not ids]
    if empty:
        raise UsageError(f"prompt {empty[0]} encodes to no tokens with this tokenizer")
    if args.top_k > model.vocab_size:
        raise UsageError(f"--top-k {args.top_k} exceeds the vocabulary of {model.vocab_size}")
    if text.vocab > model.vocab_size:
        raise UsageError(f"the tokenizer's {text.vocab} ids exceed the model's vocabulary of "
                         f"{model.vocab_size}")
    if any(not 0 <= e < model.vocab_size for e in eos):
        raise UsageError(f"--eos {eos}: ids must lie in [0, {model.vocab_size})")
    size = comm.Get_size()
    layout = chosen(args, model, size, "generate", prompts=prompts) or default_layout(size)
    return checked_layout(layout, size), text, prompts, eos, model, ckpt


def build_generator(args, comm):
    """Collective: prepare_generator agreed on every rank (the same UsageError everywhere),
    then the engine made and loaded; returns (engine, Text, prompt id lists, eos ids)."""
    agree_memory_limit(args, comm)              # --layout auto: the smallest rank's limit
    layout, text, prompts, eos, model, ckpt = agreed(comm, lambda: prepare_generator(args, comm))
    agree_choice(args, comm, layout.text, show=True)
    engine = (hf_engine(args, model, layout, comm) if ckpt is None else
              checkpoint_engine(ckpt, model, layout, args, comm))
    return engine, text, prompts, eos


def run_generate(args) -> int:
    comm = world_comm()
    engine, text, prompts, eos = agreed(comm, lambda: build_generator(args, comm))
    shown = [p for p, _ in all_prompts(args, text)] if comm.Get_rank() == 0 else None
    stream = shown is not None and len(prompts) == 1
    new = []

    def show(row, token):
        new.append(token)
        sys.stdout.write(text.decode(new))
        sys.stdout.flush()

    if stream:
        sys.stdout.write(shown[0])
        text.reset(prompts[0])
    peaks = PhasePeaks()                 # the baseline: the engine built and loaded
    peaks.switch("generate")
    out = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos=eos or None,
                          kv_cache=not args.no_kv_cache, on_token=show if stream else None)
    peaks.switch(None)
    text.check_ids(out, engine.model.vocab_size)
    if stream:
        sys.stdout.write(text.decode(new, final=True) + "\n")
    elif shown is not None:
        for i, (prompt, ids) in enumerate(zip(shown, out)):
            sys.stdout.write(f"--- prompt {i} ---\n{prompt}{text.whole(ids, prompts[i])}\n")
    sys.stdout.flush()
    if args.metrics_json:
        write_metrics(args.metrics_json, comm, engine, peaks, out)
    return 0


def write_metrics(path, comm, engine, peaks, ids) -> None:
    """Collective: the generated ids and every rank's peak memory while generating
    (memory.gather_peaks), written by rank 0 to `path` as JSON."""
    record = {"ids": [[int(i) for i in row] for row in ids], **gather_peaks(engine.comm, peaks)}
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
