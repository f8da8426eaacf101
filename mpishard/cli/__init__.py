"""Command line: `python -m mpishard <command>` (under mpiexec: `python -m mpi4py -m mpishard`).

    mpiexec -n 4 python -m mpi4py -m mpishard train --dataset digits --layout dp=2,tp=2 \\
        --model 64,128,128,10 --optimizer adamw --lr 0.003 --batch 64 --epochs 12 --clip 1.0
    python -m mpishard schedule --pp 4 --microbatches 8 --schedule 1f1b

Commands live in `COMMANDS`: name -> (help, add_arguments(parser), run(args) -> exit code),
one file per command in this package: train.py, infer.py, generate.py, bench.py, schedule.py,
plan.py, inspect.py, hf_import.py (import), hf_export.py (export), serve.py (model_flag.py: every
command's --model/--gpt; gpt_options.py: train's text corpus flags). A new command is one file
and one entry there.

Bad input is a user mistake, not a crash (usage.py): every rank validates the same argv
before any collective, a command builds inside `agreed(comm, build)`, and `main` turns a
`UsageError` into one line from rank 0, `mpishard: error: ...`, and exit code 2 on every rank.
A process whose stdout reader went away (`mpishard plan ... | head -1`) runs on to its end with
its output dropped, so that every rank leaves the job's collectives together, and then exits
quietly with BROKEN_PIPE_EXIT (`run_and_exit`, PipeSafeStdout).
"""
from __future__ import annotations

import io
import os
import signal
import sys

from mpi4py import MPI

from .bench import add_bench_arguments, run_bench
from .flight import add_flight_arguments, run_flight
from .generate import add_generate_arguments, run_generate
from .hf_export import add_export_arguments, run_export
from .hf_import import add_import_arguments, run_import
from .infer import add_infer_arguments, run_infer
from .launch import add_launch_arguments, run_launch
from .inspect import add_inspect_arguments, run_inspect
from .plan import add_plan_arguments, run_plan
from .plot import add_plot_arguments, run_plot
from .schedule import add_schedule_arguments, run_schedule_command
from .serve import add_serve_arguments, run_serve
from .tokenize import add_tokenize_arguments, run_tokenize
from .trace_summary import add_trace_summary_arguments, run_trace_summary
from .train import add_train_arguments, parse_train_args, run_train
from ..health.watchdog import CollectiveTimeout
from .model_flag import HF_NAMES
from .usage import KEYED, PROG, Parser, UsageError, abort_job, world_rank

__all__ = ["COMMANDS", "MPI_COMMANDS", "BROKEN_PIPE_EXIT", "main", "build_parser",
           "exit_cleanly", "run_and_exit", "PipeSafeStdout", "UsageError"]


# -- the command table ---------------------------------------------------------------------------
# name -> (help, add_arguments(parser) -> parser, run(args) -> exit code).
COMMANDS = {
    "train": (f"train an MLP or a language model ({', '.join(KEYED)}) on a layout "
              "(python -m mpi4py -m mpishard train ...)",
              add_train_arguments, run_train),
    "schedule": ("print a pipeline schedule's timeline, bubble and memory (no MPI needed)",
                 add_schedule_arguments, run_schedule_command),
    "trace-summary": ("compute / comm / idle per rank of a --trace DIR, and a measured vs "
                      "simulated pipeline Gantt PNG (no MPI needed)",
                      add_trace_summary_arguments, run_trace_summary),
    "inspect": ("show a checkpoint (inspect CKPT) or plan a layout without MPI "
                "(inspect --layout L --model DIMS|--hf DIR): groups, shard shapes (each tensor "
                "sharded along which dim and axis, or replicated), memory per rank",
                add_inspect_arguments, run_inspect),
    "infer": ("run a checkpoint over the rows of an .npy file on a layout (python -m mpi4py "
              "-m mpishard infer --checkpoint DIR --input X.npy --output Y.npy ...)",
              add_infer_arguments, run_infer),
    "generate": ("sample text from a language model's checkpoint or a Hugging Face directory "
                 "on a layout, prompts batched (python -m mpishard generate --checkpoint "
                 "DIR|--hf DIR --prompt TEXT ... --max-new-tokens N --temperature T --top-k K "
                 "--top-p P)",
                 add_generate_arguments, run_generate),
    "serve": ("serve a language model over an OpenAI-compatible HTTP API with continuous "
              "batching, rank 0 listening (python -m mpi4py -m mpishard serve --hf DIR|"
              "--checkpoint DIR --layout L --port 8000)", add_serve_arguments, run_serve),
    "plan": ("rank every layout of a world size as --layout auto does (memory, bytes sent "
             "and, with a calibration, step time per rank), no MPI "
             "(plan --model DIMS|--hf DIR --world-size N --batch B)", add_plan_arguments,
             run_plan),
    "import": (f"a Hugging Face directory ({HF_NAMES}) into a checkpoint, each rank reading "
               "its slices (python -m mpi4py -m mpishard import --hf DIR --checkpoint CKPT)",
               add_import_arguments, run_import),
    "export": ("a language model's checkpoint as a Hugging Face directory transformers loads "
               "(python -m mpishard export --checkpoint CKPT --hf OUT [--dtype bfloat16])",
               add_export_arguments, run_export),
    "bench": ("time training steps of a layout on synthetic data: step time, samples/s, "
              "GFLOP/s, communication (python -m mpi4py -m mpishard bench --layout L ...)",
              add_bench_arguments, run_bench),
    "flight": ("line up the ranks' flight-recorder dumps and print where they first diverge, "
               "no MPI needed (flight DIR)", add_flight_arguments, run_flight),
    "launch": ("run an MPI command under the site's launcher and relaunch it with --resume "
               "auto when it dies (launch -n N [--max-restarts K] [--launcher CMD] -- train "
               "...)", add_launch_arguments, run_launch),
    "plot": ("loss, validation and throughput curves of train --metrics-jsonl files into a "
             "PNG, no MPI (plot RUN.jsonl [...] --out FILE.png)", add_plot_arguments, run_plot),
    "tokenize": ("tokenize a corpus or fine-tune records into token files for train "
                 "--dataset tokens:DIR, no MPI (tokenize --tokenizer DIR|bytes --text "
                 "FILE|DIR|GLOB | --dataset jsonl:FILE|parquet:FILE|hfdisk:DIR --out DIR)",
                 add_tokenize_arguments, run_tokenize),
}
# The commands whose processes are ranks of an MPI job: `python -m mpishard` gives them
# health/signals.py's SIGTERM/SIGINT handlers, which remove the MPI library's files on the way out.
MPI_COMMANDS = ("train", "infer", "generate", "bench", "import", "serve")


def build_parser():
    """The `mpishard` parser with one subcommand per COMMANDS entry; `parser.commands` maps
    each command's name to its own parser."""
    parser = Parser(prog=PROG, description="mpishard: distributed training on MPI. Launch "
                    "under mpiexec with `python -m mpi4py -m mpishard <command>`.")
    sub = parser.add_subparsers(dest="command", metavar="command", parser_class=Parser)
    parser.commands = {}
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(parser.commands[name])
    return parser


def main(argv=None, exiting: bool = False) -> int:
    """Parse and run a command; returns the exit code (2 after printing a usage error).
    `exiting`: the process ends with that code (`python -m mpishard`), so a command may keep
    the signal handlers it installed; an in-process caller (the default) gets its own back."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:                 # --help
            return int(exc.code or 0)
        if args.command is None:
            raise UsageError(f"choose a command: {', '.join(COMMANDS)} (see --help)")
        command = args.command
        if command == "train":              # again, with the --config file under the flags
            args = parse_train_args(argv[argv.index("train") + 1:], parser.commands["train"])
        args.exiting = exiting
        return COMMANDS[command][2](args)
    except (UsageError, FloatingPointError) as exc:
        # the trainer raises FloatingPointError from the global mean loss, the same float on
        # every rank, so every rank is here and can exit cleanly instead of aborting
        if world_rank() == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, UsageError) else 1
    except CollectiveTimeout as exc:   # peers may be stuck in MPI: no clean exit possible
        abort_job(exc)


def exit_cleanly(code: int) -> None:
    """sys.exit(code), finalizing MPI first on a failure so that mpi4py's runner does not turn
    the exit into an MPI_Abort (every rank reaches this line with the same code)."""
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    sys.exit(code)


# What a shell reports for a writer ended by SIGPIPE (`yes | head -1`); Python ignores the
# signal and raises BrokenPipeError instead, so the process chooses the same status itself.
BROKEN_PIPE_EXIT = 128 + signal.SIGPIPE


class PipeSafeStdout(io.TextIOWrapper):
    """sys.stdout for `python -m mpishard`: a write or flush that meets a broken pipe (the
    reader, `| head -1`, has gone) points file descriptor 1 at os.devnull, sets `broken` and
    returns as if it had written. The command runs on to its end: a rank that printed is often
    in the middle of the job's collectives (generate's token loop), and leaving them would
    leave its peers waiting until the launcher kills them, with the MPI library's files still
    in /dev/shm. Python's documentation of SIGPIPE recommends os.devnull likewise, so that the
    interpreter's last flush cannot fail again with an "Exception ignored" traceback.
    `alone` (a process with no peers): the BrokenPipeError is raised after the swap instead,
    and the command ends there; nobody waits for it."""

    broken = False
    alone = False

    @classmethod
    def wrap(cls, stream, alone: bool = False):
        """A PipeSafeStdout over `stream`'s binary buffer, with its encoding and buffering;
        `stream` itself when it has no buffer (None, a test's capture) or already is one."""
        if isinstance(stream, cls) or not isinstance(stream, io.TextIOWrapper):
            return stream
        stream.flush()
        safe = cls(stream.buffer, encoding=stream.encoding, errors=stream.errors,
                   newline="\n", line_buffering=stream.line_buffering,
                   write_through=stream.write_through)
        safe.alone = alone
        return safe

    def write(self, text):
        try:
            return super().write(text)
        except BrokenPipeError:
            self.drop()
            if self.alone:
                raise
            return len(text)

    def flush(self):
        try:
            super().flush()
        except BrokenPipeError:
            self.drop()
            if self.alone:
                raise

    def drop(self) -> None:
        """From now on everything written goes to os.devnull (what is buffered included)."""
        devnull_to(self.fileno())
        self.broken = True


def devnull_to(fd: int) -> None:
    """Point file descriptor `fd` at os.devnull."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def run_and_exit(run) -> None:
    """exit_cleanly(run()) with sys.stdout a PipeSafeStdout: a process whose stdout reader went
    away (`| head -1`) runs to its end as every other rank does and then exits with
    BROKEN_PIPE_EXIT, quietly; the ranks whose output was not lost exit with the command's
    code, and the launcher reports BROKEN_PIPE_EXIT as a shell does for `yes | head -1`.
    A broken pipe met outside sys.stdout (a raw write to fd 1) still ends the process quietly
    with that code, where it stands."""
    sys.stdout = stdout = PipeSafeStdout.wrap(sys.stdout, MPI.COMM_WORLD.Get_size() == 1)
    try:
        code = run()
        sys.stdout.flush()                  # a broken pipe shows here, not at shutdown
    except BrokenPipeError:
        devnull_to(sys.stdout.fileno())
        code = BROKEN_PIPE_EXIT
    if getattr(stdout, "broken", False):
        code = BROKEN_PIPE_EXIT
    exit_cleanly(code)


if __name__ == "__main__":
    run_and_exit(main)
