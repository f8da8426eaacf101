"""`python -m mpi4py -m mpishard bench`: time training steps of one layout on synthetic data.

    mpiexec -n 4 python -m mpi4py -m mpishard bench --layout dp=2,tp=2 --model 784,512,256,10 \\
        --batch 64 --steps 20 --warmup 3
    mpiexec -n 2 python -m mpi4py -m mpishard bench --layout tp=2 --model gpt \\
        --gpt d_model=128,n_heads=4,n_layers=4,seq_len=64 --batch 8

Every rank builds the engine (inside `agreed`, so bad input gives one error line and exit
code 2 everywhere), loads `model.init(seed)`, draws a seeded synthetic regression batch (the
global batch on every rank, then `engine.shard_batch`), and runs `--warmup` untimed and
`--steps` timed steps of `engine.train_step(x, t, loss)` + `optimizer.step()` (an MLP: MSE on
a regression batch; a GPT, `--model gpt:...` or `--model gpt --gpt ...`: cross-entropy on random
tokens, a batch row being one sequence of seq_len tokens). Rank 0 prints:

  step time      the median over the timed steps of the slowest rank's step time
                 (each step's time is combined with all_reduce(op='max'))
  samples/s      global batch / that median
  GFLOP/s        model FLOPs per step / median, with 2 FLOPs per multiply-add and
                   forward  F = 2 B sum_i d_in_i d_out_i
                   backward 2F - 2 B d_0 d_1  (dW and dx per layer; the first layer has no dx)
                 so 3F - 2 B d_0 d_1 per step (biases, activations, loss and optimizer left
                 out; work repeated on several ranks, like tp's replicated last layer, counted
                 once); a GPT: 3 x its forward's matmul FLOPs (models/gpt/costs.gpt_flops)
  comm time      the fraction of step time inside the engine's collectives (engine.comm_time:
                 blocking calls for their whole duration, non-blocking ones for the issue only;
                 pipeline receives are waits, shown as 'pipeline idle' instead), max over ranks
  comm bytes     bytes sent per step per kind (engine.comm_bytes / steps), max over ranks,
                 next to the prediction of cli/plan.py's step_comm (max over ranks);
                 'total' is the busiest rank's sum (not the sum of the rows above it). The
                 prediction is --dtype's throughout. --param-dtype and --comm-dtype
                 bfloat16/float16 (as `train` takes them) send 16-bit gathers and gradients,
                 half the bytes, the gradients by all_to_all to be summed in float32: the
                 header then says the plan column does not model them
"""
from __future__ import annotations

import time

import numpy as np

from ..nn.losses import get_loss
from ..engine import make_engine
from ..train.optim import SGD, AdamW
from .auto_layout import add_auto_arguments, agree_choice, agree_memory_limit, chosen
from .model_flag import add_model_arguments, model_from_flag
from .plan import COMM_KINDS, check_fit, step_comm_total
from .device_options import (add_device_arguments, add_precision_arguments,
                             check_precision_flags, compute_text, engine_options)
from .usage import (agreed, check_flags, checked_layout, default_layout, print_report,
                    world_comm)


def add_bench_arguments(p):
    p.add_argument("--layout", help="mesh layout, e.g. dp=2,tp=2, or auto: the plan's best "
                   "that fits in --max-memory (default: dp over all ranks, single on one)")
    add_auto_arguments(p.add_argument)          # --max-memory, --calibration
    add_model_arguments(p)
    p.add_argument("--activation", default="relu", help="hidden activation (relu)")
    p.add_argument("--batch", type=int, default=64, help="global batch per step (64)")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    add_precision_arguments(p.add_argument)          # --param-dtype, --comm-dtype
    add_device_arguments(p.add_argument)
    p.add_argument("--steps", type=int, default=10, help="timed steps (10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (2)")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "sgd"))
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (1e-3)")
    p.add_argument("--seed", type=int, default=0, help="weights and data (0)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="record the run (warm-up and timed steps) into DIR/trace.json: open it "
                        "at ui.perfetto.dev, summarise it with `trace-summary DIR`")
    return p


def build_bench(args, comm):
    """Validate and build (engine, optimizer, x_local, t_local); ValueError/TypeError before
    any collective on bad input."""
    check_flags(args, ("batch", "steps", "lr"), low=0, low_open=True)
    check_flags(args, ("warmup", "seed"), low=0)
    check_precision_flags(args.param_dtype, args.comm_dtype, args.dtype)
    options = engine_options(args, args.dtype)
    world = comm.Get_size()
    model = model_from_flag(args.model, args.activation, gpt=args.gpt)
    text = chosen(args, model, world, "train", args.batch, args.optimizer)   # --layout auto
    layout = checked_layout(text or default_layout(world), world)
    check_fit(model, layout, args.batch)      # tp divides the hidden sizes, batch fits, ...
    engine = make_engine(model, layout, dtype=np.dtype(args.dtype), comm=comm,
                         param_dtype=args.param_dtype, comm_dtype=args.comm_dtype, **options)
    engine.load_checkpoint(model.init(seed=args.seed))
    opt = (AdamW(engine, lr=args.lr) if args.optimizer == "adamw"
           else SGD(engine, lr=args.lr))
    rng = np.random.default_rng(args.seed)
    if model.takes_tokens:
        x, t = rng.integers(0, model.vocab_size, (2, args.batch, model.seq_len))
    else:
        x = rng.standard_normal((args.batch, model.d_in))
        t = rng.standard_normal((args.batch, model.d_out))
    return engine, opt, engine.shard_batch(x), engine.shard_batch(t)


def measure(engine, opt, x, t, steps: int, warmup: int) -> dict:
    """Collective: warm-up, then `steps` timed steps; numbers combined over ranks (max)."""
    loss = get_loss(engine.model.default_loss)
    sync = (engine.xp.cuda.get_current_stream().synchronize if engine.backend.is_gpu
            else (lambda: None))

    def step():
        value, grads = engine.train_step(x, t, loss)
        opt.step(grads)
        sync()
        return value

    for _ in range(warmup):
        step()
    engine.barrier()
    engine.reset_comm_stats()
    times, idle = [], 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        value = step()
        times.append(time.perf_counter() - t0)
        idle += engine.stats.get("idle_s", 0.0)
    total = sum(times)
    local = [engine.comm_bytes.get(k, 0) / steps for k in COMM_KINDS]
    local += [sum(local), sum(engine.comm_time.values()) / total, idle / total]
    host = engine.backend.to_host
    # max over ranks (these two all_reduces come after the counters were read)
    step_max = host(engine.all_reduce(np.array(times), op="max"))
    combined = host(engine.all_reduce(np.array(local, dtype=np.float64), op="max"))
    n = len(COMM_KINDS)
    return {"median_s": float(np.median(step_max)), "loss": value,
            "bytes": dict(zip(COMM_KINDS, combined[:n].tolist())), "total": float(combined[n]),
            "comm_fraction": float(combined[n + 1]), "idle_fraction": float(combined[n + 2])}


def _num(v: float) -> str:
    return f"{int(v)}" if float(v).is_integer() else f"{v:.1f}"


def format_table(engine, args, result) -> str:
    model, layout = engine.model, engine.layout
    world = engine.num_devices
    itemsize = engine.dtype.itemsize
    per_rank = [step_comm_total(model, layout, r, args.batch, itemsize) for r in range(world)]
    plan = {k: max(c.get(k, 0) for c in per_rank) for k in COMM_KINDS}
    med = result["median_s"]
    flops = model.step_flops(args.batch)
    rows = [("step time (median)", f"{med * 1e3:.3f} ms", ""),
            ("samples/s", f"{args.batch / med:,.0f}", ""),
            ("GFLOP/s (model)", f"{flops / med / 1e9:.3f}", ""),
            ("comm time fraction", f"{100 * result['comm_fraction']:.1f} %", "")]
    if layout.size("pp") > 1:
        rows.append(("pipeline idle fraction", f"{100 * result['idle_fraction']:.1f} %", ""))
    for k in COMM_KINDS:
        if result["bytes"][k] or plan[k]:
            rows.append((f"comm bytes/step {k}", _num(result["bytes"][k]), _num(plan[k])))
    rows.append(("comm bytes/step total", _num(result["total"]),
                 _num(max(sum(c.values()) for c in per_rank))))
    head = [f"bench  {model!r}: {model.num_params():,} parameters, layout {layout.text!r} on "
            f"{world} rank(s), batch {args.batch}, {engine.dtype.name}"
            f"{compute_text(engine.precision)}, {args.optimizer}, {engine.backend.name}",
            f"       {args.steps} timed steps after {args.warmup} warm-up (train_step + "
            f"optimizer step); max over ranks; {flops:,} FLOP per step",
            f"{'metric':<30}{'measured':>16}{'plan':>16}"]
    narrow = [f"{flag} {v}" for flag, v in (("--param-dtype", args.param_dtype),
                                            ("--comm-dtype", args.comm_dtype))
              if v not in (None, args.dtype)]
    if narrow:                       # the plan's bytes are at one width (costs/rank_costs.py)
        head.insert(2, f"       plan: {engine.dtype.name} throughout ({', '.join(narrow)} not "
                    "modelled: 16-bit gathers and gradients send half the bytes, and 16-bit "
                    "gradients go by all_to_all to be summed in float32)")
    return "\n".join(head + [f"{a:<30}{b:>16}{c:>16}" for a, b, c in rows])


def run_bench(args) -> int:
    comm = world_comm()
    agree_memory_limit(args, comm)
    engine, opt, x, t = agreed(comm, lambda: build_bench(args, comm))
    agree_choice(args, comm, engine.layout.text)
    if args.trace is None:
        result = measure(engine, opt, x, t, args.steps, args.warmup)
    else:
        with engine.trace(args.trace) as trace:
            result = measure(engine, opt, x, t, args.steps, args.warmup)
    text = format_table(engine, args, result)
    text = f"{args.layout_line}\n{text}" if getattr(args, "layout_line", None) else text
    return print_report(text + (f"\ntrace: {trace.path}" if args.trace else ""))
