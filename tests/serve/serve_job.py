"""`mpishard serve` jobs for the end-to-end tests and the load test, and their references.

    directory = write_model(tmp / "gpt", "gpt")          # a tiny float64 HF directory, vocab 256
    job = ServeJob(2, ["--hf", directory, "--layout", "tp=2"])   # waits for the listening line
                                                         # (no --host: the loopback default)
    job.url                                              # http://127.0.0.1:PORT
    rc, out = job.stop()                                 # SIGTERM: drain, exit 0 on every rank
    answers = references(directory, [b"hello", ...], 12) # engine.generate(prompt alone, greedy)

The models are GPT-2, Llama and Mixtral (capacity_factor=None: no drops, as Hugging Face)
of vocabulary 256, so the server's bytes tokenizer (UTF-8 ids 0..255) encodes the prompts;
they are written with ms.hf.save in float64 (no torch), with a chat_template.jinja beside them
so chat requests render, and no eos id: every greedy answer runs to its max_tokens. The
reference is the engine's own generate of each prompt alone on "single", in this process.

A job is `mpiexec -n N python -m mpi4py -m mpishard serve ... --port 0` (the default host,
127.0.0.1, unless the arguments name one) in a
session of its own; its output is read by a thread (the pipe never fills) until rank 0 prints
`mpishard serve: listening on http://HOST:PORT`. stop() signals mpiexec (hydra forwards the
signal to every rank), kills the job's process group if it outlives its timeout, and removes
the files of the MPI library a killed job leaves (tests/hpc/leftovers.py).
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

import mpishard as ms

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "hpc")]    # conftest, leftovers (scripts)

import leftovers  # noqa: E402
from conftest import ROOT, mpiexec_cmd  # noqa: E402

LISTENING = re.compile(r"^mpishard serve: listening on (http://(\S+):(\d+))$")
SEQ_LEN = 64
# The same small sizes for all three: tp=2 splits 4 heads and 2 kv heads, pp=2 two layers.
SIZES = dict(vocab_size=256, seq_len=SEQ_LEN, d_model=16, n_heads=4, n_layers=2)
MODELS = {
    "gpt": lambda: ms.GPT(**SIZES),
    "llama": lambda: ms.Llama(**SIZES, n_kv_heads=2, d_ff=24),
    "mixtral": lambda: ms.Llama(**SIZES, n_kv_heads=2, d_ff=24, n_experts=4, top_k=2,
                                capacity_factor=None),
}
# ChatML, as a model's chat_template.jinja carries it
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def write_model(directory, kind: str, seed: int = 1) -> str:
    """A tiny float64 Hugging Face directory of `kind` (MODELS), with a chat template."""
    model = MODELS[kind]()
    path = ms.hf.save(directory, model, model.init(seed=seed), dtype="float64")
    Path(path, "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(path)


def serving_pids(directory, ranks_only: bool = True) -> list:
    """The pids serving `directory`, in order: its ranks (`python -m mpi4py -m mpishard
    serve`), and with ranks_only=False the mpiexec that started them too (found in /proc:
    launch runs mpiexec in a session of its own)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        rank = "mpiexec" not in argv[0] and argv[1:5] == ["-m", "mpi4py", "-m", "mpishard"]
        if str(directory) in argv and "serve" in argv and (rank or not ranks_only):
            found.append(int(entry))
    return sorted(found)


def chat_prompt(messages) -> bytes:
    """The bytes CHAT_TEMPLATE renders `messages` to, with the generation prompt."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return (text + "<|im_start|>assistant\n").encode()


@lru_cache(maxsize=None)
def _engine(directory: str):
    model, params = ms.hf.load(directory)
    engine = ms.make_engine(model, "single", dtype=np.float64, report_errors=False)
    engine.load_checkpoint(params)
    return engine


def references(directory, prompts, max_tokens: int, temperature=0.0, seed=0) -> list:
    """The ids of each prompt (bytes) generated alone on "single": greedy by default, the
    exact answers; with a temperature and a seed, what a request with that seed draws."""
    engine = _engine(str(directory))
    return [engine.generate([list(p)], max_tokens, temperature=temperature, seed=seed)[0]
            for p in prompts]


def text_of(ids) -> str:
    """The text the bytes tokenizer gives for `ids` (an invalid UTF-8 byte: U+FFFD)."""
    return bytes(ids).decode("utf-8", errors="replace")


class ServeJob:
    """One `mpishard serve` job on `n` ranks (see the module docstring); `argv`: start this
    command line instead (a batch script that starts the job), with `args` ignored."""

    def __init__(self, n: int, args, timeout: float = 120.0, env=None, argv=None):
        self.before = leftovers.mpi_files()
        self.lines: list = []
        argv = argv or [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", "-m", "mpishard",
                        "serve", *map(str, args), "--port", "0"]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                                     start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_listening(timeout)
        self.host, self.port = re.match(r"http://(\S+):(\d+)", self.url).groups()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m for m in map(LISTENING.match, list(self.lines)) if m]
            if found:
                assert len(found) == 1, self.output
                return found[0].group(1)
            if self.proc.poll() is not None:
                self._reader.join(5)
                self._cleanup()
                raise AssertionError(f"serve exited {self.proc.returncode} before listening:\n"
                                     f"{self.output[-4000:]}")
            time.sleep(0.05)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"no listening line after {timeout} s:\n{self.output[-4000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, signum=signal.SIGTERM, timeout: float = 60.0):
        """(exit code, output) after `signum` to mpiexec (None: the caller signalled it
        already; a second SIGTERM would end a draining job at once); the job is killed past
        `timeout`."""
        if self.proc.poll() is None and signum is not None:
            self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            self.lines.append(f"(killed after {timeout} s)")
        finally:
            self._reader.join(5)
            self._cleanup()
        return self.proc.returncode, self.output

    def _cleanup(self):
        """Kill what is left of the job's session, then remove the MPI files it left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 3     # hydra's proxy may still be removing its own file
        while (left := leftovers.left_since(self.before)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for path in left:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self.left = left
