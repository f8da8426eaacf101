"""A strict CPU stand-in for cupy: device arrays that are not numpy arrays.

`DeviceModule(cuda_aware=...)` is an array module for `Backend(array_module=...)`. Its arrays
(`DeviceArray`) hold a numpy array in "device memory" and behave like cupy's, only stricter:

- implicit conversion refuses: `np.asarray(d)` / `__array__` raise TypeError (as cupy does);
  so does every numpy function called on them (`__array_function__`, `__array_ufunc__`), where
  cupy would dispatch: the library must call `xp.` functions, never `np.` ones;
- mixing with host arrays refuses: `d + np_array`, `xp.add(d, np_array)`, `d[np_index]`;
- no buffer protocol, so an unstaged device array handed to mpi4py raises; in CUDA-aware mode
  `__cuda_array_interface__` exposes the memory (host memory, which MPI reads and writes on
  this machine exactly as a CUDA-aware MPI would device memory);
- only cupy 14's dtypes exist (bool, integers, float16/32/64, complex, ml_dtypes.bfloat16):
  an array of any other (float128, strings, objects) raises TypeError, as cupy refuses it;
- matrix products of 16-bit floats refuse (`xp.matmul`, `xp.einsum`, `xp.dot`, `@`): cupy
  14.2's batched matmul and einsum refuse bfloat16 and its 2-D float16 matmul sums in
  float16, so such products must go through nn/gemm.py (its emulation runs here);
- every host<->device copy is counted (`module.copies`): `xp.asarray(host)` (to_device),
  `d.get()` / `xp.asnumpy(d)` / `float(d)` (to_host), `d.set(host)` (to_device);
- streams and events as cupy has them (`xp.cuda.Stream`, `xp.cuda.Event`, `d.data.ptr`): the
  double's own array operations run at once, but work a stream is given (the NCCL stand-in's
  operations, tests/nccl_double.py) runs in order, one item after the one before it finished,
  progressed when the host asks (`event.done`, `stream.synchronize()`), as a GPU's stream does.
"""
from __future__ import annotations

import ctypes
import operator
import os
import types

import ml_dtypes
import numpy as np

CUPY_DTYPES = frozenset([np.dtype(c) for c in "?bhilqBHILQefdFD"]
                        + [np.dtype(ml_dtypes.bfloat16)])
LOW_FLOATS = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
PRODUCTS = {"matmul", "einsum", "dot", "tensordot", "inner", "vdot", "__matmul__", "__rmatmul__",
            "__imatmul__"}


def refuse_low_products(name, arrays):
    """A matrix product of 16-bit float device arrays raises, as the module docstring says."""
    if name in PRODUCTS and any(isinstance(a, DeviceArray) and a.dtype in LOW_FLOATS
                                for a in arrays):
        raise TypeError(f"{name} of a 16-bit float device array: cupy refuses it or sums in "
                        f"16 bits; multiply through nn/gemm.py")


class CopyCounter:
    """Host<->device copies, per direction ("to_host", "to_device"):

    bytes, calls   every copy
    staging        bytes of copies into/out of a caller's host buffer (`d.get(out=host)`,
                   `d.set(host)`: what MPI staging does)
    other_arrays   bytes of the other copies of more than one element (asarray of a host
                   array, asnumpy, get())
    scalars        bytes of the other one-element copies (float(loss), int(ids.max()),
                   xp.asarray(a float)): bytes == staging + other_arrays + scalars
    syncs          stream synchronisations
    """

    def __init__(self):
        self.reset()

    def reset(self):
        self.bytes, self.calls, self.staging, self.other_arrays, self.scalars = (
            {"to_host": 0, "to_device": 0} for _ in range(5))
        self.syncs = 0

    def add(self, direction, a, staging=False):
        self.calls[direction] += 1
        self.bytes[direction] += a.nbytes
        if staging:
            self.staging[direction] += a.nbytes
        elif a.size > 1:
            self.other_arrays[direction] += a.nbytes
        else:
            self.scalars[direction] += a.nbytes


class DeviceArray:
    """An array in (pretend) device memory. `_base` keeps the array a view came from, as
    cupy's `.base` does."""

    __array_ufunc__ = None            # numpy ufuncs on a device array raise TypeError

    def __init__(self, data, module, base=None):
        assert isinstance(data, np.ndarray), type(data)
        if data.dtype not in CUPY_DTYPES:
            raise TypeError(f"Unsupported dtype {data.dtype} (cupy has no such dtype)")
        self._data, self._module, self._base = data, module, base

    # -- what cupy refuses -------------------------------------------------------------------
    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def __array_function__(self, func, types_, args, kwargs):
        raise TypeError(f"numpy.{func.__name__} called on a device array: use xp.{func.__name__}")

    @property
    def __cuda_array_interface__(self):
        if not self._module.cuda_aware:
            raise AttributeError("__cuda_array_interface__ (the MPI is not CUDA-aware here)")
        a = self._data
        assert a.flags.c_contiguous, "MPI got a non-contiguous device buffer"
        return {"shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False),
                "version": 3, "strides": None, "stream": None}

    @property
    def data(self):
        """The device pointer, as cupy's MemoryPointer gives it (`.data.ptr`)."""
        return types.SimpleNamespace(ptr=self._data.ctypes.data)

    # -- explicit transfers (counted) --------------------------------------------------------
    def get(self, out=None):
        self._module.copies.add("to_host", self._data, staging=out is not None)
        if out is None:
            return self._data.copy()
        np.copyto(out, self._data)
        return out

    def set(self, host):
        if not isinstance(host, np.ndarray):
            raise TypeError(f"set() needs a numpy array, got {type(host).__name__}")
        self._module.copies.add("to_device", host, staging=True)
        np.copyto(self._data, host)

    def item(self):
        self._module.copies.add("to_host", self._data)
        return self._data.item()

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __bool__(self):
        return bool(self.item())

    def __index__(self):
        return operator.index(self.item())

    # -- everything else: numpy's own methods on the device data -----------------------------
    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    ndim = property(lambda self: self._data.ndim)
    size = property(lambda self: self._data.size)
    nbytes = property(lambda self: self._data.nbytes)
    itemsize = property(lambda self: self._data.itemsize)
    strides = property(lambda self: self._data.strides)
    flags = property(lambda self: self._data.flags)
    base = property(lambda self: self._base)
    T = property(lambda self: self._module.wrap(self._data.T, (self,)))

    def __len__(self):
        return len(self._data)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return f"DeviceArray({self._data!r})"

    def __array_namespace__(self, api_version=None):
        return self._module

    def __getattr__(self, name):
        if name.startswith("__"):       # numpy's __array_interface__ etc. stay hidden
            raise AttributeError(name)
        attr = getattr(self._data, name)
        if not callable(attr):
            return self._module.wrap(attr, (self,))

        def method(*args, **kwargs):
            return self._module.call(attr, args, kwargs, (self,))
        return method

    def __getitem__(self, index):
        return self._module.wrap(self._data[self._module.unwrap(index)], (self,))

    def __setitem__(self, index, value):
        self._data[self._module.unwrap(index)] = self._module.unwrap(value)


def _binary(name):
    def op(self, *args):
        return self._module.call(getattr(self._data, name), args, {}, (self,))
    return op


def _inplace(name):
    def op(self, other):
        getattr(self._data, name)(self._module.unwrap(other))
        return self
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or",
              "xor", "lshift", "rshift"):
    for _form in ("__{}__", "__r{}__"):
        setattr(DeviceArray, _form.format(_name), _binary(_form.format(_name)))
    setattr(DeviceArray, f"__i{_name}__", _inplace(f"__i{_name}__"))
for _name in ("lt", "le", "gt", "ge", "eq", "ne", "neg", "pos", "abs", "invert"):
    setattr(DeviceArray, f"__{_name}__", _binary(f"__{_name}__"))
DeviceArray.__hash__ = None


class DeviceModule(types.ModuleType):
    """The array module: numpy's functions on device arrays, strict about host arrays."""

    def __init__(self, cuda_aware=False, n_devices=1):
        super().__init__("device_double")
        self.cuda_aware = bool(cuda_aware)
        self.copies = CopyCounter()
        self.ndarray = DeviceArray
        self.streams: dict = {}                       # ptr -> Stream (the null stream: 0)
        self._progressing = False                     # Stream.query moving every stream on
        null = Stream(self)
        self.cuda = types.SimpleNamespace(
            get_current_stream=lambda: null,
            Stream=lambda null=False, non_blocking=False: Stream(self),
            Event=lambda block=False, disable_timing=False: Event(null),
            runtime=types.SimpleNamespace(getDeviceCount=lambda: n_devices,
                                          memcpyAsync=self._memcpy_async),
            Device=lambda i: types.SimpleNamespace(use=lambda: None))

    def _memcpy_async(self, dst, src, nbytes, kind, stream_ptr):
        """cudaMemcpyAsync between a host buffer and device memory (kind 1: host to device,
        2: device to host), run in its stream's order, counted as a staging copy."""
        if kind not in (1, 2):
            raise ValueError(f"memcpyAsync kind {kind}: the double copies 1 (H2D) or 2 (D2H)")

        def launch():
            ctypes.memmove(dst, src, nbytes)
            self.copies.add("to_device" if kind == 1 else "to_host",
                            np.empty(nbytes, np.uint8), staging=True)
            return lambda: True
        self.streams[stream_ptr].enqueue(launch)

    # -- wrapping ----------------------------------------------------------------------------
    def unwrap(self, x):
        """Device data for a call: DeviceArray -> its numpy data; a host array raises."""
        if isinstance(x, DeviceArray):
            return x._data
        if isinstance(x, np.ndarray):
            raise TypeError(f"host array {x.shape} {x.dtype} mixed with device arrays "
                            "(use xp.asarray to copy it to the device)")
        if isinstance(x, (list, tuple)):
            return type(x)(self.unwrap(v) for v in x)
        if isinstance(x, dict):
            return {k: self.unwrap(v) for k, v in x.items()}
        return x

    def wrap(self, r, sources=()):
        """numpy results -> device arrays (0-d for scalars, as cupy's reductions give);
        a view of a source array keeps that source as its base."""
        if isinstance(r, np.ndarray):
            base = next((s for s in sources if isinstance(s, DeviceArray)
                         and np.may_share_memory(r, s._data)), None)
            if base is not None and r is base._data:
                return base
            return DeviceArray(r, self, base)
        if isinstance(r, np.generic) and not isinstance(r, np.dtype):
            return DeviceArray(np.asarray(r), self)
        if isinstance(r, tuple):
            return tuple(self.wrap(v, sources) for v in r)
        if isinstance(r, list):
            return [self.wrap(v, sources) for v in r]
        return r

    def call(self, func, args, kwargs, sources=()):
        sources = tuple(sources) + tuple(_device_args(args, kwargs))
        refuse_low_products(getattr(func, "__name__", ""), sources)
        return self.wrap(func(*self.unwrap(args), **self.unwrap(kwargs)), sources)

    # -- transfers ---------------------------------------------------------------------------
    def asarray(self, a, dtype=None, order=None):
        if isinstance(a, DeviceArray):
            if dtype is None or np.dtype(dtype) == a.dtype:
                return a
            return DeviceArray(a._data.astype(dtype), self)
        host = np.array(a, dtype=dtype, order=order or "K")
        self.copies.add("to_device", host)
        return DeviceArray(host, self)

    def array(self, a, dtype=None, copy=True):
        if isinstance(a, DeviceArray):
            return DeviceArray(a._data.astype(dtype or a.dtype, copy=True), self)
        return self.asarray(a, dtype=dtype)

    def asnumpy(self, a):
        if not isinstance(a, DeviceArray):
            return np.asarray(a)
        return a.get()

    def __getattr__(self, name):
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr                      # dtypes, constants (float32, pi, newaxis)
        if isinstance(attr, np.ufunc):
            return DeviceUfunc(attr, self)   # xp.add(...), xp.add.at(...) as cupy has them

        def function(*args, **kwargs):
            return self.call(attr, args, kwargs)
        function.__name__ = name
        return function


class Stream:
    """An in-order queue of device work: `enqueue(launch)` adds an item, `launch()` starts it
    and returns `test`, which says (True) once it finished. An item starts only after the one
    before it finished, when the host asks (`query`, `synchronize`, an event's `done`): any
    such question moves every stream of the device on, as a GPU runs its streams whatever
    the host waits for (a send queued on one stream must not wait for a host that polls
    another)."""

    def __init__(self, module):
        self._module = module
        self.ptr = len(module.streams)
        module.streams[self.ptr] = self
        self.queue: list = []              # [launch, test or None, owner]
        self.enqueued = self.finished = 0

    def enqueue(self, launch, owner=None) -> None:
        self.queue.append([launch, None, owner])
        self.enqueued += 1
        self.query()                       # an idle stream starts the item at once

    def query(self) -> bool:
        """Progress every stream of the device; True when this one is empty."""
        module = self._module
        if not module._progressing:        # an item's test may ask again: once is enough
            module._progressing = True
            try:
                for stream in list(module.streams.values()):
                    if stream is not self:
                        try:
                            stream._advance()
                        except Exception:   # raised again to whoever asks that stream
                            pass
                self._advance()
            finally:
                module._progressing = False
        return not self.queue

    def _advance(self) -> None:
        while self.queue:
            item = self.queue[0]
            if item[1] is None:
                item[1] = item[0]()
            if not item[1]():
                return
            self.queue.pop(0)
            self.finished += 1

    done = property(query)

    def drop(self, owner) -> None:
        """Forget the items of `owner` (an aborted communicator), counted as finished."""
        kept = [item for item in self.queue if item[2] is not owner]
        self.finished += len(self.queue) - len(kept)
        self.queue[:] = kept

    def synchronize(self) -> None:
        self._module.copies.syncs += 1
        while not self.query():
            os.sched_yield()

    def wait_event(self, event) -> None:
        """Later items of this stream start after `event` (of any stream) happened."""
        self.enqueue(lambda: lambda: event.done)

    def record(self, event=None):
        event = event or Event(self)
        event.record(self)
        return event


class Event:
    """A point in a stream's queue: `done` once every item enqueued before `record` finished."""

    def __init__(self, stream):
        self.stream, self.mark = stream, 0

    def record(self, stream=None) -> None:
        self.stream = stream or self.stream
        self.mark = self.stream.enqueued

    @property
    def done(self) -> bool:
        self.stream.query()
        return self.stream.finished >= self.mark

    def synchronize(self) -> None:
        while not self.done:
            os.sched_yield()


class DeviceUfunc:
    """A numpy ufunc on device arrays: the call and its methods (at, reduce, reduceat,
    accumulate, outer), as cupy's ufuncs offer them; host arrays refuse as everywhere."""

    def __init__(self, ufunc, module):
        self._ufunc, self._module = ufunc, module
        self.__name__ = ufunc.__name__

    def __call__(self, *args, **kwargs):
        return self._module.call(self._ufunc, args, kwargs)

    def __getattr__(self, name):
        attr = getattr(self._ufunc, name)
        if not callable(attr):
            return attr                      # nin, nout, identity

        def method(*args, **kwargs):
            return self._module.call(attr, args, kwargs)
        return method


def _device_args(args, kwargs):
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, DeviceArray):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (v for v in x if isinstance(v, DeviceArray))
