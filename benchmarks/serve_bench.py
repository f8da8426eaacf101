"""Serving throughput and time to first token: continuous batching (`mpishard serve`) against
static batching through our own engine.generate and through transformers' generate, on one
model and one request list, in one run.

    python benchmarks/serve_bench.py                      # the default: a few minutes
    python benchmarks/serve_bench.py --clients 1,8,32 --requests 16,32,64 --json out.json
    python benchmarks/serve_bench.py --systems static,hf  # no server

Model: a GPT-2-shaped decoder (GPT2LMHeadModel: vocabulary 50257, 1024 positions, tied head)
made small for a 2-core machine: d_model 256, 4 heads of 64, 4 layers, float32. The
vocabulary is GPT-2's own, so the head (50257 x 256, most of the FLOPs of a decode step) weighs
what it weighs in the real model; the 4 narrow layers keep a run of a few hundred decode steps
at batch 32 within minutes. transformers builds it (seeded, no eos) and save_pretrained writes
it, with a word-level tokenizer of 50257 words `w0 .. w50256` (text "w5 w17" is ids [5, 17],
so every system sees exactly the same ids); ours reads that directory (ms.hf.load_into), and so
does the server (--hf).

Requests: --requests[i] per level, the first of one seeded list: prompt lengths uniform in
--prompt-len (16-256), outputs uniform in --output-len (16-128), prompt ids uniform over the
vocabulary. Greedy (temperature 0) and no eos, so every request gets exactly its output length
from every system (checked: the continuous completions' words are counted, and compared with
static's ids).

Clients are closed-loop: C clients each send a request, and send the next one from the list
the moment they hold the last token of the previous one.
    continuous  the server on 127.0.0.1 (port 0, --max-batch 32, --max-model-len 384, one
                rank), started by this script; C asyncio clients POST /v1/completions with
                stream: true over httpx; time to first token is the first streamed text.
    static      engine.generate on the same weights in this process: a batch starts when the
                previous one has ended and takes the requests waiting (at most C), generating
                the batch's longest output for every row. A client holds its answer at its own
                last token (on_token), so its next request waits for the batch to end: that
                wait is part of its time to first token.
    hf          transformers' generate (left-padded, attention mask, greedy), batched the same
                static way; token times from a streamer.
tokens/s counts each request's own output tokens over the level's wall time. --rounds R runs
every level R times (round by round, the levels in order, the systems' order alternating from
level to level and round to round): tokens/s is the median of the rounds (their range in
brackets), the TTFT percentiles are over every round's requests, and the ratio continuous /
static at the largest level is the median of the rounds' ratios, each taken within one round,
the two runs back to back. One BLAS / torch thread
everywhere (OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 for the server; torch.set_num_threads(1)).

Measured on the shared 2-core machine: benchmarks/results.md, "Serving" (continuous 1.18x
static at 32 clients; this request mix bounds the gain of batching alone at 1.88x).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel

import mpishard as ms
from _common import write_json
from mpishard.engine import make_engine

SYSTEMS = ("continuous", "static", "hf")
LISTENING = "mpishard serve: listening on "


def make_model(path, vocab, d_model, heads, layers, seed):
    """Write the GPT-2-shaped model and its word-level tokenizer to `path`; returns the torch
    model (eval, float32)."""
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=d_model, n_layer=layers,
                     n_head=heads, bos_token_id=None, eos_token_id=None)
    net = GPT2LMHeadModel(cfg).eval()
    net.generation_config.eos_token_id = net.generation_config.bos_token_id = None
    net.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    return net


def make_requests(n, vocab, prompt_len, output_len, seed):
    """n (prompt ids, output length) pairs, lengths uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    return [([int(t) for t in rng.integers(0, vocab, int(rng.integers(prompt_len[0],
                                                                       prompt_len[1] + 1)))],
             int(rng.integers(output_len[0], output_len[1] + 1))) for _ in range(n)]


def summary(ttft, tokens, wall, outputs):
    """One system's run at one level: its times to first token (s), tokens, wall time (s)
    and outputs."""
    return dict(ttft=list(ttft), tokens=int(tokens), wall=wall, outputs=outputs)


def figures(runs, base):
    """One system at one level over the rounds: tokens/s (median, min, max of the rounds),
    TTFT percentiles over every round's requests, and how many outputs equal `base`'s (the
    static runs of the same rounds)."""
    rates = [r["tokens"] / r["wall"] for r in runs]
    ttft = np.concatenate([r["ttft"] for r in runs]) * 1e3
    same = sum(agreement(r["outputs"], b["outputs"]) for r, b in zip(runs, base)) \
        if base else None
    return dict(tokens_per_s=round(float(np.median(rates)), 1),
                tokens_per_s_range=[round(min(rates), 1), round(max(rates), 1)],
                ttft_p50_ms=round(float(np.percentile(ttft, 50)), 1),
                ttft_p99_ms=round(float(np.percentile(ttft, 99)), 1),
                wall_s=[round(r["wall"], 2) for r in runs], same_as_static=same,
                compared=sum(len(r["outputs"]) for r in runs))


def run_static(generate, reqs, clients):
    """Closed-loop clients over a static batcher. generate(prompts, n_new) -> (ids per row,
    the time each step's tokens were ready)."""
    t0 = time.perf_counter()
    arrivals, ttft, outputs, tokens = [t0] * clients, [], [], 0
    for b in range(0, len(reqs), clients):
        batch = reqs[b:b + clients]
        ids, stamps = generate([p for p, _ in batch], max(n for _, n in batch))
        finished = []
        for (_, n), row, arrived in zip(batch, ids, arrivals):
            ttft.append(stamps[0] - arrived)
            finished.append(stamps[n - 1])
            outputs.append(row[:n])
            tokens += n
        arrivals = sorted(finished)         # the next batch's requests, first come first
    return summary(ttft, tokens, time.perf_counter() - t0, outputs)


def ours_generate(engine):
    def generate(prompts, n_new):
        stamps = []
        ids = engine.generate(prompts, n_new, temperature=0, on_token=lambda row, _: (
            stamps.append(time.perf_counter()) if row == 0 else None))
        return ids, stamps
    return generate


class Stamps:
    """A transformers streamer that keeps the time of each step's tokens (the first put is the
    prompt)."""

    def __init__(self):
        self.times, self.calls = [], 0

    def put(self, value):
        if self.calls:
            self.times.append(time.perf_counter())
        self.calls += 1

    def end(self):
        pass


def hf_generate(net):
    def generate(prompts, n_new):
        width = max(map(len, prompts))
        x = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for i, p in enumerate(prompts):
            x[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        stamps = Stamps()
        with torch.no_grad():
            out = net.generate(x, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                               pad_token_id=0, streamer=stamps)
        return out[:, width:].tolist(), stamps.times
    return generate


def start_server(path, max_batch, max_len):
    """`python -m mpishard serve` on 127.0.0.1, port 0: (process, base url)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "mpishard", "serve", "--hf", path,
                             "--port", "0", "--max-batch", str(max_batch), "--max-model-len",
                             str(max_len), "--max-queue", "256", "--dtype", "float32"],
                            stdout=subprocess.PIPE, env=env, text=True)
    for line in proc.stdout:
        if line.startswith(LISTENING):
            return proc, line[len(LISTENING):].strip()
    raise RuntimeError(f"the server exited with {proc.wait()} before listening")


async def stream_one(client, url, name, prompt, n):
    """(seconds to the first text, the completion's words) of one streamed request."""
    t0, first, text = time.perf_counter(), None, []
    body = {"model": name, "prompt": " ".join(f"w{t}" for t in prompt), "max_tokens": n,
            "temperature": 0, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text", "")
            if piece and first is None:
                first = time.perf_counter() - t0
            text.append(piece)
    return first, "".join(text).split()


def run_continuous(url, name, reqs, clients):
    async def main():
        queue, ttft, outputs = list(enumerate(reqs))[::-1], [], [None] * len(reqs)
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            async def worker():
                while queue:
                    i, (prompt, n) = queue.pop()
                    first, words = await stream_one(client, url, name, prompt, n)
                    ttft.append(first)
                    outputs[i] = [int(w[1:]) for w in words]
            t0 = time.perf_counter()
            await asyncio.gather(*[worker() for _ in range(clients)])
            return summary(ttft, sum(map(len, outputs)), time.perf_counter() - t0, outputs)
    return asyncio.run(main())


def agreement(a, b):
    """Requests whose outputs are the same ids (float32 batches may break a near-tie)."""
    return sum(x == y for x, y in zip(a, b))


def table(res):
    """The results as markdown."""
    lines = ["| clients | requests | system | tokens/s (rounds' range) | TTFT p50 ms | "
             "TTFT p99 ms | same ids as static |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for level in res["levels"]:
        for s in SYSTEMS:
            if s in level:
                r = level[s]
                lo, hi = r["tokens_per_s_range"]
                lines.append(f"| {level['clients']} | {level['requests']} | {s} | "
                             f"{r['tokens_per_s']} ({lo}-{hi}) | {r['ttft_p50_ms']} | "
                             f"{r['ttft_p99_ms']} | {r['same_as_static']}/{r['compared']} |")
    return "\n".join(lines)


def run(args):
    clients = [int(c) for c in args.clients.split(",")]
    counts = [int(c) for c in args.requests.split(",")]
    if len(counts) != len(clients):
        raise SystemExit("--requests needs one count per --clients level")
    systems = args.systems.split(",")
    torch.set_num_threads(1)
    reqs = make_requests(max(counts), args.vocab, args.prompt_len, args.output_len, args.seed)
    tmp = tempfile.TemporaryDirectory(prefix="mpishard-serve-bench-")
    path = os.path.join(tmp.name, "gpt2-small-ish")
    net = make_model(path, args.vocab, args.d_model, args.heads, args.layers, args.seed)
    engine = make_engine(ms.hf.read_model(path), "single", dtype=np.float32)
    ms.hf.load_into(engine, path)
    runners = {"static": lambda rq, c: run_static(ours_generate(engine), rq, c),
               "hf": lambda rq, c: run_static(hf_generate(net), rq, c)}
    proc = None
    if "continuous" in systems:
        proc, url = start_server(path, max(clients), args.prompt_len[1] + args.output_len[1])
        runners["continuous"] = lambda rq, c: run_continuous(url, "gpt2-small-ish", rq, c)
    res = dict(model=dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                          layers=args.layers, dtype="float32"), levels=[],
               load_before=os.getloadavg()[0])
    runs = {(c, s): [] for c in clients for s in systems}
    try:
        warm = [(reqs[0][0][:16], 4)] * 2
        for s in systems:
            runners[s](warm, 2)
        for rnd in range(args.rounds):
            for k, (c, n) in enumerate(zip(clients, counts)):
                for s in (systems if (k + rnd) % 2 == 0 else systems[::-1]):
                    runs[c, s].append(runners[s](reqs[:n], c))
                    print(f"round {rnd}, {c} clients, {s}: "
                          f"{runs[c, s][-1]['tokens'] / runs[c, s][-1]['wall']:.1f} tokens/s",
                          flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            res["server_exit"] = proc.wait(timeout=60)
        tmp.cleanup()
    res["load_after"] = os.getloadavg()[0]
    for c, n in zip(clients, counts):
        base = runs.get((c, "static"))
        res["levels"].append(dict(clients=c, requests=n, **{
            s: figures(runs[c, s], base) for s in systems}))
    top = clients[-1]
    if "continuous" in systems and "static" in systems:
        ratios = [a["tokens"] / a["wall"] / (b["tokens"] / b["wall"])
                  for a, b in zip(runs[top, "continuous"], runs[top, "static"])]
        res["continuous_over_static"] = round(float(np.median(ratios)), 3)
        res["continuous_over_static_rounds"] = [round(x, 3) for x in ratios]
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="1,8,32", help="concurrency levels")
    p.add_argument("--requests", default="16,32,64", help="requests per level")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256])
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 128])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="repeat every level and system")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    res = run(args)
    print(table(res))
    if "continuous_over_static" in res:
        print(f"continuous / static tokens/s at {res['levels'][-1]['clients']} clients: "
              f"{res['continuous_over_static']} (rounds: {res['continuous_over_static_rounds']}; "
              f"target >= 2)")
    print(f"load average {res['load_before']:.2f} before, {res['load_after']:.2f} after")
    write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
