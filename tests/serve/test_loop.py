"""serve/loop.ServeLoop with serve/intake.Intake on one rank, no HTTP: requests submitted
from an asyncio thread while the loop runs (so they join a batch that is already decoding),
greedy and seeded-sampled completions equal engine.generate of each prompt alone (float64),
a full queue refuses, a cancel frees its slot, a drain lets running rows finish and then
aborts what is left, and a row ends at max_tokens ("length") or an eos id ("stop").

Serial: `pytest tests/serve/test_loop.py`.
"""
import asyncio
import threading

import pytest

import mpishard as ms
from mpishard.serve.batch_step import Stepper
from mpishard.serve.intake import Draining, Intake, QueueFull
from mpishard.serve.loop import ServeLoop

SEQ = 48
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 200, 100, 50, 9, 17], [250, 3, 3],
           [7, 70, 170, 255, 0, 1, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], [42]]


@pytest.fixture(scope="module")
def engine():
    model = ms.Llama(vocab_size=256, seq_len=SEQ, d_model=16, n_heads=4, n_layers=2,
                     n_kv_heads=2, d_ff=24)
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=5))
    return e


class Client:
    """An asyncio loop in a thread, standing in for the HTTP side."""

    def __init__(self, intake):
        self.intake, self.loop = intake, asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, ids, **params):
        async def go():
            return self.intake.submit(ids, {"max_tokens": 6, "temperature": 0.0, "top_k": 0,
                                            "top_p": 1.0, "seed": None, **params})
        return self.call(go())

    def collect(self, ticket):
        async def go():
            out = []
            while True:
                token, finish = await ticket.get()
                if token is not None:
                    out.append(token)
                if finish is not None:
                    return out, finish
        return asyncio.run_coroutine_threadsafe(go(), self.loop)


def serve(engine, intake, max_batch=2, **kw):
    loop = ServeLoop(engine.comm, Stepper(engine, max_batch, SEQ), replica=0, replicas=1,
                     leader=True, max_batch=max_batch, max_len=SEQ, eos=kw.pop("eos", ()),
                     intake=intake, heartbeat=0.05, **kw)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return loop, thread


def test_rows_joining_a_running_batch_get_their_alone_completions(engine):
    intake = Intake(max_queue=16)
    client = Client(intake)
    loop, thread = serve(engine, intake, max_batch=2, prefill_tokens=4)
    tickets, futures = [], []
    for i, p in enumerate(PROMPTS):
        params = {"max_tokens": 3 + i} if i % 2 else \
            {"max_tokens": 5, "temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 100 + i}
        tickets.append((p, params, client.submit(p, **params)))
        futures.append(client.collect(tickets[-1][2]))
        if i == 2:                      # the first rows are decoding by now
            futures[0].result(60)
    intake.drain()
    thread.join(60)
    assert not thread.is_alive()
    for (prompt, params, _), fut in zip(tickets, futures):
        got, finish = fut.result(5)
        want = engine.generate([prompt], params["max_tokens"],
                               temperature=params.get("temperature", 0.0),
                               top_k=params.get("top_k", 0), top_p=params.get("top_p", 1.0),
                               seed=params.get("seed", 0))[0]
        assert got == want and finish == "length", (prompt, params)
    assert loop.steps > 0 and not loop.rows and not any(loop.slots)


class GatedStepper:
    """A Stepper whose forwards after the first wait for a permit, so that the test, not the
    machine's speed, decides how far a row has decoded when it cancels or drains."""

    def __init__(self, stepper):
        self.stepper, self.calls = stepper, 0
        self.permits, self.started, self.opened = threading.Semaphore(0), threading.Event(), False

    def forward(self, *args):
        self.calls += 1
        if self.calls > 1 and not self.opened:
            assert self.permits.acquire(timeout=60), "the test gave no permit"
        out = self.stepper.forward(*args)
        self.started.set()
        return out

    def open(self):
        self.opened = True
        self.permits.release()


def test_queue_full_cancel_and_drain_abort(engine):
    intake = Intake(max_queue=2)
    client = Client(intake)
    first = client.submit(PROMPTS[0], max_tokens=43)        # holds the one slot
    second = client.submit(PROMPTS[1], max_tokens=2)        # waits
    with pytest.raises(QueueFull):
        client.submit(PROMPTS[2])
    f1, f2 = client.collect(first), client.collect(second)
    gate = GatedStepper(Stepper(engine, 1, SEQ))
    loop = ServeLoop(engine.comm, gate, replica=0, replicas=1, leader=True, max_batch=1,
                     max_len=SEQ, eos=(), intake=intake, heartbeat=0.05, drain_timeout=0.0)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    assert gate.started.wait(60)                            # the first row's prefill ran
    second.cancel()                                         # cancelled while waiting
    gate.permits.release()                  # one more step: its plan (or the next) sees it
    assert f2.result(30) == ([], "abort")
    assert not f1.done() and gate.calls <= 3
    intake.drain()
    with pytest.raises(Draining):
        client.submit(PROMPTS[3])
    gate.open()
    thread.join(60)
    assert not thread.is_alive()
    got, finish = f1.result(5)
    assert finish == "abort" and len(got) <= 4    # the drain deadline (0 s) cut it
    assert got == engine.generate([PROMPTS[0]], len(got), temperature=0.0)[0]


def test_eos_ends_a_row_with_stop(engine):
    want = engine.generate([PROMPTS[3]], 8, temperature=0.0)[0]
    eos = want[2]
    cut = want[:want.index(eos) + 1]
    intake = Intake(max_queue=4)
    client = Client(intake)
    loop, thread = serve(engine, intake, eos=[eos])
    got = client.collect(client.submit(PROMPTS[3], max_tokens=8)).result(60)
    intake.drain()
    thread.join(60)
    assert got == (cut, "stop")


def test_the_queue_counts_requests_beyond_the_free_slots(engine):
    """--max-queue 1 with 3 slots free: 4 requests are taken (3 go in at the next step, one
    waits), the 5th is refused; with no slot free only one may wait."""
    intake = Intake(max_queue=1)
    client = Client(intake)
    intake.free = 3
    for p in PROMPTS[:4]:
        client.submit(p)
    with pytest.raises(QueueFull):
        client.submit(PROMPTS[4])
    intake.free = 0
    intake.take(3)
    with pytest.raises(QueueFull):
        client.submit(PROMPTS[4])
