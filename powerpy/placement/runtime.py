"""Apply a placement to a model: the only module that moves weights to the accelerator.

``build_hybrid(model, placement, accel)`` returns a new :class:`~powerpy.model.Model` whose

- placed dense tensors (attention, norms, predictors, output) are device copies, and whose new
  KV caches go to the device when the placement reserved room for them;
- layers carry compact copies of their hot rows ``W[gpu_bucket]`` of ffn_gate, ffn_up and
  ffn_down_t (raw ggml rows, quantized blocks intact) on the device. The host keeps its matrices
  as they are (memory-mapped from the file): the CPU reads only cold rows from them, so the hot
  rows cost file-backed page cache that decode never touches, not a second anonymous copy.

The split FFN itself is ``powerpy.model.split.ffn`` (docs/architecture.md#split-and-merge), the same
code that runs a CPU-only model. :func:`place` is the one entry point of the API and the CLI:
budget → placement (with the index lifecycle) → ``build_hybrid``. The accelerator may be
``"cpu"``: an emulated device with the same budget accounting and the same split/merge code, so
CI tests it without a GPU::

    llm = powerpy.load("model.powerinfer.gguf", vram_budget=8.0)  # CUDA if present
    print(llm.runtime.summary())  # llm.runtime is None when running CPU-only
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from powerpy._fs import fmt_bytes
from powerpy.errors import PlacementError
from powerpy.model.cache import KVPlacement
from powerpy.model.device import Accelerator
from powerpy.model.matrices import Weight
from powerpy.model.split import HotRows
from powerpy.model.transformer import Model
from powerpy.model.weights import Weights
from powerpy.placement.budget import budget_bytes
from powerpy.placement.copies import expert_hot, ggml_type, hot_rows, stack_qkv, to_device
from powerpy.placement.experts import cpu_moe_index, down_element_bytes
from powerpy.placement.lifecycle import resolve_placement
from powerpy.placement.placement import Placement
from powerpy.placement.reserve import DeviceReserve, device_budget
from powerpy.placement.slots import get_slot, set_slot, weight_slots

if TYPE_CHECKING:
    from powerpy.formats.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)

__all__ = ["HybridRuntime", "build_hybrid", "place"]


@dataclass
class HybridRuntime:
    """A model with a placement applied, and the bytes it measured.

    Attributes:
        model: the hybrid model (use it instead of the CPU-only one it was built from).
        accel: the accelerator (``cpu`` = emulated).
        placement: the placement applied.
        dense_bytes: bytes of the dense tensors now on the device.
        hot_bytes: bytes of the compact hot rows on the device.
        kv_bytes: bytes of the device's KV pool, ``placement.n_ctx`` positions of all sessions
            together (allocated with the first cache; 0 when caches stay on the host).
        index_bytes: the per-layer bucket/row index vectors on the device (workspace, outside
            the budget like upstream's ``gpu_bucket``: 16 bytes per hot neuron).
        host_file_bytes: host weight bytes that are the model file's own bytes (mapped, or
            read into memory by ``load``).
        host_anon_bytes: host weight bytes made at load (dequantized, or the hot-row copies of
            the emulated device).
        skipped: placed tensors left on the host: no slot in the model, or loaded larger than
            the file bytes the budget charged (their bytes stay reserved, unused).
    """

    model: Model
    accel: Accelerator
    placement: Placement
    dense_bytes: int
    hot_bytes: int
    kv_bytes: int
    index_bytes: int
    host_file_bytes: int
    host_anon_bytes: int
    skipped: tuple[str, ...] = ()
    reserve_line: str | None = None  # how the budget kept back the device's own needs

    @property
    def device(self) -> torch.device:
        return self.accel.device

    @property
    def device_bytes(self) -> int:
        """Budgeted bytes on the device: dense + hot rows + KV reservation."""
        return self.dense_bytes + self.hot_bytes + self.kv_bytes

    def summary(self) -> str:
        """The placement's summary (the one ``gen-gpuidx`` prints) plus the measured bytes."""
        name = f"{self.device} (emulated accelerator)" if self.accel.emulated else str(self.device)
        f = fmt_bytes
        host = self.host_file_bytes + self.host_anon_bytes
        lines = [
            self.placement.summary(name),
            f"  measured on device: dense {f(self.dense_bytes)}, hot rows {f(self.hot_bytes)}, "
            f"KV {f(self.kv_bytes)} (total {f(self.device_bytes)}); row indexes "
            f"{f(self.index_bytes)} outside the budget",
            f"  host weights: {f(host)}: {f(self.host_file_bytes)} file data, "
            f"{f(self.host_anon_bytes)} made at load",
        ]
        if self.reserve_line:
            lines.append(f"  {self.reserve_line}")
        if self.skipped:
            lines.append(f"  left on the host (reserved, unused): {', '.join(self.skipped)}")
        return "\n".join(lines)


def _storage(t: Tensor | Weight) -> Tensor:
    return t if isinstance(t, Tensor) else t.storage


def _nbytes(t: Tensor | Weight) -> int:
    s = _storage(t)
    return s.numel() * s.element_size()


def _host_bytes(
    weights: Weights, gf: GGUFFile | None, extra: list[Tensor], fam=None
) -> tuple[int, int]:
    """(file data, made at load) bytes of the host-resident weights (``fam``: as
    ``weight_slots``)."""
    mapped = anon = 0
    seen: set[int] = set()
    items = [
        (name, get_slot(o, a)) for name, sl in weight_slots(weights, fam).items() for o, a in sl
    ]
    items += [(None, t) for t in extra]
    for name, obj in items:
        t = _storage(obj)
        if t.device.type != "cpu" or t.data_ptr() in seen or t.numel() == 0:
            continue
        seen.add(t.data_ptr())
        file_ptr = None
        if gf is not None and name is not None and name in gf.tensors and not gf.closed:
            file_ptr = gf.raw(name).ctypes.data
        if file_ptr == t.data_ptr():
            mapped += _nbytes(t)
        else:
            anon += _nbytes(t)
    return mapped, anon


def build_hybrid(
    model: Model,
    placement: Placement,
    accel: Accelerator | str | torch.device,
    *,
    file: GGUFFile | None = None,
) -> HybridRuntime:
    """Apply a placement: a new model with dense tensors and hot rows on the accelerator.

    ``model`` itself is not changed (its host tensors are shared with the new model); drop it
    to release the host mappings of the tensors that moved.

    Args:
        model: a CPU-only model.
        placement: from ``Placement.for_model`` / ``resolve_placement``.
        accel: the accelerator, or a device name (``"cuda[:N]"``, ``"cpu"`` = emulated).
        file: the model's open file, so the summary can tell memory-mapped from anonymous bytes.

    Returns:
        A :class:`HybridRuntime` holding the new model and measured byte counts.

    Raises:
        ValueError: the placement does not match the model, the model is already hybrid, or hot
            FFN rows are larger as loaded than the file rows the budget charged (e.g. loaded
            with ``weight_format="f32"``).
    """
    a = model.args
    if not isinstance(accel, Accelerator):
        accel = Accelerator.choose(accel)
        assert accel is not None
    if model.accel is not None:
        raise ValueError("the model is already hybrid; apply placements to a CPU-only model")
    if (placement.n_layer, placement.n_ff) != (a.n_layer, a.ffn_neurons):
        raise PlacementError(
            f"the placement is for {placement.n_layer} layers of {placement.n_ff} neurons, the "
            f"model has {a.n_layer} layers of {a.ffn_neurons}"
        )
    # Shallow copies: the new model's slots are replaced, the old model keeps its own.
    w = model.weights
    blocks = [
        dataclasses.replace(
            b,
            moe=b.moe and dataclasses.replace(b.moe),
            mla=b.mla and dataclasses.replace(b.mla, k_b=list(b.mla.k_b), v_b=list(b.mla.v_b)),
        )
        for b in w.blk
    ]
    weights = dataclasses.replace(w, blk=blocks)
    slots = weight_slots(weights, a.family)
    file_bytes = {e.name: e.nbytes for e in placement.plan.entries}

    # Check every size first, so a refusal changes nothing. A dense tensor loaded larger than
    # the file bytes it was charged (dequantized at load) stays on the host.
    moves, skipped = [], []
    for name in placement.gpu_tensors:
        if name not in slots:
            skipped.append(name)
            continue
        nb = sum(_nbytes(get_slot(obj, attr)) for obj, attr in slots[name])
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
        moves += slots[name]
    for layer, (lp, blk) in enumerate(zip(placement.layers, weights.blk, strict=True)):
        mats = [m for m in (blk.ffn_gate, blk.ffn_up, blk.ffn_down_t) if m is not None]
        nb = sum(m.nbytes // a.n_ff for m in mats) * lp.k
        if blk.moe is not None:  # gate and up rows as loaded, down columns as placed
            ex = blk.moe
            down = down_element_bytes(ggml_type(ex.down)) * ex.n_embd
            nb = ((ex.gate.nbytes + ex.up.nbytes) // ex.n_neurons + down) * lp.k
        if nb > lp.hot_bytes:
            raise PlacementError(
                f"layer {layer}: {lp.k} hot rows take {nb} bytes as loaded but the budget charged "
                f"{lp.hot_bytes} at the file's dtype (FFN matrices dequantized at load); load "
                f"with weight_format='auto', or place without a GPU index"
            )
    if skipped:
        logger.warning("placed tensors %s stay on the host (bytes reserved, unused)", skipped)

    dense = 0
    for obj, attr in moves:
        moved = to_device(accel, get_slot(obj, attr))
        set_slot(obj, attr, moved)
        dense += _nbytes(moved)
    for blk in weights.blk:  # a placed router's biases go with it (the plan charges them)
        if blk.moe is not None and accel.holds(_storage(blk.moe.router)):
            blk.moe.routing = blk.moe.routing.moved(accel.to_device)
            dense += sum(
                _nbytes(b)
                for b in (blk.moe.routing.probs_b, blk.moe.routing.router_b)
                if b is not None
            )
    for blk in weights.blk:
        stack_qkv(accel, blk)
    kv = None
    if placement.kv_on_gpu:
        kv = KVPlacement(
            torch.float16 if placement.kv_elem_bytes == 2 else torch.float32, placement.n_ctx
        )  # positions of all sessions together

    hot_bytes = index_bytes = 0
    extra_host: list[Tensor] = []
    for lp, blk in zip(placement.layers, weights.blk, strict=True):
        if not lp.k:
            continue
        bucket = torch.from_numpy(lp.gpu_bucket.astype(np.int64))  # (k,)
        if blk.moe is not None:
            blk.moe.hot = expert_hot(accel, blk.moe, bucket)
            hot_bytes += blk.moe.hot.device_bytes
            index_bytes += blk.moe.hot.index_bytes
            if accel.emulated:
                extra_host += [
                    m.storage for m in (blk.moe.hot.gate, blk.moe.hot.up, blk.moe.hot.down_t)
                ]
            continue
        cold = torch.ones(a.n_ff, dtype=torch.bool)
        cold[bucket] = False
        # the accelerator moves the rows ("cpu": kept as copied)
        gate, up, down_t, gate_up = hot_rows(
            accel, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, bucket
        )
        blk.hot = HotRows(
            lp.k,
            gate,
            up,
            down_t,
            accel.to_device(bucket),
            cold,
            cold.nonzero().squeeze(1),
            None if blk.down_tau is None else accel.to_device(blk.down_tau[bucket]),
            gate_up,
        )
        hot_bytes += blk.hot.device_bytes
        index_bytes += blk.hot.index_bytes
        if accel.emulated:
            extra_host += [m.storage for m in (gate, up, down_t) if m is not None]
    hybrid = Model(a, weights, accel=accel, kv=kv, cache_dtype=model.cache_dtype)
    mapped, anon = _host_bytes(weights, file, extra_host, a.family)
    rt = HybridRuntime(
        model=hybrid,
        accel=accel,
        placement=placement,
        dense_bytes=dense,
        hot_bytes=hot_bytes,
        kv_bytes=placement.kv_bytes,
        index_bytes=index_bytes,
        host_file_bytes=mapped,
        host_anon_bytes=anon,
        skipped=tuple(skipped),
    )
    assert rt.device_bytes <= placement.budget, (rt.device_bytes, placement.budget)
    logger.debug("hybrid runtime on %s: %d device bytes", accel.device, rt.device_bytes)
    return rt


def place(
    model: Model,
    file: GGUFFile,
    vram_budget: float,
    *,
    device: str | torch.device | Accelerator | None = None,
    n_ctx: int | None = None,
    kv_elem_bytes: int = 2,
    reset_gpu_index: bool = False,
    disable_gpu_index: bool = False,
    activation_dir: str | os.PathLike[str] | None = None,
    capacity_mode: str = "exact",
    index_path: str | os.PathLike[str] | None = None,
    n_cpu_moe: int | None = None,
) -> HybridRuntime | None:
    """Budget → placement (with the index lifecycle) → ``build_hybrid``, in one call.

    The one entry point of ``powerpy.load(vram_budget=)`` and ``powerpy infer --vram-budget``.

    Args:
        model: a CPU-only PowerInfer (PWRI) model.
        file: its open file (the header drives the placement).
        vram_budget: GiB of placed bytes; negative means the free VRAM minus 256 MiB and the
            reserve (CUDA only).
        device: ``"cuda[:N]"``, ``"cpu"`` (emulated accelerator), an ``Accelerator``, or None:
            CUDA when present, else nothing is placed (logged once) and None is returned.
        n_ctx: positions the device KV caches are reserved for, all sessions together (default
            ``ModelArgs.default_n_ctx``, as ``gen-gpuidx`` and ``new_cache``, so an index it
            wrote is reused). On a real device, the placement plus
            ``DeviceReserve.for_model`` (cuBLAS workspaces, per-step temporaries) must fit the
            free memory: a larger budget is clamped, with a warning.
        kv_elem_bytes: 2 (f16 cache on the device) or 4 (f32).
        reset_gpu_index: regenerate ``<model>.generated.gpuidx`` even if it could be reused.
        disable_gpu_index: no hot-neuron split (dense parts are still placed).
        activation_dir: statistics directory (default ``dirname(model)/activation``).
        capacity_mode: ``"exact"`` or ``"upstream"`` capacity formula for a generated index.
        index_path: the GPU index (default ``<model>.generated.gpuidx``; a pipeline stage's is
            its own, ``powerpy.model.stage.stage_index_path``).
        n_cpu_moe: a mixture of experts placed as llama.cpp's ``--n-cpu-moe N`` does: the
            experts of the first N layers on the CPU, the others' whole on the device
            (``placement.experts.cpu_moe_index``; n_layer: ``--cpu-moe``), not by statistics.
            Rows past the budget stay on the CPU (a warning says how many).

    Returns:
        The runtime (its ``model`` replaces ``model``), or None when running CPU-only.

    Raises:
        ValueError: a dense GGUF model, a bad budget, or an unavailable CUDA device.
    """
    accel = device if isinstance(device, Accelerator) else Accelerator.choose(device)
    if accel is None:
        return None
    budget = budget_bytes(vram_budget, accel.free_memory())
    n_ctx = n_ctx or model.args.default_n_ctx
    reserve_line = None
    if not accel.emulated:  # a real device also needs its workspaces and temporaries
        reserve = DeviceReserve.for_model(model.args, n_ctx)
        if vram_budget < 0:
            budget = max(0, budget - reserve.total)
        budget, reserve_line = device_budget(budget, reserve, accel.free_memory())
    if n_cpu_moe is not None:
        index = cpu_moe_index(model.args, n_cpu_moe)
        placement = Placement.for_model(
            file, budget, index, n_ctx=n_ctx, kv_elem_bytes=kv_elem_bytes
        )
    else:
        placement = resolve_placement(
            file,
            budget,
            n_ctx=n_ctx,
            kv_elem_bytes=kv_elem_bytes,
            reset_gpu_index=reset_gpu_index,
            disable_gpu_index=disable_gpu_index,
            activation_dir=activation_dir,
            capacity_mode=capacity_mode,  # type: ignore[arg-type]
            index_path=index_path,
        )
    rt = build_hybrid(model, placement, accel, file=file)
    rt.reserve_line = reserve_line
    return rt
