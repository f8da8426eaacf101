"""nn/cudnn_attention.py on the CPU: its graphs, pointers, layouts and fallbacks, against a
stand-in `cudnn` module on the strict device double (tests/device_double.py).

FakeCudnn records the graph calls the module makes (dims, strides, data types, the causal
flag, the scale) and, on `execute`, reads the arrays at the pointers it is given with the
dims and strides it was told (so a wrong stride or pointer reads the wrong numbers), runs the
attention in float64 (nn/attention.py's xp path) and writes each output rounded once to its
data type: what an exact cuDNN would write. So the tests check the plumbing; cuDNN's own
numerics are measured on a GPU (benchmarks/gpu_cudnn_check.py, the GPU check's `cudnn`
part).
"""
import ctypes
import math
import types

import ml_dtypes
import numpy as np
import pytest
from device_double import DeviceModule
from mpi4py import MPI
from test_gpt_engine import make_case

import mpishard as ms
from mpishard.comm.backend import Backend

from mpishard.nn import attention as att
from mpishard.nn import cudnn_attention as cda
from mpishard.nn.autocast import Narrow

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"BFLOAT16": BF16, "HALF": np.dtype(np.float16), "FLOAT": np.dtype(np.float32)}


class FakeTensor:
    def __init__(self, graph, name, dim=None, stride=None, data_type=None):
        self.graph, self.name, self.dim, self.stride, self.data_type = (
            graph, name, dim, stride, data_type)
        self.output = False

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.dim = list(dim)
        return self

    def set_stride(self, stride):
        self.stride = list(stride)
        return self

    def set_data_type(self, dtype):
        self.data_type = dtype
        return self


class FakeGraph:
    def __init__(self, cudnn, io_data_type, intermediate_data_type, compute_data_type, handle):
        self.cudnn, self.io, self.handle = cudnn, io_data_type, handle
        assert intermediate_data_type == compute_data_type == "FLOAT"
        self.op, self.plans = None, False
        cudnn.graphs.append(self)

    def tensor(self, name, dim, stride, data_type):
        return FakeTensor(self, name, list(dim), list(stride), data_type)

    def sdpa(self, name, q, k, v, generate_stats, attn_scale, use_causal_mask):
        assert generate_stats and use_causal_mask
        self.op = ("forward", q, k, v, attn_scale)
        return [FakeTensor(self, "o"), FakeTensor(self, "stats")]

    def sdpa_backward(self, name, q, k, v, o, dO, stats, attn_scale, use_causal_mask):
        assert use_causal_mask
        self.op = ("backward", q, k, v, o, dO, stats, attn_scale)
        self.grads = [FakeTensor(self, n) for n in ("dq", "dk", "dv")]
        return self.grads

    def validate(self):
        pass

    def build_operation_graph(self):
        pass

    def create_execution_plans(self, modes):
        assert modes == ["A", "FALLBACK"]

    def check_support(self):
        if self.cudnn.refuse:
            raise self.cudnn.cudnnGraphNotSupportedError("no engine for this graph")
        if self.cudnn.fail_once:
            self.cudnn.fail_once = False
            raise RuntimeError("CUDA out of memory while building plans")

    def build_plans(self):
        self.plans = True

    def get_workspace_size(self):
        return 256

    def execute(self, pointers, workspace, handle):
        assert self.plans and handle is self.handle and workspace
        self.cudnn.runs += 1
        arrays = {t.name: view(ptr, t) for t, ptr in pointers.items()}
        wide = {t.name: arrays[t.name].astype(np.float64) for t in pointers
                if not t.output}
        assert math.isclose(self.op[-1], 1 / math.sqrt(wide["q"].shape[-1]))
        if self.op[0] == "forward":
            o, lse = att.attention_block(wide["q"], wide["k"], wide["v"], offset=0)
            arrays["o"][...] = o.astype(arrays["o"].dtype)
            arrays["stats"][...] = lse[..., None]
        else:
            grads = att.attention_block_backward(wide["dout"], wide["q"], wide["k"], wide["v"],
                                                 wide["out"], wide["lse"][..., 0], offset=0)
            for n, g in zip(("dq", "dk", "dv"), grads):
                arrays[n][...] = g.astype(arrays[n].dtype)


def view(ptr, t):
    """The numpy array at device pointer `ptr` (host memory on the double) with t's dims,
    strides (elements) and data type."""
    dtype = DTYPES[t.data_type]
    extent = 1 + sum((d - 1) * s for d, s in zip(t.dim, t.stride))
    raw = (ctypes.c_char * (extent * dtype.itemsize)).from_address(ptr)
    flat = np.frombuffer(raw, dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, t.dim, [s * dtype.itemsize for s in t.stride])


class FakeCudnn:
    def __init__(self, refuse=False):
        self.data_type = types.SimpleNamespace(**{k: k for k in DTYPES})
        self.heur_mode = types.SimpleNamespace(A="A", FALLBACK="FALLBACK")
        self.graphs, self.runs, self.refuse, self.streams = [], 0, refuse, []
        self.fail_once = False
        self.cudnnGraphNotSupportedError = type("cudnnGraphNotSupportedError", (Exception,), {})

    def create_handle(self):
        return object()

    def set_stream(self, handle, stream):
        self.streams.append(stream)

    def pygraph(self, **kw):
        return FakeGraph(self, **kw)


@pytest.fixture
def fake(monkeypatch):
    """(xp, the fake cudnn): the device double taken for cupy by this module, with a GPU 0."""
    cudnn = FakeCudnn()
    monkeypatch.setattr(cda, "load", lambda: cudnn)
    monkeypatch.setattr(cda, "is_cupy", lambda xp: isinstance(xp, DeviceModule))
    monkeypatch.delenv(cda.SWITCH, raising=False)
    monkeypatch.delenv("MPISHARD_FUSED", raising=False)
    cda.refusals.clear()
    xp = DeviceModule()
    xp.cuda.runtime.getDevice = lambda: 0
    stream = xp.cuda.get_current_stream()
    xp.cuda.get_current_stream = lambda: types.SimpleNamespace(ptr=77, inner=stream)
    return xp, cudnn


def qkv_dout(xp, dtype, b=2, h=3, t=16, dh=8, seed=0):
    """q, k, v as views of one (B, T, 3, H, Dh) 16-bit array (split_heads' layout), and dout
    a (B, H, T, Dh) view of a (B, T, H, Dh) float32 array (merge_heads_backward's)."""
    rng = np.random.default_rng(seed)
    a = xp.asarray(rng.standard_normal((b, t, 3 * h * dh)).astype(dtype))
    q, k, v = att.split_heads(a, h)
    dy = xp.asarray(rng.standard_normal((b, t, h * dh)).astype(np.float32))
    return q, k, v, att.merge_heads_backward(dy, h)


def host(a):
    return a.get().astype(np.float64)


@pytest.mark.parametrize("dtype", [BF16, np.float16])
def test_forward_and_backward_read_and_write_where_the_arrays_lie(fake, dtype):
    xp, cudnn = fake
    q, k, v, dout = qkv_dout(xp, dtype)
    cast = Narrow(dtype)
    out, lse, p = att.causal_attention_forward(q, k, v, keep_probs=True, cast=cast)
    assert p is None and out.dtype == dtype and out.shape == q.shape
    b, h, t, dh = q.shape
    assert out.strides == tuple(s * out.itemsize for s in (t * h * dh, dh, h * dh, 1))
    ref_out, ref_lse = att.attention_block(host(q), host(k), host(v), offset=0)
    np.testing.assert_array_equal(host(out), ref_out.astype(dtype).astype(np.float64))
    np.testing.assert_allclose(host(lse), ref_lse, rtol=1e-6)
    fwd = cudnn.graphs[0]                  # Narrow's q, k, v: C-ordered 16-bit copies
    assert [t.stride for t in fwd.op[1:4]] == [[h * t * dh, t * dh, dh, 1]] * 3
    # the backward: into the views split_heads_grads hands out, widened
    da, into = att.split_heads_grads(q)
    grads = att.causal_attention_backward(dout, q, k, v, out, lse, into=into, cast=cast)
    assert all(g is i for g, i in zip(grads, into)) and da.dtype == np.float32
    want = att.attention_block_backward(host(dout.astype(dtype)), host(q), host(k), host(v),
                                        host(out), host(lse), offset=0)
    for g, w in zip(into, want):
        np.testing.assert_array_equal(host(g), w.astype(dtype).astype(np.float64))
    assert cudnn.runs == 2 and len(cudnn.graphs) == 2
    o = cudnn.graphs[1].op[4]                 # the backward reads out where the forward wrote
    assert o.stride == [t * h * dh, dh, h * dh, 1] and o.dim == [b, h, t, dh]
    att.causal_attention_forward(q, k, v, cast=cast)       # the same shapes: no new graph
    assert cudnn.runs == 3 and len(cudnn.graphs) == 2 and cudnn.streams[-1] == 77
    # 16-bit `into` (the GPT unit's after a cuDNN forward): written by cuDNN where it lies
    da, into = att.split_heads_grads(q, dtype)
    grads = att.causal_attention_backward(dout, q, k, v, out, lse, into=into, cast=cast)
    assert all(g is i for g, i in zip(grads, into)) and da.dtype == dtype
    for g, w in zip(into, want):
        np.testing.assert_array_equal(host(g), w.astype(dtype).astype(np.float64))
    assert cudnn.runs == 4 and cudnn.graphs[2].op[0] == "backward"   # a graph for da's strides
    written = [g.stride for g in cudnn.graphs[2].grads]
    assert written == [[t * 3 * h * dh, dh, 3 * h * dh, 1]] * 3


def test_switched_off_refused_or_masked_runs_the_own_kernels(fake, monkeypatch):
    """MPISHARD_CUDNN=0, a further mask, a passing failure to build (tried again, then no
    longer reported), MPISHARD_FUSED=0, a refusal (kept: built once) and float32 inputs each
    leave the attention to our own kernels."""
    xp, cudnn = fake
    q, k, v, dout = qkv_dout(xp, BF16)
    cast = Narrow(BF16)
    monkeypatch.setenv(cda.SWITCH, "0")
    out, lse = att.causal_attention_forward(q, k, v, cast=cast)
    assert out.dtype == np.float32 and cudnn.runs == 0     # attention_block's float32 out
    att.causal_attention_backward(dout, q, k, v, out, lse, cast=cast)
    assert cudnn.runs == 0
    monkeypatch.delenv(cda.SWITCH)
    visible = xp.asarray(np.ones((1, 1, 16, 16), dtype=bool))
    att.causal_attention_forward(q, k, v, visible=visible, cast=cast)
    assert cudnn.runs == 0                                  # a further mask: not cuDNN's
    cudnn.fail_once = True                                  # out of memory: not kept
    out, lse = att.causal_attention_forward(q, k, v, cast=cast)
    assert out.dtype == np.float32 and cudnn.runs == 0
    assert any("out of memory" in why for why in cda.refusals.values())
    out, lse = att.causal_attention_forward(q, k, v, cast=cast)
    assert out.dtype == BF16 and cudnn.runs == 1            # built at the next call
    assert not cda.refusals                                 # and no longer reported
    monkeypatch.setenv("MPISHARD_FUSED", "0")               # every fused kernel off: cuDNN too
    out, lse = att.causal_attention_forward(q, k, v, cast=cast)
    assert out.dtype == np.float32 and cudnn.runs == 1
    monkeypatch.delenv("MPISHARD_FUSED")
    cudnn.refuse = True                                     # a refusal: kept
    q2, k2, v2, _ = qkv_dout(xp, BF16, t=24)
    for _ in range(2):
        out, lse = att.causal_attention_forward(q2, k2, v2, cast=cast)
        assert out.dtype == np.float32 and cudnn.runs == 1
    assert any("no engine" in why for why in cda.refusals.values())
    assert len(cudnn.graphs) == 3                           # the refused graph built once
    q32 = q.astype(np.float32)
    assert cda.forward(q32, q32, q32) is None               # 16-bit inputs only


def test_a_gpt_step_through_the_fake_stays_within_the_layouts_tolerance(fake, monkeypatch):
    """A whole 16-bit GPT train_step on the double with cuDNN's path taken (forward and
    backward of every layer) against the host's rounding emulation: an exact cuDNN rounds
    out and the gradients once, where the emulation rounds p first, so the two differ by
    roundings; within the layouts' tolerance (8 bf16 ulps of each array's largest)."""
    xp, cudnn = fake
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    model = ms.GPT(vocab_size=16, seq_len=8, d_model=32, n_heads=2, n_layers=2, d_ff=64)
    params, x, t = make_case(model)
    got = {}
    for where, device in (("host", "cpu"), ("device", Backend(
            "gpu", MPI.COMM_SELF, array_module=xp))):
        e = ms.SingleDevice(model, dtype=np.float32, compute_dtype="bfloat16", device=device)
        e.load_checkpoint(params)
        loss, grads = e.train_step(e.shard_batch(x), e.shard_batch(t),
                                   e.output.loss(ms.losses.CrossEntropy()))
        got[where] = (loss, {n: device.to_host(g) if where == "device" else g
                             for n, g in grads.items()})
    assert cudnn.runs == 4                                  # 2 layers, forward and backward
    (hl, hg), (dl, dg) = got["host"], got["device"]
    tol = 8 * 2.0 ** -8
    assert abs(dl - hl) <= tol * abs(hl)
    for n in hg:
        err = np.abs(dg[n] - hg[n]).max() / np.abs(hg[n]).max()
        assert err <= tol, (n, err)


def test_a_refused_shape_is_logged_once_and_status_says_what_runs(fake, monkeypatch, caplog):
    """A refusal warns once per shape (the attention that runs is discoverable from the log),
    and cudnn_attention.status(), `inspect --env`'s line, names the switch when it is off."""
    import logging
    xp, cudnn = fake
    cudnn.refuse = True
    q, k, v, _ = qkv_dout(xp, BF16, t=40)
    with caplog.at_level(logging.WARNING, logger=cda.__name__):
        for _ in range(3):
            att.causal_attention_forward(q, k, v, cast=Narrow(BF16))
    warned = [r for r in caplog.records if "did not build" in r.getMessage()]
    assert len(warned) == 1 and "(2, 3, 40, 8)" in warned[0].getMessage()
    monkeypatch.setenv(cda.SWITCH, "0")
    assert cda.status().startswith("off")
