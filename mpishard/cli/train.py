"""`python -m mpi4py -m mpishard train`: its flags, the --config TOML file, validation, build.

Every flag defaults to None in argparse, so "given on the command line" is visible: the
command line wins over the --config file, which wins over `TRAIN_DEFAULTS`. Validation needs no
MPI and is the same on every rank; `prepare_training` (validation and every file read) is
agreed on every rank before `build_training` makes the engine (cli/usage.py's `agreed`).
"""
from __future__ import annotations

import argparse
import logging
import math

import numpy as np

from ..checkpoint import FAILURE_POLICIES, CheckpointError, Checkpointer, resume
from ..nn.functional import ACTIVATIONS
from ..models.mlp.spec import MLP
from ..health.watchdog import DEFAULT_TIMEOUT
from ..engine import make_engine
from ..train.data import DATASETS, load_dataset
from ..train.lr import make_lr_schedule
from ..train.nonfinite import DEFAULT_MAX_NONFINITE, NONFINITE_POLICIES
from ..train.npy_data import is_npy_name, load_npy_dataset
from ..train.records import is_records_name
from ..train.tokens import is_tokens_name
from ..train.optim import SGD, AdamW
from ..train.trainer import Callback, Trainer, configure_logging, summary_table
from .cluster_options import (AUTO, CLUSTER_DEFAULTS, PREEMPTED_EXIT, add_cluster_callbacks,
                              add_metrics_arguments, add_resume_argument, fit_or_preempted,
                              preempted_before_training, resume_source, stop_signals)
from . import auto_layout
from .checkpoint_flags import validate_checkpoint_args
from .dataset_options import dataset_name, fitting_loss
from .flight_options import (FLIGHT_DEFAULTS, add_flight_arguments, add_flight_callbacks,
                             validate_flight_args)
from .gpt_options import (GPT_SCHEDULE_DEFAULTS, LANGUAGE_MODELS, TEXT_DATASET,
                          add_gpt_arguments, validate_gpt_args)
from .model_flag import (KEYED_HELP, check_resumed_model, joined_model_spec, keys_flag,
                         resumed_model_flags)
from .report_options import (REPORT_DEFAULTS, add_report_arguments, log_host_heap,
                             validate_report_args)
from .sft_options import SFT_DEFAULTS, add_sft_arguments
from .token_options import (TOKEN_DEFAULTS, add_token_arguments, check_seq_len,
                            checkpoint_contents, lm_model_and_data, load_initial_params,
                            log_lm_data, validate_lm_args)
from .train_config import config_tokens, load_toml
from .trace_options import (TRACE_DEFAULTS, add_trace_arguments, add_trace_callback,
                            trace_lines, validate_trace_args)
from .device_options import (add_device_arguments, add_precision_arguments,
                             check_precision_flags, engine_options, precision_line)
from .usage import (PROG, Parser, UsageError, agreed, check_flags, checked_layout,
                    default_layout, parse_dims, print_report, world_comm)

# -- arguments ----------------------------------------------------------------------------------
DATASET_MODELS = {"digits": "64,128,128,10", "synthetic-regression": "16,32,32,1",
                  "synthetic-classification": "16,32,32,4", TEXT_DATASET: "gpt"}
LOSS_CHOICES = ("mse", "bce", "cross_entropy")
HOST_HEAP = {"keep": "keep", "none": None}     # --host-heap -> make_engine(host_heap=)

# Defaults applied after merging the command line and the --config file (argparse itself
# defaults everything to None, so "given on the command line" is visible and wins).
TRAIN_DEFAULTS = {
    "layout": None, "model": None, "activation": "relu", "dataset": "digits", "loss": None,
    "optimizer": "adamw", "lr": 1e-3, "momentum": 0.0, "weight_decay": None,
    "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
    "schedule": "constant", "warmup": 0, "min_lr": 0.0, "batch": 64, "epochs": None,
    "steps": None, "accumulate": 1, "clip": None, "seed": 0, "dtype": "float32",
    "param_dtype": None, "comm_dtype": None, "timeout": DEFAULT_TIMEOUT, "host_heap": "keep",
    "device": "auto", "cuda_aware": "auto", "compute_dtype": None, "tf32": False,
    "gpu_comm": "auto", "log_every": 50, "no_progress": False,
    "n_train": 1024, "n_test": 256, "log_level": "INFO",
    "checkpoint_dir": None, "checkpoint_every": 0, "resume": None, "keep_last": 1,
    "checkpoint_failures": "stop",
    "gpt": None, "corpus": None, "corpus_bytes": None, "val_fraction": None,   # gpt_options.py
    "train_stride": None, "on_nonfinite": "stop", "max_nonfinite": DEFAULT_MAX_NONFINITE,
    **TRACE_DEFAULTS, **TOKEN_DEFAULTS, **SFT_DEFAULTS, **CLUSTER_DEFAULTS, **FLIGHT_DEFAULTS,
    **REPORT_DEFAULTS,
}
DEFAULT_EPOCHS = 10


def add_train_arguments(p):
    """The train flags on parser `p`; `p.config_options` maps each flag that a --config file
    may set to its argparse Action (returns p)."""
    options = {}
    m = _recording(p.add_argument_group("model and layout"), options)
    m("--layout", help="mesh layout, e.g. dp=2,tp=2, or auto: the plan's best that fits in "
      "--max-memory (default: dp over all ranks, single on one)")
    auto_layout.add_auto_arguments(m)                 # --max-memory, --calibration
    m("--model", help="comma-separated layer dims, e.g. 64,128,128,10, or " + KEYED_HELP +
      " (no vocab: the data set's); with --resume: the checkpoint's; default: by dataset, "
      + ", ".join(f"{k} {v}" for k, v in DATASET_MODELS.items()) + ")")
    m("--activation", choices=sorted(ACTIVATIONS), help="hidden activation (default relu)")
    m("--dtype", choices=("float32", "float64"), help="default float32 for speed (the "
      "library's make_engine defaults to float64, the exact reference)")
    m("--host-heap", choices=("keep", "none"), help="keep: glibc keeps freed arrays for the "
      "next step (mallopt, logged; the train process's default), none: malloc as it is")
    add_precision_arguments(m)                        # --param-dtype, --comm-dtype
    add_device_arguments(m, default=None)
    d = _recording(p.add_argument_group("data"), options)
    d("--dataset", type=dataset_name, help=f"{', '.join(DATASETS + (TEXT_DATASET,))}, "
      "npy:DIR (memory-mapped DIR/x.npy, y.npy, optional x_test.npy, y_test.npy; needs "
      "--model), tokens:DIR (`mpishard tokenize`'s token files, memory-mapped) or fine-tune "
      "records jsonl:FILE|GLOB, parquet:FILE|GLOB, hfdisk:DIR (the sft extra); default "
      "digits (text with --model gpt or --init-from-hf: windows of --corpus)")
    d("--loss", choices=LOSS_CHOICES, help="default by dataset: mse for regression, "
      "cross_entropy for classes, bce for one output (sigmoid added)")
    d("--n-train", type=int, help="synthetic sets: training rows (default 1024)")
    d("--n-test", type=int, help="synthetic sets: test rows (default 256)")
    d("--seed", type=int, help="data split, shuffling and initialisation (0)")
    add_gpt_arguments(m, d)
    add_token_arguments(m, d)
    add_sft_arguments(d)
    o = _recording(p.add_argument_group("optimisation"), options)
    o("--optimizer", choices=("adamw", "sgd"), help="default adamw")
    o("--lr", type=float, help="peak learning rate (default 1e-3)")
    o("--momentum", type=float, help="sgd momentum (default 0)")
    o("--weight-decay", type=float, help="default 0.01 for adamw, 0 for sgd")
    o("--beta1", type=float, help="adamw beta1 (0.9)")
    o("--beta2", type=float, help="adamw beta2 (0.999)")
    o("--eps", type=float, help="adamw eps (1e-8)")
    o("--schedule", choices=("constant", "cosine"), help="lr schedule (constant; for a "
      "language model, i.e. --model gpt/llama/qwen2, --init-from-hf or --dataset tokens:/jsonl:/"
      "parquet:/hfdisk:, cosine with --warmup 20)")
    o("--warmup", type=int, help="linear warm-up steps (0; 20 for a language model when "
      "--schedule is not given)")
    o("--min-lr", type=float, help="cosine floor (0)")
    o("--batch", type=int, help="global batch, rows per optimizer step (64)")
    o("--epochs", type=int, help=f"passes over the training set (default {DEFAULT_EPOCHS} "
      "when --steps is not given)")
    o("--steps", type=int, help="optimizer steps (instead of --epochs)")
    o("--accumulate", type=int, help="micro-steps per optimizer step (1)")
    o("--clip", type=float, help="max global gradient norm (off)")
    o("--on-nonfinite", choices=NONFINITE_POLICIES, help="a step with inf/nan loss: stop "
      "training with one error line (stop, default), or drop its update and go on (skip)")
    o("--max-nonfinite", type=int, metavar="K", help="skip: stop after K non-finite steps in "
      f"a row (default {DEFAULT_MAX_NONFINITE})")
    r = _recording(p.add_argument_group("reporting"), options)
    r("--log-every", type=int, help="log the loss every N steps (50; 0: never)")
    r("--log-level", choices=("DEBUG", "INFO", "WARNING"), help="rank 0 (INFO)")
    add_report_arguments(r)             # --eval-every, --eval-batch(es), --metrics-json
    add_metrics_arguments(r)
    r("--no-progress", action="store_true", default=None, help="no progress bar")
    add_trace_arguments(r)
    c = _recording(p.add_argument_group("checkpoints"), options)
    c("--checkpoint-dir", metavar="DIR", help="save a sharded checkpoint to DIR (replaced "
      "atomically at each save) at the end and every --checkpoint-every steps; "
      "`python -m mpishard inspect DIR` shows it")
    c("--checkpoint-every", type=int, metavar="N", help="save every N optimizer steps (0, "
      "default: only at the end)")
    c("--keep-last", type=int, metavar="N", help="keep the N newest complete checkpoints as "
      "DIR/step-NNNNNNNN/ folders, deleting older ones only after a new one is complete (1, "
      "default: DIR is the one checkpoint)")
    c("--checkpoint-failures", choices=FAILURE_POLICIES, help="a save that fails mid-run: "
      "stop the run (exit 2, default) or continue training and retry at the next interval")
    add_resume_argument(c)
    add_flight_arguments(r, c)          # --flight-dir, --checkpoint-async (flight_options.py)
    p.add_argument("--config", metavar="FILE.toml", help="read options from a TOML file whose "
                   "keys mirror the flags (model = \"64,128,10\", no-progress = true, ...); "
                   "flags given on the command line win")
    p.config_options = options
    return p


def _recording(group, options: dict):
    """`group.add_argument`, also recording each option string's Action in `options`."""
    def add(*flags, **kwargs):
        action = group.add_argument(*flags, **kwargs)
        options.update(dict.fromkeys(action.option_strings, action))
        return action
    return add


def parse_train_args(argv, parser=None):
    """Namespace of the train options: command line over --config file over defaults."""
    parser = parser or add_train_arguments(Parser(prog=f"{PROG} train"))
    cli = parser.parse_args(argv)
    merged = dict(vars(cli))
    if cli.config:
        try:
            cfg = parser.parse_args(config_tokens(parser, load_toml(cli.config), cli.config))
        except UsageError as exc:
            msg = str(exc)
            raise UsageError(msg if msg.startswith("config") else f"config {cli.config}: {msg}"
                             ) from None
        for k, v in vars(cfg).items():
            if merged.get(k) is None and v is not None:
                merged[k] = v
        if cli.steps is not None and cli.epochs is None:     # a --steps flag beats config epochs
            merged["epochs"] = None
        if cli.epochs is not None and cli.steps is None:
            merged["steps"] = None
    resumed = all(merged.get(k) is None for k in ("model", "gpt", "init_from_hf")) and \
        resumed_model_flags(merged.get("resume"), merged.get("checkpoint_dir"))
    for key, value in (resumed or {}).items():   # --resume without --model: the checkpoint's
        merged[key] = value if merged.get(key) is None else merged[key]
    merged["model_from_checkpoint"] = bool(resumed)
    keyed = joined_model_spec(merged["model"], merged.get("gpt")) \
        if merged.get("model") is not None else None
    if keyed is not None:               # --model KIND:KEY=VALUE,... is --model KIND --gpt ...
        merged.update(model=keyed[0], gpt=keyed[1] or None,
                      gpt_flag=keys_flag(merged["model"], merged.get("gpt")))
    language = merged.get("model") in LANGUAGE_MODELS or \
        merged.get("init_from_hf") is not None or \
        is_tokens_name(merged.get("dataset")) or is_records_name(merged.get("dataset"))
    if merged.get("dataset") is None and language:
        merged["dataset"] = TEXT_DATASET
    if language and merged.get("schedule") is None:
        merged.update(GPT_SCHEDULE_DEFAULTS if merged.get("warmup") is None
                      else {"schedule": GPT_SCHEDULE_DEFAULTS["schedule"]})
    merged["host_heap_asked"] = merged.get("host_heap") is not None   # its line's level
    for k, v in TRAIN_DEFAULTS.items():
        if merged.get(k) is None:
            merged[k] = v
    return argparse.Namespace(**merged)


# -- validation (no MPI; identical on every rank) ----------------------------------------------
def validate_train_args(args, world_size: int):
    """Check everything that can be checked without communication; returns (layout, dims,
    loss name), dims being the model spec of a language model (--model gpt, --init-from-hf)
    or an MLP's list of dims. Raises UsageError (the same on every rank)."""
    if args.layout is None:
        args.layout = default_layout(world_size)
    layout = checked_layout(args.layout, world_size)
    gpt = validate_lm_args(args, layout)    # --init-from-hf, tokens:DIR (else None)
    if args.model is None and is_npy_name(args.dataset):
        raise UsageError(f"--dataset {args.dataset} needs --model D_IN,...,D_OUT")
    if gpt is None:
        args.model = args.model or DATASET_MODELS[args.dataset]
        gpt = validate_gpt_args(args, layout)          # None: an MLP on a table data set
    dims = gpt or parse_dims(args.model)
    if gpt:
        check_seq_len(args, gpt, layout)        # cp's 2*cp chunks, before any model load
    _check_numbers(args)
    if args.steps is not None and args.epochs is not None:
        raise UsageError(f"give --steps or --epochs, not both (got --steps {args.steps} and "
                         f"--epochs {args.epochs})")
    if args.steps is None and args.epochs is None:
        args.epochs = DEFAULT_EPOCHS
    if args.optimizer != "sgd" and args.momentum:
        raise UsageError(f"--momentum {args.momentum:g} applies to --optimizer sgd only")
    if args.weight_decay is None:
        args.weight_decay = 0.01 if args.optimizer == "adamw" else 0.0
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr:g} must not exceed --lr {args.lr:g}")
    check_precision_flags(args.param_dtype, args.comm_dtype, args.dtype)
    engine_options(args, args.dtype)    # --compute-dtype, --tf32, --gpu-comm vs --cuda-aware
    loss = gpt.default_loss if gpt else fitting_loss(args, dims)
    dp = layout.data_parallel_size
    if args.batch % (args.accumulate * dp):
        raise UsageError(f"--batch {args.batch} must divide by --accumulate {args.accumulate} "
                         f"x {dp} data-parallel ranks of layout {layout.text!r} = "
                         f"{args.accumulate * dp}")
    if args.dataset.startswith("synthetic") and args.batch > args.n_train:
        raise UsageError(f"--batch {args.batch} is larger than --n-train {args.n_train}")
    validate_checkpoint_args(args)
    validate_trace_args(args)
    validate_flight_args(args)
    validate_report_args(args, layout)  # evaluation batches, --metrics-json
    return layout, dims, loss


def _check_numbers(args):
    """Every numeric flag within its range (a flag left at None is not checked)."""
    check_flags(args, ("lr", "weight_decay", "momentum", "min_lr", "warmup", "log_every",
                       "seed", "checkpoint_every"), low=0)
    check_flags(args, ("keep_last",), low=1)
    check_flags(args, ("eps", "batch", "accumulate", "n_train", "n_test", "steps", "epochs",
                       "max_nonfinite"), low=0, low_open=True)
    check_flags(args, ("beta1", "beta2"), low=0, high=1)
    if args.clip is not None and math.isfinite(args.clip):
        # a non-finite clip is left to the Trainer, whose message states the whole rule:
        # "clip must be a finite number > 0 (or None)"
        check_flags(args, ("clip",), low=0, low_open=True)


# -- build and run -----------------------------------------------------------------------------
def prepare_training(args, comm):
    """Everything that can fail without a collective: the flags, and every file read (--text,
    --tokenizer, tokens:DIR, npy:DIR, --init-from-hf's config and headers). Returns (layout,
    dims, loss, model, data); a rank that raises here (a copy its node lacks) cannot leave the
    others waiting inside make_engine, as build_training agrees on it first."""
    auto = auto_layout.provisional(args)     # --layout auto: dp until the model is built
    layout, dims, loss = validate_train_args(args, comm.Get_size())
    if not isinstance(dims, list):                     # a GPT or a Hugging Face model
        model, data = lm_model_and_data(args, dims)
    elif is_npy_name(args.dataset):
        data = load_npy_dataset(args.dataset, dims[0], dims[-1])
        model = MLP(dims, activation=args.activation)
    else:
        data = load_dataset(args.dataset, d_in=dims[0], d_out=dims[-1], n_train=args.n_train,
                            n_test=args.n_test, seed=args.seed)
        model = MLP(dims, activation=args.activation,
                    final_activation="sigmoid" if loss == "bce" else None)
    if auto:
        layout, dims, loss = auto_layout.train_layout(args, model, comm.Get_size(),
                                                      validate_train_args)
    if args.batch > len(data.x_train):
        raise UsageError(f"--batch {args.batch} is larger than the {len(data.x_train)} "
                         f"training rows of {args.dataset}"
                         + (f" ({data.rows_hint()})" if data.masked else ""))
    if resume_source(args) and args.init_from_hf is None and \
            not getattr(args, "model_from_checkpoint", False):
        check_resumed_model(model, resume_source(args), args.model if isinstance(dims, list)
                            else f"{args.model}:{args.gpt or ''}")
    return layout, dims, loss, model, data


def build_training(args, comm=None, flag=None):
    """Collective: prepare_training agreed on every rank (the same UsageError everywhere),
    then (engine, optimizer, trainer) built; returns the Trainer (`flag`: the StopFlag the
    Preemption callback checks, see add_cluster_callbacks)."""
    comm = comm or world_comm()
    auto_layout.agree_memory_limit(args, comm)      # --layout auto: the smallest rank's
    layout, dims, loss, model, data = agreed(comm, lambda: prepare_training(args, comm))
    auto_layout.agree_choice(args, comm, layout.text)
    engine = make_engine(model, layout, dtype=np.dtype(args.dtype), comm=comm,
                         param_dtype=args.param_dtype, comm_dtype=args.comm_dtype,
                         host_heap=HOST_HEAP[args.host_heap], **engine_options(args, args.dtype))
    load_initial_params(engine, args, model)                # --init-from-hf's weights, or the init
    if args.optimizer == "adamw":
        opt = AdamW(engine, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                    weight_decay=args.weight_decay)
    else:
        opt = SGD(engine, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    log = configure_logging(engine.device_id, getattr(logging, args.log_level))
    log_host_heap(log, engine, getattr(args, "host_heap_asked", True))
    auto_layout.log_choice(log, args)
    if precision_line(engine.precision):
        log.info("%s", precision_line(engine.precision))
    if not isinstance(dims, list):
        log_lm_data(log, data)
    trainer = Trainer(engine, opt, data, loss, batch=args.batch, steps=args.steps,
                      epochs=args.epochs, accumulate=args.accumulate, clip=args.clip,
                      eval_every=args.eval_every, eval_batch=args.eval_batch,
                      eval_batches=args.eval_batches, log_every=args.log_every, seed=args.seed,
                      progress=not args.no_progress, logger=log,
                      on_nonfinite=args.on_nonfinite, max_nonfinite=args.max_nonfinite)
    if args.schedule != "constant" or args.warmup:
        trainer.schedule = make_lr_schedule(args.schedule, args.lr, trainer.total_steps,
                                            args.warmup, args.min_lr)
    saver = None
    if args.checkpoint_dir:
        extra, assets = checkpoint_contents(args, model, data)
        saver = Checkpointer(args.checkpoint_dir, args.checkpoint_every, args.keep_last,
                             args.checkpoint_failures, extra=extra, assets=assets)
        trainer.callbacks.append(saver)
    if resume_source(args):
        resume(trainer, resume_source(args))      # collective; the same error everywhere
    elif args.resume == AUTO:
        trainer.log.info("--resume auto: no checkpoint in %s; starting fresh",
                         args.checkpoint_dir)
    add_trace_callback(args, trainer)
    add_cluster_callbacks(args, trainer, saver, flag)  # metrics; SIGTERM/SIGUSR1 -> exit 75
    add_flight_callbacks(args, trainer, saver)    # flight dumps, straggler line, async saves
    trainer.callbacks.append(ScheduleLine(
        f"lr {args.lr:g}, {args.schedule} schedule, {args.warmup} warm-up step(s)"
        + (f", floor {args.min_lr:g}" if args.schedule == "cosine" else "")))
    return trainer


class ScheduleLine(Callback):
    """Logs the lr schedule in force as training begins (a default warm-up is not silent)."""

    def __init__(self, text: str):
        self.text = text

    def on_train_begin(self, trainer) -> None:
        trainer.log.info("%s", self.text)


def run_train(args) -> int:
    comm = world_comm()
    with stop_signals(args) as flag:    # held from here: a signal while building stops too
        trainer = agreed(comm, lambda: build_training(args, comm, flag))
        if preempted_before_training(trainer, flag, args):
            return PREEMPTED_EXIT       # no step trained, agreed on every rank
        try:
            metrics = fit_or_preempted(trainer, args)
        except CheckpointError as exc:  # raised on every rank alike (agreed): a clean exit 2
            raise UsageError(str(exc)) from None
    if metrics is None:                 # stopped by SIGTERM/SIGUSR1 after a checkpoint
        return PREEMPTED_EXIT
    return print_report(summary_table(metrics) + trace_lines(trainer))
