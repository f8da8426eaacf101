"""The decode loop every rank runs: one step of the running batch at a time, in lockstep.

    loop = ServeLoop(comm, stepper, replica=r, replicas=R, max_batch=B, max_len=T, eos=ids,
                     intake=intake if rank 0 else None, metrics=metrics if rank 0 else None)
    loop.run()                     # returns on every rank once a drain has ended

A step, on every rank:

    plan      rank 0 takes what changed since the last step from the Intake: requests that
              join (each given a replica, a free slot of it and a seed), rows cancelled (a
              client went away, a stop string matched), and whether to stop
    agree     broadcast_json(comm, plan): every rank applies the same changes, so the ranks
              of a replica hold the same rows in the same slots
    compute   each replica runs its own rows: the decode of every row that has a token to
              feed (one engine forward, a token per row at its own position), then the
              prefill of the rows still reading their prompt, in chunks of at most
              `prefill_tokens` tokens per step so that a long prompt does not stall the
              others' decode; each row draws its next token from its own generator
    report    rank 0 hands every new token to its request's ticket (replicas > 1: the replica
              leaders' tokens are gathered to rank 0 first)

A row ends at an eos id ("stop"), at max_tokens or the slot's max_len ("length"), or when
cancelled; its slot is free for a request that joins at the next step. Every rank of a
replica draws the same tokens: the logits are the same on each (Stepper.forward), the
generator of a row is seeded by the request's seed (rank 0 draws one when the request has
none) and one uniform is drawn per row and step, as engine.generate draws for a single
prompt, so a seeded request gets engine.generate's completion of its prompt alone whatever
else is in the batch.

Idle: with no row running and nothing waiting, rank 0 sleeps on the Intake for at most
`heartbeat` seconds and then broadcasts an empty plan. The other ranks wait in that
broadcast, bounded by the engine's watchdog (comm/objects.py): a rank that stalls, idle or
busy, ends the job with the watchdog's named-rank error instead of a silent hang, and an idle
server never trips it as long as heartbeat < the engine's timeout.

Drain (intake.drain(): SIGTERM, SIGINT or SIGUSR1 on rank 0): the Intake takes no new
request from then on; the ones it had accepted, running or waiting for a slot, go on for at
most `drain_timeout` seconds, then the rest end with "abort", and the loop returns on every
rank.
"""
from __future__ import annotations

import secrets
import time

import numpy as np

from ..comm.objects import broadcast_json, gather_json
from ..nn.sampling import sample

STEP = "serve step"


class Row:
    """A request on a replica's slot: its ids so far (prompt, then the tokens drawn), how many
    of them the cache holds, its sampling options and its own generator."""

    def __init__(self, join: dict):
        self.rid, self.replica, self.slot = join["rid"], join["replica"], join["slot"]
        self.ids = list(join["ids"])
        self.prompt = len(self.ids)
        self.fed = 0                                # ids the cache holds (positions 0..fed-1)
        self.max_tokens = int(join["max_tokens"])
        self.temperature = float(join["temperature"])
        self.top_k, self.top_p = int(join["top_k"]), float(join["top_p"])
        self.rng = np.random.default_rng(int(join["seed"]))

    @property
    def drawn(self) -> int:
        return len(self.ids) - self.prompt

    def draw(self, logits) -> int:
        """The next id from this row's logits (V,), one uniform of its generator."""
        return int(sample(logits[None], self.rng, self.temperature, self.top_k, self.top_p)[0])


class ServeLoop:
    """The step loop (module docstring). comm: the engine's Comm (its whole world takes part
    in the plan's broadcast); stepper: Stepper.forward(slots, starts, chunks) -> logits of
    this rank's replica; intake and metrics: rank 0's, None elsewhere."""

    def __init__(self, comm, stepper, *, replica: int, replicas: int, leader: bool,
                 max_batch: int, max_len: int, eos, intake=None, metrics=None,
                 prefill_tokens: int = 512, heartbeat: float = 1.0, drain_timeout: float = 30.0,
                 stopping=lambda: 0, clock=time.monotonic):
        self.comm, self.stepper = comm, stepper
        self.replica, self.replicas, self.leader = replica, replicas, leader
        self.max_batch, self.max_len, self.eos = max_batch, max_len, set(eos or ())
        self.intake, self.metrics = intake, metrics
        self.prefill_tokens, self.heartbeat = prefill_tokens, heartbeat
        self.drain_timeout, self.clock, self.stopping = drain_timeout, clock, stopping
        self.rows: dict = {}                     # rid -> Row of this rank's replica
        self.slots = [dict() for _ in range(replicas)]   # rank 0: replica -> {slot: rid}
        self.drain_since = None
        self.steps = 0
        self.lengths: dict = {}                  # rank 0: rid -> positions its row holds
        self.busy = {"steps": 0, "rows": 0, "kv": 0.0, "requests": 0}   # rank 0's summary
        if intake is not None:
            intake.free = max_batch * replicas

    # -- rank 0: what changes at this step ---------------------------------------------------------
    def _free(self, replica: int) -> list:
        used = self.slots[replica]
        return [s for s in range(self.max_batch) if s not in used]

    def plan(self) -> dict:
        """Rank 0: the step's joins, cancels and whether the loop stops."""
        intake = self.intake
        if self.stopping() and not intake.draining:     # a signal: set by a handler, which
            intake.drain()                              # must not take the Intake's lock
        running = sum(len(s) for s in self.slots)
        if not running and not intake.depth and not intake.draining:
            intake.wait(self.heartbeat)
        if intake.draining and self.drain_since is None:
            self.drain_since = self.clock()
        late = self.drain_since is not None and \
            self.clock() - self.drain_since > self.drain_timeout
        free = {r: self._free(r) for r in range(self.replicas)}
        tickets, cancels = intake.take(0 if late else sum(map(len, free.values())))
        joins = []
        for t in tickets:
            r = max(range(self.replicas), key=lambda k: (len(free[k]), -k))  # the emptiest
            slot = free[r].pop(0)
            self.slots[r][slot] = t.rid
            self.lengths[t.rid] = len(t.ids)
            self.busy["requests"] += 1
            seed = t.params.get("seed")
            joins.append({"rid": t.rid, "replica": r, "slot": slot, "ids": t.ids,
                          "seed": secrets.randbits(63) if seed is None else int(seed),
                          **{k: t.params[k] for k in ("max_tokens", "temperature", "top_k",
                                                      "top_p")}})
        left = [rid for used in self.slots for rid in used.values()]
        stop = self.drain_since is not None and (late or not (left or intake.depth))
        if late:
            cancels = sorted(set(cancels) | set(left))
        if stop:
            intake.abort_waiting()
        for rid in cancels:
            self._forget(rid, "abort")
        return {"joins": joins, "cancels": cancels, "stop": stop}

    def _forget(self, rid: int, finish) -> None:
        """Rank 0: the row's slot is free; its ticket gets `finish` (None: nothing more)."""
        self.lengths.pop(rid, None)
        for used in self.slots:
            for slot, held in list(used.items()):
                if held == rid:
                    del used[slot]
        if finish is not None:
            self.intake.deliver(rid, None, finish)

    # -- every rank ----------------------------------------------------------------------------
    def apply(self, plan: dict) -> None:
        for rid in plan["cancels"]:
            self.rows.pop(rid, None)
        for join in plan["joins"]:
            if join["replica"] == self.replica:
                self.rows[join["rid"]] = Row(join)

    def compute(self) -> list:
        """This replica's step: [(rid, token, finish or None)] for each token drawn."""
        events = []
        decode = [r for r in self.rows.values() if r.fed == len(r.ids) - 1 and r.drawn]
        if decode:
            logits = self.stepper.forward([r.slot for r in decode], [r.fed for r in decode],
                                          [[r.ids[-1]] for r in decode])
            for row, z in zip(decode, logits):
                row.fed += 1
                events.append(self._drew(row, z))
        budget, chunks = self.prefill_tokens, []
        for row in sorted(self.rows.values(), key=lambda r: r.rid):
            if row.fed < row.prompt and budget > 0:
                n = min(row.prompt - row.fed, budget)
                chunks.append((row, n))
                budget -= n
        if chunks:
            logits = self.stepper.forward([r.slot for r, _ in chunks], [r.fed for r, _ in chunks],
                                          [r.ids[r.fed:r.fed + n] for r, n in chunks])
            for (row, n), z in zip(chunks, logits):
                row.fed += n
                if row.fed == row.prompt:
                    events.append(self._drew(row, z))
        return events

    def _drew(self, row: Row, logits) -> tuple:
        token = row.draw(logits)
        row.ids.append(token)
        finish = ("stop" if token in self.eos else
                  "length" if row.drawn >= row.max_tokens or len(row.ids) >= self.max_len
                  else None)
        if finish is not None:
            del self.rows[row.rid]
        return row.rid, token, finish

    def report(self, events: list) -> None:
        """Rank 0's tickets get this step's tokens (from every replica's leader)."""
        if self.replicas > 1:
            gathered = gather_json(self.comm, events if self.leader else [], "serve tokens")
            if gathered is None:
                return
            events = [tuple(e) for part in gathered for e in part]
        if self.intake is None:
            return
        for rid, token, finish in events:
            if finish is not None:
                self._forget(rid, None)
            elif token is not None and rid in self.lengths:
                self.lengths[rid] += 1
            self.intake.deliver(rid, token, finish)

    def run(self) -> int:
        """Steps until a drain ends; returns the steps run."""
        while True:
            plan = broadcast_json(self.comm, self.plan() if self.intake is not None else None,
                                  STEP)
            if plan["stop"]:
                return self.steps
            self.apply(plan)
            events = self.compute()
            self.report(events)
            self.steps += 1
            if self.intake is not None:
                self._account()

    def _account(self) -> None:
        """Rank 0, after a step: the Intake's free slots, the metrics' gauges, the summary."""
        slots = self.max_batch * self.replicas
        running = sum(len(s) for s in self.slots)
        kv = sum(self.lengths.values()) / (slots * self.max_len)
        self.intake.free = slots - running
        if running:
            self.busy["steps"] += 1
            self.busy["rows"] += running
            self.busy["kv"] += kv
        if self.metrics is not None:
            self.metrics.set_queue(self.intake.depth)
            self.metrics.set_batch(running, slots)
            self.metrics.set_kv_usage(kv)

    def summary(self) -> str:
        """Rank 0: what the server did, in one line (logged when it stops)."""
        n = max(self.busy["steps"], 1)
        return (f"{self.busy['requests']} requests in {self.busy['steps']} busy steps of "
                f"{self.steps}: {self.busy['rows'] / n:.1f} rows of "
                f"{self.max_batch * self.replicas} slots per busy step, the KV cache "
                f"{100 * self.busy['kv'] / n:.0f}% used on average")


__all__ = ["Row", "ServeLoop"]
