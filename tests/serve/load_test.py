"""Load test of `mpishard serve`: many concurrent clients, every answer checked exactly.

    python tests/serve/load_test.py --clients 64 --requests 1000            # the full one
    python tests/serve/load_test.py --clients 8 --requests 60 --layout dp=2 --ranks 2
    python tests/serve/load_test.py --url http://127.0.0.1:8000 --hf DIR    # a running server

Without --url it writes a tiny float64 model (--kind: gpt, llama or mixtral; vocabulary 256,
bytes tokenizer) and starts `mpiexec -n RANKS ... mpishard serve` on it (serve_job.py).
`--clients` asyncio clients (httpx) share `--requests` requests drawn, seeded, from
`--prompts` distinct prompts of mixed lengths, each with its own max_tokens, every third one
streamed. A 429/503 is retried after its Retry-After (and counted). The check: every request
gets exactly one answer, no response id repeats, and every greedy answer equals its prompt's
answer alone (engine.generate on "single" in this process, computed once per distinct
prompt), streamed or not; usage counts the prompt's and the answer's tokens.
Prints a summary line (JSON) and exits 1 when any request was lost, duplicated or wrong.
"""
import argparse
import asyncio
import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_job import SEQ_LEN, ServeJob, references, text_of, write_model  # noqa: E402


def make_prompts(count: int, seed: int) -> list:
    """`count` distinct (prompt bytes, max_tokens): prompts of 1..40 characters, answers of
    1..24 tokens, within the model's SEQ_LEN."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < count:
        n = rng.randint(1, 40)
        prompt = "".join(rng.choice(string.ascii_letters + string.digits + " .,")
                         for _ in range(n)).encode()
        if prompt not in seen:
            seen.add(prompt)
            out.append((prompt, rng.randint(1, min(24, SEQ_LEN - n))))
    return out


async def one_request(client, url, model, prompt, n, stream) -> dict:
    """The answer as {"id", "text", "usage", "finish", "retries"}."""
    body = {"model": model, "prompt": prompt.decode(), "max_tokens": n, "temperature": 0,
            "stream": stream, "return_token_ids": True}
    retries = 0
    while True:
        if not stream:
            r = await client.post(f"{url}/v1/completions", json=body)
            if r.status_code in (429, 503):
                retries += 1
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            r.raise_for_status()
            got, choice = r.json(), r.json()["choices"][0]
            return {"id": got["id"], "text": choice["text"], "usage": got["usage"],
                    "finish": choice["finish_reason"], "retries": retries,
                    "token_ids": choice["token_ids"]}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code in (429, 503):
                retries += 1
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after", 1)))
                continue
            r.raise_for_status()
            chunks, done = [], False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
            assert done, "the stream ended without [DONE]"
            ids = {c["id"] for c in chunks}
            assert len(ids) == 1, ids
            return {"id": ids.pop(), "text": "".join(c["choices"][0]["text"] for c in chunks),
                    "usage": None, "finish": chunks[-1]["choices"][0]["finish_reason"],
                    "retries": retries,
                    "token_ids": [t for c in chunks for t in c["choices"][0]["token_ids"]]}


async def drive(url, model, plan, clients: int) -> tuple:
    """Run `plan` (a list of (index, prompt, n, stream)) over `clients` workers: ({index: [
    answers]}, {index: seconds})."""
    answers, seconds, queue = {}, {}, asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker():
            while not queue.empty():
                i, prompt, n, stream = queue.get_nowait()
                t0 = time.monotonic()
                try:
                    got = await one_request(client, url, model, prompt, n, stream)
                except (httpx.HTTPError, AssertionError) as e:     # a problem, not a crash
                    got = {"error": f"{type(e).__name__}: {e}"}
                answers.setdefault(i, []).append(got)
                seconds[i] = time.monotonic() - t0
        await asyncio.gather(*(worker() for _ in range(clients)))
    return answers, seconds


def check(plan, answers, want) -> list:
    """Every problem found: lost, duplicated, mixed up or wrong answers."""
    problems = []
    ids = [a["id"] for got in answers.values() for a in got if "id" in a]
    if len(ids) != len(set(ids)):
        problems.append(f"{len(ids) - len(set(ids))} response ids repeat")
    for i, prompt, n, stream in plan:
        got = answers.get(i, [])
        if len(got) != 1:
            problems.append(f"request {i}: {len(got)} answers")
            continue
        a = got[0]
        if "error" in a:
            problems.append(f"request {i} ({prompt!r}, {n}, stream={stream}): {a['error']}")
            continue
        if a["token_ids"] != want[prompt][:n] or a["text"] != text_of(want[prompt][:n]) \
                or a["finish"] != "length":
            problems.append(f"request {i} ({prompt!r}, {n}, stream={stream}): {a['text']!r} "
                            f"finish {a['finish']}, want {text_of(want[prompt][:n])!r}")
        if a["usage"] is not None and a["usage"]["completion_tokens"] != n or \
                a["usage"] is not None and a["usage"]["prompt_tokens"] != len(prompt):
            problems.append(f"request {i}: usage {a['usage']}")
    return problems


def run(clients: int, requests: int, prompts: int = 50, seed: int = 0, url=None, hf=None,
        kind="gpt", layout=None, ranks=1, max_batch=8) -> dict:
    """The summary of one load test (see the module docstring); "problems" lists failures."""
    distinct = make_prompts(prompts, seed)
    rng = random.Random(seed + 1)
    plan = [(i, *rng.choice(distinct), i % 3 == 2) for i in range(requests)]
    with tempfile.TemporaryDirectory() as tmp:
        directory = hf or write_model(Path(tmp) / kind, kind)
        want = dict(zip([p for p, _ in distinct],
                        references(directory, [p for p, _ in distinct],
                                   max(n for _, n in distinct))))
        job = None if url else ServeJob(ranks, ["--hf", directory, "--tokenizer", "bytes",
                                                "--dtype", "float64", "--max-batch", max_batch,
                                                *(["--layout", layout] if layout else [])])
        try:
            base = url or job.url
            model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
            t0 = time.monotonic()
            answers, seconds = asyncio.run(drive(base, model, plan, clients))
            wall = time.monotonic() - t0
        finally:
            rc, out = job.stop() if job else (0, "")
    lat = sorted(seconds.values())
    tokens = sum(n for _, _, n, _ in plan)
    problems = check(plan, answers, want)
    if rc != 0 or problems:
        problems.append(f"the server exited {rc}:\n{out[-3000:]}")
    return {"clients": clients, "requests": requests, "distinct_prompts": prompts,
            "layout": layout or "default", "ranks": ranks, "max_batch": max_batch,
            "seconds": round(wall, 2), "requests_per_s": round(requests / wall, 1),
            "tokens_per_s": round(tokens / wall, 1),
            "latency_p50_s": round(lat[len(lat) // 2], 3) if lat else None,
            "latency_p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3)
            if lat else None,
            "retried": sum(a.get("retries", 0) for got in answers.values() for a in got),
            "answered": sum(map(len, answers.values())), "problems": problems}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--prompts", type=int, default=50, help="distinct prompts (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running server (give its model directory as --hf)")
    p.add_argument("--hf", help="the model directory (default: a tiny one written here)")
    p.add_argument("--kind", default="gpt", choices=["gpt", "llama", "mixtral"])
    p.add_argument("--layout", help="serve's --layout (default: its own)")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=8)
    a = p.parse_args(argv)
    if a.url and not a.hf:
        p.error("--url needs --hf, the directory the server loaded (for the references)")
    summary = run(a.clients, a.requests, a.prompts, a.seed, a.url, a.hf, a.kind, a.layout,
                  a.ranks, a.max_batch)
    print(json.dumps({k: v for k, v in summary.items() if k != "problems"}))
    for line in summary["problems"][:20]:
        print("PROBLEM:", line)
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
