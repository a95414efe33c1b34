"""A fake CUDA accelerator for CPU-only machines, on torch's ``FakeTensorMode``.

Device tensors are ``FakeTensor``s on ``cuda:0``: they carry shapes, dtypes and devices but no
data. Fake tensors raise on every op that mixes devices and on data-dependent host syncs
(``nonzero``, ``item``, ``bool(t)``), so running the hybrid runtime with :class:`FakeCuda`
checks that device-side ops stay on the device and that they never wait for the host. Values
cannot be checked this way; the emulated accelerator (``cpu``) checks them.

Two limits of a CPU-only torch build are worked around here, not in the library:

- ``tensor.to("cuda")`` needs CUDA, so :meth:`FakeCuda.to_device` creates the fake copy directly;
- the Python bindings of some ops (indexing, ``copy_``, ``contiguous``, ``stack``, ``nonzero``)
  open a CUDA device guard, which a CPU build lacks. :class:`FakeCudaOps` routes those to the
  same aten ops, which fake tensors do support.

Data leaves the device only through :meth:`FakeCuda.to_host`, which counts the transfers and
returns zeros of the right shape.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from powerpy.model.device import Accelerator


def _getitem(t: torch.Tensor, index) -> torch.Tensor:
    """Basic and single-tensor indexing through aten ops: ints, slices, None, ..., 1-D ids."""
    if not isinstance(index, tuple):
        index = (index,)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    out, dim = t, 0
    for i in index:
        if i is None:
            out, dim = out.unsqueeze(dim), dim + 1
        elif i is Ellipsis:
            dim += t.dim() - n_real
        elif isinstance(i, int):
            out = out.select(dim, i)
        elif isinstance(i, slice):
            out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, i.step or 1)
            dim += 1
        elif isinstance(i, torch.Tensor) and i.dim() == 1 and not i.dtype.is_floating_point:
            out, dim = out.index_select(dim, i), dim + 1
        else:
            raise TypeError(f"fake CUDA indexing does not support {i!r}")
    return out


class FakeCudaOps(TorchFunctionMode):
    """Routes the ops whose Python bindings need a real CUDA device guard to aten ops."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, (list, tuple)) and first:
            first = first[0]
        if isinstance(first, FakeTensor):
            if func is torch.Tensor.__getitem__:
                return _getitem(args[0], args[1])
            if func is torch.Tensor.__setitem__:
                torch.ops.aten.copy_.default(_getitem(args[0], args[1]), args[2])
                return None
            if func is torch.Tensor.copy_:
                return torch.ops.aten.copy_.default(args[0], args[1])
            if func is torch.Tensor.contiguous:
                if args[0].is_contiguous():
                    return args[0]
                return torch.ops.aten.clone.default(args[0], memory_format=torch.contiguous_format)
            if func is torch.stack:
                return torch.ops.aten.stack.default(list(args[0]), kwargs.get("dim", 0))
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:  # the binding's device guard: call the aten op itself
                op = getattr(torch.ops.aten, getattr(func, "__name__", ""), None)
                if "not linked with support for cuda" not in str(e) or op is None:
                    raise
                return op(*args, **kwargs)
        return func(*args, **kwargs)


def _composite(func) -> bool:
    """An op that other ops implement (its decomposition runs the kernels)."""
    if func.namespace != "aten":
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _runs_kernel(func) -> bool:
    """An op that runs a kernel: not a view, not a composite."""
    if getattr(func, "is_view", False) or func.namespace == "prim":
        return False
    return not _composite(func)


class OpLog(TorchDispatchMode):
    """Counts aten ops by (name, device of the output); ``launches`` counts only those on the
    device that run a kernel (see :func:`_runs_kernel`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[tuple[str, str]] = Counter()
        self.kernels: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func) and not getattr(func, "is_view", False):
            with self:  # count the ops it is made of
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        dev = out.device.type if isinstance(out, torch.Tensor) else "-"
        self.ops[(func.overloadpacket.__name__, dev)] += 1
        if dev == "cuda" and _runs_kernel(func):
            self.kernels[func.overloadpacket.__name__] += 1
        return out

    @property
    def launches(self) -> int:
        return sum(self.kernels.values())


class StepTrace(TorchDispatchMode):
    """Every op of a run, as a graph replay sees it: its name, its non-tensor arguments, and for
    each tensor argument and result its dtype, shape, strides, offset, device and where its
    memory comes from: a tensor made by an earlier op of the run (by that op's index), or one
    from outside (by its storage's identity: a weight, a fixed buffer, the KV pool). Two steps
    whose traces are equal run the same ops on the same memory, which is what replaying a
    captured graph needs (``ops``: the list; ``host_ops``: the ops on host tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.host_ops: list[str] = []
        self._made: dict[int, int] = {}  # storage identity -> index of the op that made it

    def _desc(self, a):
        if not isinstance(a, torch.Tensor):
            return a if isinstance(a, (int, float, bool, str, type(None), torch.dtype)) else type(a)
        key = a.untyped_storage()._cdata
        origin = ("op", self._made[key]) if key in self._made else ("ext", key)
        return (a.dtype, tuple(a.shape), a.stride(), a.storage_offset(), a.device.type, origin)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_flatten

        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        ins = [self._desc(a) for a in flat]
        seen = {a.untyped_storage()._cdata for a in flat if isinstance(a, torch.Tensor)}
        out = func(*args, **kwargs)
        outs = tree_flatten(out)[0]
        i = len(self.ops)
        for o in outs:  # a new result is this op's (a view or an in-place result: its input's)
            if isinstance(o, torch.Tensor) and o.untyped_storage()._cdata not in seen:
                self._made[o.untyped_storage()._cdata] = i
        name = func.overloadpacket.__name__
        self.ops.append((name, tuple(ins), tuple(self._desc(o) for o in outs)))
        if _runs_kernel(func) and any(
            isinstance(o, torch.Tensor) and o.device.type == "cpu" for o in outs
        ):  # work on the host (a view of a pinned buffer is none)
            self.host_ops.append(name)
        return out


class FakeCuda(Accelerator):
    """A CUDA accelerator with fake tensors: persistent device bytes and per-step copies
    counted, each per-step copy checked to go through a pinned staging buffer."""

    def __init__(self) -> None:
        super().__init__("cpu")  # no stream; the device is set below
        self.mode = FakeTensorMode()
        self.device = torch.device("cuda", 0)
        self.gather_hot = False  # as on real CUDA: no nonzero on the device
        self.fused = True  # the fused kernels' fake versions give shapes
        self._pinned: set[int] = set()
        self.reset_counts()

    def reset_counts(self) -> None:
        self.bytes_in = self.bytes_out = 0  # host -> device, device -> host
        self.n_in = self.n_out = 0
        self.waits = 0
        self.host_calls = 0  # host functions queued on the stream
        self.allocated = 0  # persistent device allocations (caches)
        self.copied: list[torch.Tensor] = []  # the tensors copied per step (kept alive)

    def free_memory(self) -> int | None:
        return 8 << 30

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        assert not isinstance(t, FakeTensor), "already on the device"
        assert t.device.type == "cpu"
        self.n_in += 1
        self.bytes_in += t.numel() * t.element_size()
        return self._fake(t)

    def send(self, t: torch.Tensor) -> torch.Tensor:
        self.copied.append(t)
        return super().send(t)

    def _pinned_empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(n, dtype=dtype)
        self._pinned.add(t.data_ptr())
        return t

    def _check_pinned(self, buf: torch.Tensor) -> None:
        assert buf.untyped_storage().data_ptr() in self._pinned, "a copy from pageable memory"

    def _h2d(self, buf: torch.Tensor) -> torch.Tensor:
        self._check_pinned(buf)
        self.n_in += 1
        self.bytes_in += buf.numel() * buf.element_size()
        return self._fake(buf)

    def _d2h(self, t: torch.Tensor, buf: torch.Tensor) -> None:
        assert isinstance(t, FakeTensor) and t.device == self.device
        self._check_pinned(buf)
        self.copied.append(t)
        self.n_out += 1
        self.bytes_out += t.numel() * t.element_size()
        buf.zero_()

    def _record(self, slot: list) -> None:
        slot[1] = None

    def _wait(self, slot: list) -> None:
        self.waits += 1

    # a plan's fixed buffers (powerpy.model.plan): counted and checked as the staged copies are
    def pinned(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        self._pinned.add(t.untyped_storage().data_ptr())
        return t

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert isinstance(dst, FakeTensor) and dst.device == self.device
        self._check_pinned(src)
        self.n_in += 1
        self.bytes_in += src.numel() * src.element_size()

    def copy_out(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert isinstance(src, FakeTensor) and src.device == self.device
        self._check_pinned(dst)
        self.n_out += 1
        self.bytes_out += src.numel() * src.element_size()  # (dst keeps its zeros)

    def record(self):
        return None

    def wait(self, event) -> None:
        self.waits += 1

    def host_func(self, fn: int, arg: int, dep: torch.Tensor) -> None:
        self._check_pinned(dep)
        self.host_calls += 1

    @property
    def host_funcs_elsewhere(self) -> bool:
        return False  # counted, never run: nothing to serve

    def graph_kind(self) -> str | None:
        return None  # fake tensors replay nothing: plans run their step eagerly

    def zeros(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        with self.mode:
            out = torch.zeros(shape, dtype=dtype, device=self.device)
        self.allocated += out.numel() * out.element_size()
        return out


def run_prefill_and_decode(
    model, tokens: torch.Tensor, n_ctx: int, n_prompt: int, n_steps: int, options
) -> torch.Tensor:
    """Under :class:`FakeCudaOps`: prefill ``tokens[:n_prompt]`` into a fresh cache of ``n_ctx``
    positions, then decode the next ``n_steps`` tokens one by one (teacher forced). Returns the
    last step's logits (1, n_vocab)."""
    cache = model.new_cache(n_ctx)
    with FakeCudaOps():
        logits = model.forward(tokens[:n_prompt], cache, options)
        for tok in tokens[n_prompt : n_prompt + n_steps]:
            logits = model.forward(tok[None], cache, options)
    return logits
