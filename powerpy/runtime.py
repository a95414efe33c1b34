"""Hybrid CPU-accelerator runtime: the only module that moves weights between devices.

``build_hybrid(llm, placement, device)`` applies a :class:`~powerpy.placement.Placement`:

- the placed dense tensors (attention, norms, predictors, output) move to ``device``; the KV
  cache is created there when the placement says so;
- per layer, compact copies of the hot rows ``W[gpu_bucket]`` of ffn_gate, ffn_up and ffn_down_t
  (raw ggml rows, quantized blocks intact) go to ``device``. The host keeps its matrices as they
  are (memory-mapped from the file): the CPU reads only cold rows from them, so the hot rows cost
  file-backed page cache that decode never touches, not a second anonymous copy;
- :class:`HybridFFN` replaces ``Model.ffn_runner`` (spec §9.3): hot rows on the device, predicted
  active cold rows on the CPU, outputs added.

``device`` may be ``"cpu"``: an emulated accelerator with the same budget accounting and the
same split/merge code, so CI tests it without a GPU. Notebook use::

    llm = powerpy.load("model.powerinfer.gguf", vram_budget=8.0)  # CUDA if present
    print(llm.runtime.summary())  # llm.runtime is None when running CPU-only

    # step by step: any index, any budget, or the emulated device
    llm = powerpy.load("model.powerinfer.gguf")
    index = GpuIndex.read("model.powerinfer.gguf.generated.gpuidx")
    rt = build_hybrid(llm, Placement.for_model(llm.file, 8 << 30, index), "cpu")
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.budget import budget_bytes
from powerpy.constants import Names
from powerpy.model import Block, Model
from powerpy.placement import Placement, fmt_bytes, resolve_placement
from powerpy.sparse_ffn import ffn_masked, ffn_rows, glu, rows_sum
from powerpy.timing import phase
from powerpy.weights import Weight, glu_rows

if TYPE_CHECKING:
    from powerpy.api import LLM
    from powerpy.gguf_io import GGUFFile

logger = logging.getLogger(__name__)

__all__ = [
    "HOT_MODES",
    "HybridFFN",
    "HybridRuntime",
    "HotRows",
    "NO_CUDA_MESSAGE",
    "accelerator",
    "build_hybrid",
    "enable_hybrid",
]

NO_CUDA_MESSAGE = "no CUDA GPU found: running everything on the CPU"
_said_no_cuda = False


# ----------------------------------------------------------------------------------- devices
def accelerator(device: str | torch.device | None = None) -> torch.device | None:
    """The accelerator to place on: ``device`` as given, or CUDA when available, else None.

    Args:
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` (the emulated accelerator) or None (auto).

    Returns:
        A device with an explicit index for CUDA, or None when ``device`` is None and there is
        no CUDA GPU (the message is logged once per process).

    Raises:
        ValueError: a CUDA device was asked for but none is available.
    """
    global _said_no_cuda
    if device is None:
        if torch.cuda.is_available():
            return accelerator("cuda")
        if not _said_no_cuda:
            logger.warning("%s", NO_CUDA_MESSAGE)
            _said_no_cuda = True
        return None
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} was asked for but no CUDA GPU is available")
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    if dev.type != "cpu":
        raise ValueError(f"unsupported accelerator {device!r}: use 'cuda[:N]' or 'cpu' (emulated)")
    return dev


def device_budget(vram_budget: float, device: torch.device) -> int:
    """``--vram-budget`` GiB to bytes; a negative value is the free VRAM minus 256 MiB (§10.1).

    Raises:
        ValueError: a negative budget on the emulated (CPU) accelerator, or a non-finite one.
    """
    free = None
    if vram_budget < 0:
        if device.type != "cuda":
            raise ValueError(
                f"--vram-budget {vram_budget:g} means all free VRAM, which the emulated CPU "
                f"accelerator does not have; give the budget in GiB"
            )
        free = int(torch.cuda.mem_get_info(device)[0])
    return budget_bytes(vram_budget, free_vram=free)


# ----------------------------------------------------------------------------------- hot rows
@dataclass
class HotRows:
    """One layer's split: compact hot rows on the accelerator, the cold set on the host.

    Attributes:
        k: neurons on the accelerator.
        gate, up, down_t: ``(k, n_embd)`` compact rows ``W[bucket]`` on the device (None if k=0).
        bucket: ``(k,)`` int64 on the device: the neuron id of each compact row.
        rows: ``(k,)`` int64 ``arange(k)`` on the device (the "all rows" index).
        cold: ``(n_ff,)`` bool on the host, True where the neuron stays on the CPU.
        cold_idx: ``(n_ff - k,)`` int64 on the host, the cold neuron ids.
    """

    k: int
    gate: Weight | None
    up: Weight | None
    down_t: Weight | None
    bucket: Tensor | None
    rows: Tensor | None
    cold: Tensor
    cold_idx: Tensor

    @property
    def device_bytes(self) -> int:
        mats = (self.gate, self.up, self.down_t)
        return sum(m.nbytes for m in mats if m is not None)

    @property
    def index_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bucket, self.rows) if t is not None)


def _predict(blk: Block, x_pred: Tensor) -> Tensor:
    """Predictor logits where fc1/fc2 are placed: x_pred (T, n_embd) -> (T, n_ff) f32."""
    z = F.relu(blk.fc1.linear(x_pred.to(blk.fc1.device)))  # (T, H)
    return blk.fc2.linear(z.to(blk.fc2.device))


HOT_MODES = ("auto", "dense", "gated")


class HybridFFN:
    """``Model.ffn_runner`` of a hybrid placement: hot rows on the device, cold rows on the CPU.

    Per layer (spec §9.3) the predictor runs where its weights are, the CPU computes the
    predicted-active **cold** rows from the host matrices, and the device its k hot rows; the
    two outputs are added. The hot part has two forms (``hot_mode``):

    - ``"dense"``: one masked GEMV over all k rows, ``h = glu(gate_hot·x, up_hot·x) * act[bucket]``,
      ``y_hot = h @ down_hot``. No host round trip: a gather would need ``nonzero``, which
      synchronises the GPU and serialises it with the CPU part, while hot rows are the often
      active ones, so the extra rows are cheap at HBM speed. The default on CUDA.
    - ``"gated"``: decode gathers only the active hot rows, like PowerInfer's kernels. On the
      CPU it reads fewer bytes (measured 1.5-6x faster than "dense" for 10-60% active hot rows
      at n_embd 1024, F16), so it is the default of the emulated device. Batches use "dense".

    On CUDA the device part runs on a side stream, launched before the CPU part and joined
    after it; on the emulated CPU device everything runs in sequence.
    """

    def __init__(
        self, model: Model, layers: list[HotRows], device: torch.device, hot_mode: str = "auto"
    ) -> None:
        if hot_mode not in HOT_MODES:
            raise ValueError(f"hot_mode must be one of {HOT_MODES}, got {hot_mode!r}")
        self.model = model
        self.layers = layers
        self.device = device
        self.gated = hot_mode == "gated" or (hot_mode == "auto" and device.type == "cpu")
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, l: int, blk: Block, x: Tensor, ffn_inp: Tensor) -> Tensor:
        """x (T, n_embd) normed, ffn_inp (T, n_embd) pre-norm -> (T, n_embd) on ffn_inp's device."""
        m = self.model
        if m.observer is not None:
            raise ValueError("FFN observers need the CPU-only runner (Model.cpu_ffn)")
        act = None
        if m.sparse_enabled and blk.fc1 is not None and blk.fc2 is not None:
            with phase(m.timer, "predictor"):
                act = _predict(blk, ffn_inp) >= m.threshold  # (T, n_ff) bool
        return self.split_ffn(l, blk, x, act, out_device=ffn_inp.device)

    def split_ffn(
        self,
        l: int,
        blk: Block,
        x: Tensor,
        act: Tensor | None,
        *,
        out_device: torch.device | None = None,
    ) -> Tensor:
        """The split FFN for a given mask: hot part on the device plus cold part on the CPU.

        Args:
            l: layer.
            blk: the layer's weights (host FFN matrices).
            x: (T, n_embd) normed FFN input, on any device.
            act: (T, n_ff) bool predicted-active mask (any device), or None for dense.
            out_device: where to return the sum (default: x's device).

        Returns:
            (T, n_embd) f32.
        """
        hot = self.layers[l]
        y_hot = None
        if hot.k:
            x_dev = x.to(self.device)
            act_dev = None if act is None else act.to(self.device)
            with self._side_stream(), phase(self.model.timer, "ffn_hot"):
                y_hot = self._hot(hot, x_dev, act_dev)  # (T, n_embd), queued on the device
        x_host = x.to("cpu")  # waits for the predictor only, not for the hot part
        act_host = None if act is None else act.to("cpu")
        if act_host is not None:
            self.model.sparsity.record(l, act_host)
        with phase(self.model.timer, "ffn_cold"):
            y_cold = self._cold(blk, hot, x_host, act_host)  # (T, n_embd) on the host
        out_device = x.device if out_device is None else out_device
        if y_hot is None:
            return y_cold.to(out_device)
        with phase(self.model.timer, "ffn_hot_wait"):
            self._join()
        if y_hot.device == out_device:
            return y_hot + y_cold.to(out_device)
        return y_hot.to(out_device) + y_cold

    def _hot(self, hot: HotRows, x: Tensor, act: Tensor | None) -> Tensor:
        # x (T, n_embd), act (T, n_ff) bool, both on the device -> (T, n_embd) f32
        assert hot.gate is not None and hot.up is not None and hot.down_t is not None
        variant = self.model.args.ffn_variant
        if self.gated and act is not None and x.shape[0] == 1:
            idx = act[0, hot.bucket].nonzero().squeeze(1)  # (r,) active compact rows
            h = glu_rows(x[0], hot.gate, hot.up, idx, variant)  # (r,)
            return hot.down_t.gather_axpy(h, idx)[None]
        h = glu(hot.gate.linear(x), hot.up.linear(x), variant)  # (T, k)
        if act is not None:
            h = h * act[:, hot.bucket]  # predictor gating without a host round trip
        if h.shape[0] == 1:
            return hot.down_t.gather_axpy(h[0], hot.rows)[None]
        return rows_sum(h, hot.down_t)

    def _cold(self, blk: Block, hot: HotRows, x: Tensor, act: Tensor | None) -> Tensor:
        # x (T, n_embd), act (T, n_ff) bool, both on the host -> (T, n_embd) f32
        variant = self.model.args.ffn_variant
        gate, up, down_t = blk.ffn_gate, blk.ffn_up, blk.ffn_down_t
        if x.shape[0] == 1:  # decode: only the predicted-active cold rows
            idx = hot.cold_idx if act is None else (act[0] & hot.cold).nonzero().squeeze(1)
            return ffn_rows(x[0], gate, up, down_t, variant, idx)[None]
        mask = hot.cold.expand(x.shape[0], -1) if act is None else act & hot.cold  # (T, n_ff)
        rows = mask.any(0).nonzero().squeeze(1)  # (r,) cold rows any token needs
        if rows.numel() == 0:
            return x.new_zeros(x.shape[0], down_t.shape[1])
        if 2 * rows.numel() >= mask.shape[1]:  # most rows needed: one dense masked pass
            return ffn_masked(x, gate, up, down_t, variant, mask)
        g, u = gate.take_rows(rows).linear(x), up.take_rows(rows).linear(x)  # (T, r)
        return rows_sum(glu(g, u, variant) * mask[:, rows], down_t.take_rows(rows))

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    def _join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


# ----------------------------------------------------------------------------------- runtime
@dataclass
class HybridRuntime:
    """What ``build_hybrid`` did, with the bytes it measured.

    Attributes:
        device: the accelerator (``cpu`` = emulated).
        placement: the placement applied.
        ffn: the installed FFN runner.
        dense_bytes: bytes of the dense tensors now on the device.
        hot_bytes: bytes of the compact hot rows on the device.
        kv_bytes: bytes a KV cache of ``placement.n_ctx`` positions takes on the device (it is
            allocated per generation; 0 when the cache stays on the host).
        index_bytes: the per-layer bucket/row index vectors on the device (workspace, outside
            the budget like upstream's ``gpu_bucket``: 16 bytes per hot neuron).
        host_mapped_bytes: host weight bytes backed by the memory-mapped model file.
        host_anon_bytes: host weight bytes in anonymous memory (dequantized at load, or the
            hot-row copies of the emulated device).
        skipped: placed tensors left on the host: no slot in the model, or loaded larger than
            the file bytes the budget charged (their bytes stay reserved, unused).
    """

    device: torch.device
    placement: Placement
    ffn: HybridFFN
    dense_bytes: int
    hot_bytes: int
    kv_bytes: int
    index_bytes: int
    host_mapped_bytes: int
    host_anon_bytes: int
    skipped: tuple[str, ...] = ()

    @property
    def emulated(self) -> bool:
        """The accelerator is the CPU itself (for tests and demos)."""
        return self.device.type == "cpu"

    @property
    def device_bytes(self) -> int:
        """Budgeted bytes on the device: dense + hot rows + KV reservation."""
        return self.dense_bytes + self.hot_bytes + self.kv_bytes

    def summary(self) -> str:
        """The placement table plus the measured device and host bytes."""
        name = f"{self.device} (emulated accelerator)" if self.emulated else str(self.device)
        lines = [self.placement.summary(name)]
        f = fmt_bytes
        lines.append(
            f"  on device: dense {f(self.dense_bytes)}, hot rows {f(self.hot_bytes)}, KV "
            f"{f(self.kv_bytes)} (total {f(self.device_bytes)}); row indexes "
            f"{f(self.index_bytes)} outside the budget"
        )
        host = self.host_mapped_bytes + self.host_anon_bytes
        lines.append(
            f"  host weights: {f(host)}: {f(self.host_mapped_bytes)} file-mapped, "
            f"{f(self.host_anon_bytes)} anonymous (hot rows stay in the file-mapped host "
            f"matrices, unread by decode)"
        )
        if self.emulated:
            lines.append(
                "  emulated: dense tensors are not copied; the hot-row copies are extra host RAM"
            )
        if self.skipped:
            lines.append(f"  left on the host (reserved, unused): {', '.join(self.skipped)}")
        return "\n".join(lines)


def _slots(model: Model) -> dict[str, tuple[Any, str]]:
    """GGUF tensor name -> (object, attribute) holding it in the model's weights."""
    w = model.weights
    slots: dict[str, tuple[Any, str]] = {
        Names.TOKEN_EMBD: (w, "token_embd"),
        Names.OUTPUT_NORM: (w, "output_norm"),
        Names.OUTPUT: (w, "output"),
    }
    fields = {f.name for f in dataclasses.fields(Block)}
    templates = [t for k, t in vars(Names).items() if k.isupper() and t.startswith("blk.{l}.")]
    for layer, blk in enumerate(w.blk):
        for template in templates:
            attr = template.split(".")[2]  # blk.{l}.<attr>.weight: attributes are GGUF names
            if attr in fields and getattr(blk, attr) is not None:
                slots[template.format(l=layer)] = (blk, attr)
    return slots


def _nbytes(t: Tensor | Weight) -> int:
    return t.numel() * t.element_size() if isinstance(t, Tensor) else t.nbytes


def _storage(t: Tensor | Weight) -> Tensor:
    if isinstance(t, Tensor):
        return t
    return t.w if hasattr(t, "w") else t.raw  # DenseWeight.w / QuantWeight.raw


def _host_bytes(model: Model, gf: GGUFFile | None, extra: list[Tensor]) -> tuple[int, int]:
    """(memory-mapped, anonymous) bytes of the host-resident weights."""
    mapped = anon = 0
    seen: set[int] = set()
    items = [(name, getattr(o, a)) for name, (o, a) in _slots(model).items()]
    items += [(None, t) for t in extra]
    for name, obj in items:
        t = _storage(obj)
        if t.device.type != "cpu" or t.data_ptr() in seen or t.numel() == 0:
            continue
        seen.add(t.data_ptr())
        nb = _nbytes(t)
        file_ptr = None
        if gf is not None and name is not None and name in gf.tensors and not gf.closed:
            file_ptr = gf.raw(name).ctypes.data
        if file_ptr == t.data_ptr():
            mapped += nb
        else:
            anon += nb
    return mapped, anon


def build_hybrid(
    llm_or_model: LLM | Model,
    placement: Placement,
    device: str | torch.device,
    *,
    hot_mode: str = "auto",
) -> HybridRuntime:
    """Apply a placement: move dense tensors and hot rows to ``device``, install HybridFFN.

    The model is changed in place (its placed tensors are replaced by device copies, so the
    host mappings of those tensors are released). Calling it twice on one model is an error.

    Args:
        llm_or_model: a loaded ``LLM`` (preferred: its file lets the summary tell memory-mapped
            from anonymous host bytes) or a bare ``Model``.
        placement: from ``Placement.for_model`` / ``resolve_placement``.
        device: ``"cuda[:N]"`` or ``"cpu"`` (emulated accelerator, same accounting).
        hot_mode: ``"auto"``, ``"dense"`` or ``"gated"`` hot-row pass (see :class:`HybridFFN`).

    Returns:
        A :class:`HybridRuntime` with measured byte counts.

    Raises:
        ValueError: the placement does not match the model, the model is already hybrid, or hot
            FFN rows are larger as loaded than the file rows the budget charged (e.g. loaded
            with ``weight_format="f32"``).
    """
    model: Model = getattr(llm_or_model, "model", llm_or_model)
    gf = getattr(llm_or_model, "file", None)
    a = model.args
    dev = accelerator(device)
    assert dev is not None
    if isinstance(model.ffn_runner, HybridFFN):
        raise ValueError("the model is already hybrid; load it again to apply another placement")
    if (placement.n_layer, placement.n_ff) != (a.n_layer, a.n_ff):
        raise ValueError(
            f"the placement is for {placement.n_layer} layers of {placement.n_ff} neurons, the "
            f"model has {a.n_layer} layers of {a.n_ff}"
        )
    slots = _slots(model)
    file_bytes = {e.name: e.nbytes for e in placement.plan.entries}

    # Check every size first, so a refusal leaves the model untouched. A dense tensor loaded
    # larger than the file bytes it was charged (dequantized at load) stays on the host.
    moves, skipped = [], []
    for name in placement.gpu_tensors:
        if name not in slots:
            skipped.append(name)
            continue
        obj, attr = slots[name]
        nb = _nbytes(getattr(obj, attr))
        if nb > file_bytes[name]:
            logger.warning(
                "%s takes %d bytes as loaded but the budget charged its %d file bytes: it stays "
                "on the host",
                name,
                nb,
                file_bytes[name],
            )
            skipped.append(name)
            continue
        moves.append((obj, attr))
    for layer, (lp, blk) in enumerate(zip(placement.layers, model.weights.blk, strict=True)):
        mats = (blk.ffn_gate, blk.ffn_up, blk.ffn_down_t)
        nb = sum(m.nbytes // a.n_ff for m in mats) * lp.k
        if nb > lp.hot_bytes:
            raise ValueError(
                f"layer {layer}: {lp.k} hot rows take {nb} bytes as loaded but the budget charged "
                f"{lp.hot_bytes} at the file's dtype (FFN matrices dequantized at load); load "
                f"with weight_format='auto', or place without a GPU index"
            )
    if skipped:
        logger.warning("placed tensors %s stay on the host (bytes reserved, unused)", skipped)

    dense = 0
    for obj, attr in moves:
        moved = getattr(obj, attr).to(dev)
        setattr(obj, attr, moved)
        dense += _nbytes(moved)
    if placement.kv_on_gpu:
        model.kv_device = dev
        model.kv_dtype = torch.float16 if placement.kv_elem_bytes == 2 else torch.float32
        model.kv_max_ctx = placement.n_ctx

    layers: list[HotRows] = []
    extra_host: list[Tensor] = []
    for lp, blk in zip(placement.layers, model.weights.blk, strict=True):
        bucket = torch.from_numpy(lp.gpu_bucket.astype(np.int64))  # (k,)
        cold = torch.ones(a.n_ff, dtype=torch.bool)
        cold[bucket] = False
        hot = HotRows(lp.k, None, None, None, None, None, cold, cold.nonzero().squeeze(1))
        if lp.k:
            # take_rows copies raw rows on the host; .to() then moves them (a no-op for "cpu").
            hot.gate = blk.ffn_gate.take_rows(bucket).to(dev)
            hot.up = blk.ffn_up.take_rows(bucket).to(dev)
            hot.down_t = blk.ffn_down_t.take_rows(bucket).to(dev)
            hot.bucket = bucket.to(dev)
            hot.rows = torch.arange(lp.k, device=dev)
            if dev.type == "cpu":
                extra_host += [_storage(m) for m in (hot.gate, hot.up, hot.down_t)]
        layers.append(hot)
    ffn = HybridFFN(model, layers, dev, hot_mode)
    model.ffn_runner = ffn
    mapped, anon = _host_bytes(model, gf, extra_host)
    rt = HybridRuntime(
        device=dev,
        placement=placement,
        ffn=ffn,
        dense_bytes=dense,
        hot_bytes=sum(h.device_bytes for h in layers),
        kv_bytes=placement.kv_bytes,
        index_bytes=sum(h.index_bytes for h in layers),
        host_mapped_bytes=mapped,
        host_anon_bytes=anon,
        skipped=tuple(skipped),
    )
    assert rt.device_bytes <= placement.budget, (rt.device_bytes, placement.budget)
    logger.debug("hybrid runtime on %s: %d device bytes", dev, rt.device_bytes)
    return rt


def enable_hybrid(
    llm: LLM,
    vram_budget: float,
    *,
    device: str | torch.device | None = None,
    n_ctx: int | None = None,
    kv_elem_bytes: int = 2,
    reset_gpu_index: bool = False,
    disable_gpu_index: bool = False,
    activation_dir: str | os.PathLike[str] | None = None,
    capacity_mode: str = "exact",
) -> HybridRuntime | None:
    """Budget → placement (with the §10.3 index lifecycle) → ``build_hybrid``, in one call.

    Args:
        llm: a loaded PowerInfer (PWRI) model.
        vram_budget: GiB; negative means the free VRAM minus 256 MiB (CUDA only).
        device: ``"cuda[:N]"``, ``"cpu"`` (emulated accelerator) or None: CUDA when present,
            else nothing is placed (logged once) and None is returned.
        n_ctx: context the KV cache is reserved for (default ``min(2048, n_ctx_train)``, the
            ``gen-gpuidx`` default, so an index it wrote is reused).
        kv_elem_bytes: 2 (f16 cache on the device) or 4 (f32).
        reset_gpu_index: regenerate ``<model>.generated.gpuidx`` even if it could be reused.
        disable_gpu_index: no hot-neuron split (dense parts are still placed).
        activation_dir: statistics directory (default ``dirname(model)/activation``).
        capacity_mode: ``"exact"`` or ``"upstream"`` capacity formula for a generated index.

    Returns:
        The runtime, or None when running CPU-only.

    Raises:
        ValueError: a dense GGUF model, a bad budget, or an unavailable CUDA device.
    """
    dev = accelerator(device)
    if dev is None:
        return None
    budget = device_budget(vram_budget, dev)
    n_ctx = n_ctx or min(2048, llm.model.args.n_ctx_train)
    placement = resolve_placement(
        llm.file,
        budget,
        n_ctx=n_ctx,
        kv_elem_bytes=kv_elem_bytes,
        reset_gpu_index=reset_gpu_index,
        disable_gpu_index=disable_gpu_index,
        activation_dir=activation_dir,
        capacity_mode=capacity_mode,  # type: ignore[arg-type]
    )
    return build_hybrid(llm, placement, dev)
