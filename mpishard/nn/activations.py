"""Activation memory: the bytes the layers' tapes hold, measured as they change.

Every layer saves what its backward needs on its tape (`Layer.save` / `pop` / `forget` /
`clear`, one entry per microbatch). `meter_tapes(chunks, meter)` swaps each layer's tape
(sub-layers of composites and wrappers included) for a `MeteredTape`, a dict that tells a
`TapeMeter` what it holds, so the meter knows at every moment the bytes stashed for backward:

    current   bytes on all tapes now; a buffer saved by two layers (or two views of one
              buffer, e.g. q, k, v of one qkv array) counts once
    peak      the most `current` has been since `reset_peak()` (the engine resets it when a
              train_step begins, so after a step it is that step's peak)

This is what differs between pipeline schedules (GPipe stashes every microbatch, 1F1B at most
pp - stage), activation recompute (a block's input instead of its internals, plus one block's
internals during its backward) and sequence or context parallelism (shorter local sequences).
Weights gathered by FSDP are counted by the access policy (`gathered_peak`), not here.
"""
from __future__ import annotations

import numpy as np

from .layers import every_layer


class TapeMeter:
    """Bytes held by the metered tapes: `current` and `peak` (see the module docstring)."""

    def __init__(self):
        self.current = 0
        self.peak = 0
        self._held: dict = {}        # id(buffer) -> [buffer, nbytes, references]

    def hold(self, value) -> None:
        held = self._held
        for buf in buffers(value):
            entry = held.get(id(buf))
            if entry is None:
                held[id(buf)] = [buf, buf.nbytes, 1]
                self.current += buf.nbytes
            else:
                entry[2] += 1
        if self.current > self.peak:
            self.peak = self.current

    def drop(self, value) -> None:
        held = self._held
        for buf in buffers(value):
            entry = held[id(buf)]
            entry[2] -= 1
            if entry[2] == 0:
                del held[id(buf)]
                self.current -= entry[1]

    def reset_peak(self) -> None:
        self.peak = self.current


def buffers(value) -> list:
    """The distinct array buffers behind a saved value (an array, or tuples, lists and dicts
    of arrays and other things: a MoE layer saves a dict); a view stands for the buffer it
    lives in. (A bare numpy array, the common value, takes a short way: the same result.)"""
    if type(value) is np.ndarray:
        while type(value.base) is np.ndarray:
            value = value.base
        if value.base is None or not hasattr(value.base, "nbytes"):
            return [value]
    out, stack = {}, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif hasattr(v, "nbytes") and hasattr(v, "ndim"):
            while getattr(v, "base", None) is not None and hasattr(v.base, "nbytes"):
                v = v.base
            out[id(v)] = v
    return list(out.values())


class MeteredTape(dict):
    """A layer's tape (microbatch -> saved value) that reports what it holds to a meter."""

    def __init__(self, meter: TapeMeter, entries=()):
        super().__init__()
        self.meter = meter
        for mb, value in dict(entries).items():
            self[mb] = value

    def __setitem__(self, mb, value):
        if mb in self:
            self.meter.drop(dict.__getitem__(self, mb))
        self.meter.hold(value)
        super().__setitem__(mb, value)

    def pop(self, mb, *default):
        if mb in self:
            value = super().pop(mb)
            self.meter.drop(value)
            return value
        return super().pop(mb, *default)

    def clear(self):
        for value in self.values():
            self.meter.drop(value)
        super().clear()


def meter_tapes(chunks, meter: TapeMeter) -> None:
    """Give every layer in `chunks` (lists of layers), and every layer inside them (a
    composite's units, a wrapper's inner unit, a Linear's communication unit), a MeteredTape
    reporting to `meter`."""
    for layer in every_layer(chunks):
        if not isinstance(layer.tape, MeteredTape):
            layer.tape = MeteredTape(meter, layer.tape)
