"""What a device needs besides a placement's bytes: cuBLAS workspaces and per-step buffers.

``--vram-budget`` counts the placed bytes, as PowerInfer does (so ``gen-gpuidx`` writes
upstream's index). A real device also holds a :class:`DeviceReserve`; :func:`device_budget`
clamps a budget whose placement and reserve do not fit the free memory. Plain arithmetic over
model arguments, no torch (the numbers are the runtime's, named where they come from).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from powerpy.config import ModelArgs
from powerpy.placement.budget import MIB

logger = logging.getLogger(__name__)

WORKSPACE_PER_STREAM = 32 * MIB  # torch's cuBLAS workspace per (handle, stream) on sm90 and up
STREAMS = 2  # the main stream and the accelerator's one side stream
PREFILL_CHUNK = 512  # tokens per prefill forward (generate.py, the scheduler)
ROWS_SUM_SPLIT = 16  # the fused row sum's partial outputs (gpu_kernels.ROWS_SUM_SPLIT)


@dataclass(frozen=True)
class DeviceReserve:
    """Device bytes a hybrid run needs besides the placement (checked against free memory).

    Attributes:
        workspace: cuBLAS workspaces, :data:`WORKSPACE_PER_STREAM` for each stream used (the
            nominal sm90 size everywhere, so ``gen-gpuidx`` and ``infer`` agree without asking
            a device).
        temporaries: the largest per-step buffers, modelled: a prefill chunk's attention scores,
            projections (DeepSeek-2's latent heads too) and FFN activations, a mixture's
            routing, the row sum's partials, the decode attention's f32 copy of one layer's KV
            prefix (a latent cache: its one row of keys).
    """

    workspace: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.workspace + self.temporaries

    def describe(self) -> str:
        f = _mib
        return (
            f"the device also needs {f(self.total)} (cuBLAS workspaces "
            f"{f(self.workspace)}, per-step temporaries {f(self.temporaries)})"
        )

    @classmethod
    def for_model(cls, args: ModelArgs, n_ctx: int, n_batch: int = PREFILL_CHUNK) -> DeviceReserve:
        """The reserve of a model whose KV cache holds ``n_ctx`` positions."""
        e, f, g, b = args.n_embd, args.n_ff, args.n_embd_gqa, n_batch
        scores = b * args.n_head * n_ctx * 4 + b * n_ctx  # f32 scores and the causal mask
        proj = b * (e + args.n_embd_q + 2 * g) * 4 * 2  # q, k, v, attention out, (and copies)
        if args.kv_lora_rank:  # MLA: q, the absorbed queries, the heads' latent outputs, v
            r = args.kv_lora_rank
            heads = args.n_embd_mla_q + args.n_head * (2 * (r + args.n_rot) + r)
            proj += b * (heads + args.n_embd_mla_v) * 4
        ffn = b * f * (4 * 4 + 1)  # predictor logits, stacked gate/up (2), h; the mask
        router = b * args.n_expert * 4 * 3  # a mixture's logits, probabilities, selection
        rows = ROWS_SUM_SPLIT * b * e * 4  # the row sum's partials
        kv = (1 if args.kv_lora_rank else 2) * n_ctx * g * 4  # decode: a layer's cache as f32
        logits = b * args.n_vocab * 4
        temps = scores + proj + ffn + router + rows + kv + logits
        return cls(WORKSPACE_PER_STREAM * STREAMS, temps)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


def device_budget(budget: int, reserve: DeviceReserve, free_vram: int | None) -> tuple[int, str]:
    """The bytes a placement may fill on a device with ``free_vram`` free (None: unknown).

    ``--vram-budget`` is the placement's bytes, as PowerInfer counts it (so ``gen-gpuidx``
    writes upstream's index); the device needs ``reserve`` on top. A budget whose placement and
    reserve do not fit the free memory is clamped to what does, with a warning.

    Returns:
        (bytes, a line that says what is kept back and whether the budget was clamped).
    """
    line = reserve.describe()
    if free_vram is not None and budget + reserve.total > free_vram:
        fits = max(0, free_vram - reserve.total)
        logger.warning(
            "--vram-budget %s and the %s the device needs besides do not fit the %s free: "
            "placing %s",
            _mib(budget),
            _mib(reserve.total),
            _mib(free_vram),
            _mib(fits),
        )
        line += f"; the budget was clamped to {_mib(fits)} ({_mib(free_vram)} free)"
        budget = fits
    return budget, line
