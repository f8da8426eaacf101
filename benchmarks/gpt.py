"""GPT single-rank train step: MFU against plain matmul, and the ratio to PyTorch CPU eager.

    OMP_NUM_THREADS=1 python benchmarks/gpt.py                 # the issue's size, ~1-2 min
    OMP_NUM_THREADS=1 python benchmarks/gpt.py --quick         # fewer samples
    python benchmarks/gpt.py --tiny --json out.json            # toy size (the smoke test)
    python benchmarks/gpt.py --profile                         # cProfile of our step

The model is the issue's: ms.GPT(vocab 256, seq_len 64, d_model 128, n_heads 4, n_layers 4),
batch 32, float32, one BLAS thread, one rank (engine "single" on COMM_SELF, with
make_engine(host_heap="keep") as the `train` command runs it: without it glibc hands the
step's activations back to the kernel and the next step page-faults them in again, which on
some hosts costs a fifth of the step; `--host-heap none` measures the library's default).

Model FLOPs of one train step (forward + cross-entropy + backward), with N = B T tokens,
P = the parameters that enter matmuls (per block qkv D 3D + proj D D + fc D F + proj F D,
plus the head D V; embeddings and LayerNorms are not matmuls), L blocks:

    flops = 6 N P  +  3 * L * 2 * (2 B T^2 D)

6 N P: each weight does a forward GEMM (2 N k n) and two backward GEMMs (dW and dx).
Attention per block: q k^T and p v are each 2 B T^2 D in the forward (the full T x T,
as both sides compute it; the causal half is not discounted); the backward costs twice the
forward (dq, dk, dv, dp). Recomputing the scores in the backward is not counted (not model
FLOPs). This is PaLM's 6 N + 12 L T D per token.

(a) `mfu_fraction` = (flops / t_step) / (flops / t_matmul) = t_matmul / t_step, where
t_matmul is the time of exactly those GEMMs as plain `a @ b` (batched for attention: (B H,
T, Dh) @ (B H, Dh, T) etc.) on contiguous float32 arrays of the same shapes, alternated
sample by sample with the step so both see the same load. Target >= 0.5.

(b) `vs_torch_ratio` = our step time / torch's for the same model written from DESIGN.md's
contract (nn.Linear, nn.LayerNorm, gelu tanh, causal softmax attention, CrossEntropyLoss),
the same weights (ours copied in), the same batch, float32, torch.set_num_threads(1). Timed:
torch `zero_grad(); loss = ce(model(x), t); loss.backward()` against our
`engine.train_step(x, t, CrossEntropy())` (which zeroes its gradients too); and separately
both with the AdamW step added (`vs_torch_ratio_adamw`). Torch's attention is nanoGPT's
`F.scaled_dot_product_attention(is_causal=True)` (the headline); `--torch-attention manual`
(also measured, `vs_torch_ratio_manual_attention`) writes it out as matmul, mask, softmax.
Before timing, the two models' loss and every gradient on the same batch are compared
(`loss_rel_diff`, `max_grad_rel_diff`: max |ours - torch| / max |torch| per parameter), and
the losses of 3 AdamW steps (`adamw_loss_rel_diff`), which also cross-checks the contract.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.health.heap import keep_host_heap
from _common import sample_times, write_json

SIZES = {  # vocab, seq_len, d_model, n_heads, n_layers, batch
    "full": dict(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4, batch=32),
    "tiny": dict(vocab_size=32, seq_len=16, d_model=32, n_heads=4, n_layers=2, batch=4),
}


def problem(size, seed=0):
    cfg = dict(size)
    batch = cfg.pop("batch")
    model = ms.GPT(**cfg)
    rng = np.random.default_rng(seed + 1)
    x = rng.integers(0, model.vocab_size, (batch, model.seq_len))
    t = rng.integers(0, model.vocab_size, (batch, model.seq_len))
    return model, model.init(seed=seed), x, t


def model_flops(model, batch) -> float:
    d, f, v, t, n_layers = model.d_model, model.d_ff, model.vocab_size, model.seq_len, \
        model.n_layers
    p_mm = n_layers * (3 * d * d + d * d + d * f + f * d) + d * v
    return 6.0 * batch * t * p_mm + 3 * n_layers * 2 * (2.0 * batch * t * t * d)


def gemm_shapes(model, batch) -> list:
    """(batch count, m, k, n) of every GEMM in a train step, matching model_flops."""
    d, f, v, t, h = model.d_model, model.d_ff, model.vocab_size, model.seq_len, model.n_heads
    n, dh = batch * t, d // h
    shapes = []
    linears = [(d, 3 * d), (d, d), (d, f), (f, d)] * model.n_layers + [(d, v)]
    for k, o in linears:
        shapes += [(1, n, k, o), (1, k, n, o), (1, n, o, k)]       # x W, x^T dy, dy W^T
    for _ in range(model.n_layers):
        bh = batch * h
        shapes += [(bh, t, dh, t), (bh, t, t, dh),                  # q k^T, p v
                   (bh, t, t, dh), (bh, t, dh, t),                  # dv = p^T do, dp = do v^T
                   (bh, t, t, dh), (bh, t, t, dh)]                  # dq = ds k, dk = ds^T q
    return shapes


def matmul_closure(shapes, seed=0):
    rng = np.random.default_rng(seed)
    ops = [(rng.standard_normal((bc, m, k)).astype(np.float32),
            rng.standard_normal((bc, k, n)).astype(np.float32)) for bc, m, k, n in shapes]
    ops = [(a[0], b[0]) if a.shape[0] == 1 else (a, b) for a, b in ops]

    def run():
        for a, b in ops:
            a @ b
    return run


# -- ours ----------------------------------------------------------------------------------------
def our_engine(model, params, host_heap="keep"):
    """Our single-rank engine; host_heap "keep" (as the train command runs it) or None (the
    library's default). glibc's mallopt is process-wide: torch's allocations are kept too."""
    engine = ms.make_engine(model, "single", dtype=np.float32, comm=MPI.COMM_SELF,
                            host_heap=host_heap)
    engine.load_checkpoint(params)
    return engine


# -- torch, written from DESIGN.md's contract ----------------------------------------------------
def qkv_blocked(a, groups: int):
    """Our q | k | v columns (last axis 3D) reordered as [q_0 | k_0 | v_0 | q_1 | ...], one
    block per group of H/groups heads: a column split into `groups` equal parts (torch's
    ColwiseParallel under tp=groups) then gives rank r the q, k, v of its own heads, as our
    tp does (models/gpt/tensor_parallel's blocked Shard). groups=1 leaves `a` as it is."""
    *lead, three_d = a.shape
    blocks = a.reshape(*lead, 3, groups, three_d // (3 * groups))
    return np.ascontiguousarray(np.swapaxes(blocks, -3, -2).reshape(a.shape))


def qkv_unblocked(a, groups: int):
    """qkv_blocked's inverse: [q_0 | k_0 | v_0 | q_1 | ...] back to q | k | v (last axis)."""
    *lead, three_d = a.shape
    blocks = a.reshape(*lead, groups, 3, three_d // (3 * groups))
    return np.ascontiguousarray(np.swapaxes(blocks, -3, -2).reshape(a.shape))


def torch_gpt(torch, model, params, attention="sdpa", qkv_groups=1):
    """The torch model with our weights copied in; `qkv_groups` > 1 stores qkv blocked per
    head group (qkv_blocked) so that a tp=qkv_groups column split keeps whole heads. The
    attention reads the local width and head count from its input, so the same module runs
    whole or under torch's tensor parallel plans."""
    nnt, F = torch.nn, torch.nn.functional
    D, H = model.d_model, model.n_heads
    dh = D // H

    class Block(nnt.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nnt.LayerNorm(D), nnt.LayerNorm(D)
            self.qkv, self.proj = nnt.Linear(D, 3 * D), nnt.Linear(D, D)
            self.fc, self.mlp_proj = nnt.Linear(D, model.d_ff), nnt.Linear(model.d_ff, D)

        def attn(self, x):
            b, t, _ = x.shape
            qkv = self.qkv(x)                # (b, t, 3 d): d = D, or D / tp under tp
            d = qkv.shape[-1] // 3
            q, k, v = (z.view(b, t, d // dh, dh).transpose(1, 2) for z in qkv.split(d, dim=2))
            if attention == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-2, -1)) * (1.0 / dh ** 0.5)
                mask = torch.ones(t, t, dtype=torch.bool).tril()
                o = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
            return self.proj(o.transpose(1, 2).reshape(b, t, d))

        def forward(self, h):
            h = h + self.attn(self.ln_1(h))
            return h + self.mlp_proj(F.gelu(self.fc(self.ln_2(h)), approximate="tanh"))

    class GPT(nnt.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nnt.Embedding(model.vocab_size, D)
            self.positions = nnt.Embedding(model.seq_len, D)
            self.blocks = nnt.ModuleList(Block() for _ in range(model.n_layers))
            self.ln_f = nnt.LayerNorm(D)
            self.head = nnt.Linear(D, model.vocab_size, bias=False)

        def forward(self, ids):
            h = self.tokens(ids) + self.positions.weight[:ids.shape[1]]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln_f(h))

    net = GPT()
    ours = dict(net.named_parameters())
    mapping = torch_names(model)
    with torch.no_grad():
        for name, (tname, transpose) in mapping.items():
            a = params[name]
            if qkv_groups > 1 and "/attn/qkv/" in name:
                a = qkv_blocked(a, qkv_groups)
            a = a.T if transpose else a
            ours[tname].copy_(torch.from_numpy(np.ascontiguousarray(a)))
    return net.float(), mapping


def torch_names(model) -> dict:
    """Our parameter name -> (torch's name, transposed?): nn.Linear stores (out, in)."""
    m = {"embed/tokens": ("tokens.weight", False), "embed/positions": ("positions.weight", False),
         "ln_f/scale": ("ln_f.weight", False), "ln_f/shift": ("ln_f.bias", False),
         "head/weights": ("head.weight", True)}
    for i in range(model.n_layers):
        p, q = f"block_{i}/", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            m[p + ln + "/scale"], m[p + ln + "/shift"] = (q + ln + ".weight", False), \
                (q + ln + ".bias", False)
        for ours, theirs in (("attn/qkv", "qkv"), ("attn/proj", "proj"), ("mlp/fc", "fc"),
                             ("mlp/proj", "mlp_proj")):
            m[f"{p}{ours}/weights"] = (f"{q}{theirs}.weight", True)
            m[f"{p}{ours}/bias"] = (f"{q}{theirs}.bias", False)
    return m


def cross_check(torch, model, params, x, t, attention="sdpa") -> dict:
    """Loss and gradients of both on the same weights and batch, then 3 AdamW steps."""
    engine = our_engine(model, params)
    net, mapping = torch_gpt(torch, model, params, attention)
    ce = torch.nn.CrossEntropyLoss()
    xt, tt = torch.from_numpy(x), torch.from_numpy(t)
    loss, grads = engine.train_step(x, t, ms.losses.CrossEntropy())
    tloss = ce(net(xt).reshape(-1, model.vocab_size), tt.reshape(-1))
    tloss.backward()
    tparams = dict(net.named_parameters())
    worst = 0.0
    for name, (tname, transpose) in mapping.items():
        g = tparams[tname].grad.numpy()
        g = g.T if transpose else g
        worst = max(worst, float(np.abs(grads[name] - g).max() / np.abs(g).max()))
    opt = ms.optim.AdamW(engine, lr=1e-3)
    topt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ours_l, theirs_l = [], []
    for _ in range(3):
        opt.step(grads)
        topt.step()
        loss_i, grads = engine.train_step(x, t, ms.losses.CrossEntropy())
        topt.zero_grad()
        tl = ce(net(xt).reshape(-1, model.vocab_size), tt.reshape(-1))
        tl.backward()
        ours_l.append(loss_i)
        theirs_l.append(tl.item())
    return {"loss_ours": loss, "loss_torch": tloss.item(),
            "loss_rel_diff": abs(loss - tloss.item()) / abs(tloss.item()),
            "max_grad_rel_diff": worst,
            "adamw_loss_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(ours_l, theirs_l))}


def closures(torch, model, params, x, t, attention, host_heap="keep"):
    """Four callables: ours fwd+bwd, ours + AdamW, torch fwd+bwd, torch + AdamW."""
    engine = our_engine(model, params, host_heap)
    opt = ms.optim.AdamW(engine, lr=1e-4)
    loss = ms.losses.CrossEntropy()

    def ours():
        engine.train_step(x, t, loss)

    def ours_adamw():
        _, grads = engine.train_step(x, t, loss)
        opt.step(grads)

    fns = [ours, ours_adamw]
    if torch is not None:
        net, _ = torch_gpt(torch, model, params, attention)
        topt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        ce = torch.nn.CrossEntropyLoss()
        xt, tt = torch.from_numpy(x), torch.from_numpy(t).reshape(-1)

        def theirs():
            net.zero_grad()
            ce(net(xt).reshape(-1, model.vocab_size), tt).backward()

        def theirs_adamw():
            theirs()
            topt.step()
        fns += [theirs, theirs_adamw]
    return fns


def paired(a, b) -> float:
    """Median over samples of a_i / b_i (the two were timed back to back in round i, so a
    load burst hits both): a cross-check of the ratio of medians on a busy machine."""
    return float(np.median(np.asarray(a) / np.asarray(b)))


def measure(size, samples, warmup=3, with_torch=True, host_heap="keep") -> dict:
    model, params, x, t = problem(size)
    batch = x.shape[0]
    try:
        import torch
        torch.set_num_threads(1)
    except ImportError:
        torch = None
    torch = torch if with_torch else None
    matmuls = matmul_closure(gemm_shapes(model, batch))
    fns = closures(torch, model, params, x, t, "sdpa", host_heap)
    if torch is not None:
        fns += closures(torch, model, params, x, t, "manual", host_heap)[2:3]
    samples_s = sample_times([matmuls] + fns, samples, warmup=warmup)
    times = [float(np.median(s)) for s in samples_s]
    flops = model_flops(model, batch)
    t_mm, t_ours, t_ours_adamw = times[:3]
    res = {"model": {k: v for k, v in size.items()}, "dtype": "float32",
           "threads": os.environ.get("OMP_NUM_THREADS", "default"), "samples": samples,
           "host_heap": keep_host_heap(host_heap).why, "gflop_per_step": flops / 1e9,
           "matmul_s": t_mm, "ours_s": t_ours,
           "ours_adamw_s": t_ours_adamw, "ours_gflops": flops / t_ours / 1e9,
           "matmul_gflops": flops / t_mm / 1e9, "mfu_fraction": t_mm / t_ours,
           "flops_formula": "6*B*T*P_matmul + 3*L*2*(2*B*T^2*D)",
           "mfu_fraction_paired": paired(samples_s[0], samples_s[1]),
           "load_average": os.getloadavg()[0]}
    if torch is None:
        res["torch"] = {"skipped": "torch is not installed (pip install -e '.[bench]')"}
        return res
    t_torch, t_torch_adamw, t_torch_manual = times[3:]
    res.update(torch_version=torch.__version__, torch_s=t_torch, torch_adamw_s=t_torch_adamw,
               torch_manual_attention_s=t_torch_manual, vs_torch_ratio=t_ours / t_torch,
               vs_torch_ratio_adamw=t_ours_adamw / t_torch_adamw,
               vs_torch_ratio_manual_attention=t_ours / t_torch_manual,
               vs_torch_ratio_paired=paired(samples_s[1], samples_s[3]))
    res["cross_check"] = cross_check(torch, model, params, x, t, "sdpa")
    res["cross_check_manual_attention"] = cross_check(torch, model, params, x, t, "manual")
    return res


def profile(size, steps=20):
    model, params, x, t = problem(size)
    (ours,) = closures(None, model, params, x, t, "sdpa")[:1]
    for _ in range(3):
        ours()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        ours()
    pr.disable()
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples")
    p.add_argument("--tiny", action="store_true", help="a toy size for the smoke test")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--profile", action="store_true", help="cProfile our step and exit")
    p.add_argument("--host-heap", choices=("keep", "none"), default="keep",
                   help="our engine's make_engine(host_heap=): keep (train's default) or none")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    size = SIZES["tiny" if args.tiny else "full"]
    if args.profile:
        return profile(size)
    samples = args.samples or (3 if args.tiny else 9 if args.quick else 21)
    res = measure(size, samples, with_torch=not args.no_torch,
                  host_heap=None if args.host_heap == "none" else args.host_heap)
    print(f"GPT {res['model']}, float32, OMP_NUM_THREADS={res['threads']}, "
          f"{res['gflop_per_step']:.3f} GFLOP/step, load {res['load_average']:.1f}")
    print(f"ours {res['ours_gflops']:.2f} GFLOP/s vs plain matmul {res['matmul_gflops']:.2f} "
          f"GFLOP/s: mfu_fraction={res['mfu_fraction']:.3f} "
          f"(paired {res['mfu_fraction_paired']:.3f}); host heap: {res['host_heap']}")
    if "vs_torch_ratio" in res:
        cc = res["cross_check"]
        print(f"ours/torch: step {res['vs_torch_ratio']:.3f} (paired "
              f"{res['vs_torch_ratio_paired']:.3f}), with AdamW "
              f"{res['vs_torch_ratio_adamw']:.3f}, vs manual-attention torch "
              f"{res['vs_torch_ratio_manual_attention']:.3f}; loss rel diff "
              f"{cc['loss_rel_diff']:.1e}, grads {cc['max_grad_rel_diff']:.1e}, AdamW losses "
              f"{cc['adamw_loss_rel_diff']:.1e}")
    write_json(args.json, res)


if __name__ == "__main__":
    main()
