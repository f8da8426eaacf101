"""Serve a language model over HTTP: `python -m mpishard serve`, OpenAI-compatible.

    mpiexec -n 4 python -m mpi4py -m mpishard serve --hf ./gpt2 --layout tp=2,pp=2 \\
        --host 127.0.0.1 --port 8000 --max-batch 16 --max-model-len 1024
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "gpt2", "prompt": "Hello", "max_tokens": 20, "temperature": 0}'

Every rank builds the model (--hf DIR, or --checkpoint DIR of ours with the tokenizer it
carries) and loads its shard for --layout, as `generate` does. Rank 0 then runs the HTTP
server (serve/api.py: Starlette under uvicorn, in a thread; the `serve` extra) on --host
(loopback by default) and prints one line, `mpishard serve: listening on http://HOST:PORT`,
once the port is bound and every rank holds its shard. Every rank runs the decode loop
(serve/loop.py): continuous batching over --max-batch slots of --max-model-len positions
each, the KV cache allocated for exactly that (its size is logged at start).

Layouts: tp, pp (the rows go through the stages as --microbatches groups) and both; a dp
axis makes replicas, each running its own rows, rank 0 giving each request to the replica
with the most free slots. fsdp, cp, ep and sequence_parallel are refused (no KV cache under
cp and sequence_parallel; the others shard what a server would gather every step).
`--layout auto` picks among the layouts serve runs (cli/serve_layout.py): one that fits in
--max-memory, then the fewest bytes sent per decode step.

SIGTERM, SIGINT and SIGUSR1 (the signal `launch` forwards) drain the server: new requests
get 503, running ones finish within --drain-timeout seconds (the rest end with
finish_reason "abort"), and every rank exits 0.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import sys
import threading

from .. import hf
from ..comm.gpu import node_local_rank
from ..health.lines import write_line
from ..serve.api import build_app
from ..serve.metrics import make_metrics
from ..serve.batch_step import Stepper
from ..serve.control import control_comm
from ..serve.intake import Intake
from ..serve.loop import ServeLoop
from ..serve.replicas import replica_comm
from ..train.chat_template import (CONFIG_FILE, JINJA_FILE, find_chat_template,
                                   load_chat_template, template_tokens)
from ..train.preemption import StopFlag
from ..validate import check_number
from .auto_layout import add_auto_arguments, agree_choice, agree_memory_limit
from .generate import carried_eos, hf_engine, hf_eos, open_tokenizer
from .infer import add_compute_arguments, checkpoint_engine, open_checkpoint
from .model_flag import HF_NAMES
from .serve_layout import AUTO, auto_layout, serve_layout
from .usage import KEYED, UsageError, agreed, world_comm

DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
KEEP_ALIVE_S = 75
SERVE_EXTRA = ("uvicorn", "starlette", "prometheus_client", "jinja2", "tokenizers")


def add_serve_arguments(p):
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a language model's checkpoint "
                        f"directory ({', '.join(KEYED)}) with the tokenizer it carries")
    source.add_argument("--hf", metavar="DIR", help=f"a Hugging Face model directory "
                        f"({HF_NAMES})")
    p.add_argument("--layout", help="mesh layout: tp, pp and dp (replicas), e.g. tp=2,pp=2 or "
                   "dp=2,tp=2, or auto: fits in --max-memory, fewest bytes sent per decode "
                   "step (default: dp over all ranks, single on one)")
    add_auto_arguments(p.add_argument, calibration=False)     # --max-memory
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: "
                   "this node only; 0.0.0.0 exposes the server to the network)")
    p.add_argument("--port", type=int, default=8000, help="port (8000; 0 picks a free one)")
    p.add_argument("--max-batch", type=int, default=8, metavar="B",
                   help="rows decoded together per replica: the KV cache's slots (8)")
    p.add_argument("--max-model-len", type=int, metavar="T", help="positions per slot: "
                   "prompt + completion (default: the model's seq_len)")
    p.add_argument("--max-queue", type=int, default=64, metavar="Q", help="requests that may "
                   "wait beyond the slots the next step frees before new ones get 429 (64)")
    p.add_argument("--prefill-tokens", type=int, default=512, metavar="N", help="prompt "
                   "tokens read per step (a longer prompt is read in chunks over several "
                   "steps, beside the others' decode) (512)")
    p.add_argument("--microbatches", type=int, default=None, metavar="M", help="under pp: "
                   "the rows go through the stages in M groups (default: the layout's "
                   "microbatches=, else pp)")
    p.add_argument("--api-key", metavar="KEY", help="require `Authorization: Bearer KEY` "
                   "(default: the MPISHARD_API_KEY environment variable, else none)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model's name in the API "
                   "(default: the directory's name)")
    p.add_argument("--tokenizer", metavar="DIR|bytes", help="a directory with tokenizer.json "
                   "or `bytes` (default: the --hf directory's or the checkpoint's)")
    p.add_argument("--chat-template", metavar="FILE", help="the chat template for "
                   "/v1/chat/completions (default: the tokenizer's)")
    p.add_argument("--eos", type=int, action="append", metavar="ID", help="end a completion "
                   "at this id (repeatable; default: config.json's eos_token_id with --hf, the "
                   "carried tokenizer's with --checkpoint)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S", help="on "
                   "SIGTERM/SIGUSR1: seconds running requests get to finish (30)")
    p.add_argument("--heartbeat", type=float, default=1.0, metavar="S", help="an idle "
                   "server's ranks hear from rank 0 this often (1; keep it under --timeout)")
    add_compute_arguments(p)
    return p


def prepare_server(args, comm):
    """Validate argv, the model, the tokenizer and the chat template on every rank (no
    collective). Returns (layout, model, checkpoint or None, Text, eos ids, template)."""
    missing = [m for m in SERVE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"serve needs the serve extra ({', '.join(missing)} missing): pip "
                         f"install 'mpishard[serve]'")
    for flag, low in (("max_batch", 1), ("max_queue", 0), ("prefill_tokens", 1),
                      ("port", 0), ("drain_timeout", 0), ("heartbeat", 0.01)):
        check_number("--" + flag.replace("_", "-"), getattr(args, flag), low=low,
                     error=UsageError, integer=isinstance(getattr(args, flag), int))
    if args.timeout and args.heartbeat >= args.timeout:
        raise UsageError(f"--heartbeat {args.heartbeat:g} must be shorter than --timeout "
                         f"{args.timeout:g}: an idle rank would time out between heartbeats")
    ckpt = None
    if args.hf is not None:
        try:
            model = hf.read_model(args.hf)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--hf {args.hf}: {exc}") from None
        eos = args.eos or hf_eos(args.hf)
    else:
        ckpt, model = open_checkpoint(args.checkpoint)
        if not model.generates:
            raise UsageError(f"--checkpoint {args.checkpoint} holds no language model")
        eos = args.eos or carried_eos(ckpt)
    args.lifted_capacity = getattr(model, "capacity_factor", None) \
        if getattr(model, "n_experts", None) else None
    if args.lifted_capacity is not None:   # capacity is counted per forward call: a decode
        model.capacity_factor = None       # step or a prefill chunk, not a whole prompt
    if args.max_model_len is None:
        args.max_model_len = model.seq_len
    check_number("--max-model-len", args.max_model_len, low=2, integer=True, error=UsageError)
    if args.max_model_len > model.seq_len:
        raise UsageError(f"--max-model-len {args.max_model_len} exceeds the model's "
                         f"{model.seq_len} positions")
    if any(not 0 <= e < model.vocab_size for e in eos):
        raise UsageError(f"--eos {eos}: ids must lie in [0, {model.vocab_size})")
    if args.layout == AUTO:
        dtype = args.dtype or ("float32" if ckpt is None else
                               next(iter(ckpt.values())).dtype.name)
        args.layout = auto_layout(args, model, comm.Get_size(), dtype)
    layout = serve_layout(args, comm.Get_size())
    text = open_tokenizer(args, model, ckpt)
    return layout, model, ckpt, text, eos, chat_files(args, text)


def chat_files(args, text) -> tuple:
    """(the chat template or None, the files its special tokens come from): --chat-template
    FILE, else the tokenizer's, else the --hf directory's chat_template.jinja or
    tokenizer_config.json (where transformers finds it, whatever the tokenizer)."""
    files = dict(text.files)
    if args.chat_template:
        try:
            return load_chat_template(args.chat_template), files
        except (OSError, ValueError) as exc:
            raise UsageError(f"--chat-template {args.chat_template}: {exc}") from None
    if find_chat_template(files) is None and args.hf is not None:
        for name in (JINJA_FILE, CONFIG_FILE):
            path = os.path.join(args.hf, name)
            if name not in files and os.path.isfile(path):
                with open(path, "rb") as f:
                    files[name] = f.read()
    try:
        return find_chat_template(files), files
    except ValueError as exc:
        raise UsageError(f"the chat template: {exc}") from None


def _front(args, text, model, eos, template, files, intake):
    """Rank 0: the app (serve/api.py) under uvicorn in a thread, its socket bound first."""
    import uvicorn
    metrics = make_metrics()
    name = args.served_model_name or os.path.basename(
        os.path.normpath(args.hf or args.checkpoint))
    app = build_app(intake, text.tok, model_name=name, max_model_len=args.max_model_len,
                    vocab_size=model.vocab_size, chat_template=template,
                    special_tokens=template_tokens(files) if template else None,
                    eos=eos, api_key=args.api_key or os.environ.get("MPISHARD_API_KEY"),
                    metrics=metrics)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise UsageError(f"--host {args.host} --port {args.port}: {exc.strerror}") from None
    # an idle connection is kept 75 s (uvicorn's default: 5): a client pool that reuses it
    # after its own 5 s (httpx, hence openai) never meets one the server is closing, where a
    # POST sent into the close is lost with a read error and never reaches the server
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="mpishard-http", daemon=True)
    return server, thread, sock, metrics


def say(text: str, stream=None) -> None:
    """One line of rank 0's, written at once (default stderr; the listening line: stdout),
    so that a launcher merging the two never splits it."""
    write_line(f"mpishard serve: {text}", stream)


def run_serve(args) -> int:
    world = world_comm()
    rank = world.Get_rank()
    agree_memory_limit(args, world)               # --layout auto: the smallest rank's limit
    args.device_rank = node_local_rank(world)     # a replica's engine: its GPU by the job's
    (layout, replicas, inner), model, ckpt, text, eos, (template, files) = agreed(
        world, lambda: prepare_server(args, world))
    agree_choice(args, world, layout.text, show=True)
    comm, replica = replica_comm(world, replicas)
    engine = agreed(world, lambda: hf_engine(args, model, inner, comm) if ckpt is None else
                    checkpoint_engine(ckpt, model, inner, args, comm))
    control = engine.comm if replicas == 1 else \
        control_comm(world, replicas, engine.comm.watchdog.timeout)
    stepper = Stepper(engine, args.max_batch, args.max_model_len,
                      microbatches=args.microbatches or engine.layout.option(
                          "microbatches", engine.layout.size("pp")))
    intake = Intake(args.max_queue) if rank == 0 else None
    front = agreed(world, lambda: _front(args, text, model, eos, template, files, intake)
                   if rank == 0 else None)
    flag = StopFlag(DRAIN_SIGNALS).install()
    loop = ServeLoop(control, stepper, replica=replica, replicas=replicas,
                     leader=comm.Get_rank() == 0, max_batch=args.max_batch,
                     max_len=args.max_model_len, eos=eos, intake=intake,
                     metrics=front[3] if front else None, prefill_tokens=args.prefill_tokens,
                     heartbeat=args.heartbeat, drain_timeout=args.drain_timeout,
                     stopping=lambda: flag.signum)
    try:
        if front is not None:
            server, thread, sock, _ = front
            thread.start()
            while not server.started and thread.is_alive():
                thread.join(0.01)
            if not server.started:
                raise RuntimeError("the HTTP server did not start (its error is above)")
            host, port = sock.getsockname()[:2]
            if args.lifted_capacity is not None:
                say(f"the model's capacity_factor={args.lifted_capacity:g} is lifted (None, "
                    f"as Hugging Face serves Mixtral): a capacity is counted per forward "
                    f"call, here a decode step or a prefill chunk, so tokens would reach "
                    f"other experts than in one pass over the whole prompt")
            say(f"layout {layout.text}: {replicas} replica(s) of {inner}, {args.max_batch} "
                f"slots x {args.max_model_len} positions each; KV cache "
                f"{stepper.nbytes() / 2**20:.1f} MiB on rank 0")
            sys.stdout.flush()
            say(f"listening on http://{host}:{port}", sys.stdout)
        loop.run()
        if rank == 0:
            say(f"drained: {loop.summary()}")
    finally:
        flag.restore()
        if front is not None:
            front[0].should_exit = True
            front[1].join(timeout=10)
    return 0


__all__ = ["add_serve_arguments", "chat_files", "prepare_server", "run_serve"]
