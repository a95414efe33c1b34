"""A layer's FFN split between the accelerator and the host: its hot rows (``HotRows``) on the
device, the selected cold rows on the host, the outputs added
(docs/architecture.md#split-and-merge). ``ffn`` is the torch path's one entry: the predictor's
mask, then :func:`split_ffn`. A CPU-only model is the same split with no hot rows.

:func:`run_split` is the one runner of every hot/cold split, the FFN's and a mixture of
experts' (``moe.moe_ffn``): a selector (the predictor's mask, the router's choice, or nothing
under a cut) has picked the rows; the hot part is queued on the device's side stream, the host
waits once for the input and the selector, computes the cold part, and the two are added."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from powerpy.config import FFNVariant
from powerpy.model import gpu_kernels
from powerpy.model.device import HOST, Accelerator, move
from powerpy.model.ffn import (
    _rows_cut,
    cut,
    ffn_cut,
    ffn_dense,
    ffn_masked,
    ffn_rows,
    ffn_union,
    gate_linear,
    glu,
    glu_rows,
    predict,
    scaled_cut,
)
from powerpy.model.gpu_kernels import DeviceQuantWeight
from powerpy.model.matrices import Weight
from powerpy.model.options import SPARSE, RunOptions
from powerpy.model.timing import phase


@dataclass
class HotRows:
    """One layer's split: compact hot rows on the accelerator, the cold set on the host.

    Attributes:
        k: neurons on the accelerator (> 0).
        gate, up, down_t: ``(k, n_embd)`` compact rows ``W[bucket]`` on the device (gate None
            for an ungated FFN).
        bucket: ``(k,)`` int64 on the device: the neuron id of each compact row.
        cold: ``(n_ff,)`` bool on the host, True where the neuron stays on the CPU.
        cold_idx: ``(n_ff - k,)`` int64 on the host, the cold neuron ids.
        tau: ``(k,)`` f32 on the device, the layer's cut of each compact row, or None.
        gate_up: ``(2k, n_embd)``, the gate rows then the up rows in one matrix, when the
            fused kernels run them (``gate`` and ``up`` are its halves; an ungated FFN's is
            ``up`` itself); else None.
    """

    k: int
    gate: Weight | None
    up: Weight
    down_t: Weight
    bucket: Tensor
    cold: Tensor
    cold_idx: Tensor
    tau: Tensor | None = None
    gate_up: DeviceQuantWeight | None = None

    @property
    def device_bytes(self) -> int:
        mats = (self.gate, self.up, self.down_t)
        return sum(m.nbytes for m in mats if m is not None)

    @property
    def index_bytes(self) -> int:
        return self.bucket.numel() * self.bucket.element_size()


def ffn(
    l: int,
    blk,
    x: Tensor,
    ffn_inp: Tensor,
    variant: FFNVariant,
    threshold: float,
    opts: RunOptions,
    accel: Accelerator | None,
    *,
    union: bool = False,
    cold=None,
) -> Tensor:
    """The block's FFN: the predictor's mask, then :func:`split_ffn` (the torch path's one
    entry; a one-token step on the host takes the native block, :func:`fused_decode`).

    Args:
        l: layer, for the statistics and the observer.
        blk: the layer's weights (``powerpy.model.weights.Block``): host FFN matrices,
            predictor ``fc1``/``fc2`` where placed, ``hot`` rows or None.
        x: (T, n_embd) normed FFN input; ffn_inp: (T, n_embd) its pre-norm value.
        variant: the FFN activation.
        threshold: the predictor cut.
        opts: run options (sparse or dense, observer, timer, statistics).
        accel: the accelerator holding ``blk.hot`` and placed tensors (None: CPU-only).
        union: the T tokens are sessions' decode steps (``Model.decode_batch``'s "union"
            mode): a gated layer without hot rows or a cut reads the union of their active
            rows once, masked per token.
        cold: a decode plan's cold tasks (``host_tasks.ColdTasks``): the layer's host rows
            run as host functions of the device's stream, not after a host wait.

    Returns:
        (T, n_embd) f32 on x's device.
    """
    act = None
    if blk.gates(opts):
        with phase(opts.timer, "predictor"):
            act = predict(ffn_inp, blk.fc1, blk.fc2, accel) >= threshold  # (T, n_ff) bool
    elif blk.cut(opts) is None and opts.sparse and blk.fc1 is not None and opts.oracle is None:
        if opts.stats is not None:
            opts.stats.record_dense(l, x.shape[0])  # an ungated layer computes every neuron
    plain = opts.observer is None and opts.oracle is None
    if union and act is not None and plain and blk.hot is None and blk.cut(opts) is None:
        act = move(accel, act, HOST)
        if opts.stats is not None:
            opts.stats.record(l, act)
        return ffn_union(x, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant, act)
    if plain:
        return split_ffn(blk, x, act, variant, accel, l=l, opts=opts, cold=cold)
    # Profiling or an oracle: the true activation of every neuron, from the host matrices.
    x_host = move(accel, x, HOST)
    h = glu(gate_linear(blk.ffn_gate, x_host), blk.ffn_up.linear(x_host), variant)  # (T, n_ff)
    act_host = None if act is None else move(accel, act, HOST)
    if opts.oracle is not None:
        act_host = opts.oracle(l, h)  # (T, n_ff) bool
    if act_host is not None and opts.stats is not None:
        opts.stats.record(l, act_host)
    if opts.observer is not None:
        opts.observer(l, move(accel, ffn_inp, HOST), h)
    y = blk.ffn_down_t.rows_sum(h if act_host is None else h * act_host)
    return move(accel, y, x.device)


def split_ffn(
    blk,
    x: Tensor,
    act: Tensor | None,
    variant: FFNVariant,
    accel: Accelerator | None,
    *,
    l: int = 0,
    opts: RunOptions = SPARSE,
    cold=None,
) -> Tensor:
    """The FFN for a given mask: hot rows on the accelerator plus the predicted-active cold rows
    on the host (every row is cold when ``blk.hot`` is None), outputs added
    (docs/architecture.md#split-and-merge). With ``cold`` (a plan's ``host_tasks.ColdTasks``
    holding this layer) the host rows are a task the device's stream submits and waits for.

    Args:
        blk: the layer's weights (host FFN matrices and ``hot`` rows or None).
        x: (T, n_embd) normed FFN input, on any device.
        act: (T, n_ff) bool predicted-active mask (any device), or None for dense.
        variant: the FFN activation.
        accel: the accelerator holding ``blk.hot`` (None: CPU-only).
        l, opts: layer and options for the statistics and the timer.

    Returns:
        (T, n_embd) f32 on x's device.
    """
    hot: HotRows | None = blk.hot
    tau = blk.cut(opts)  # (n_ff,) on the host, or None
    if cold is not None and l in cold.layers:  # a plan's step: host functions, no host wait
        assert accel is not None
        x_dev, act_dev = accel.move(x, accel.device), act
        if act_dev is not None and opts.stats is not None:
            opts.stats.record(l, act_dev)  # a hybrid counts the predicted rows
        hot_tau = None if hot is None else scaled_cut(hot.tau, opts)

        def hot_part():
            return (
                None
                if hot is None
                else _hot(hot, x_dev, act_dev, variant, accel.gather_hot, hot_tau)
            )

        with phase(opts.timer, "ffn_split"):
            return move(accel, cold.run(l, x_dev, act_dev, hot_part), x.device)
    if hot is not None and hot.cold_idx.numel() == 0:  # every row hot: no host part, no wait
        assert accel is not None
        x_dev = accel.move(x, accel.device)
        act_dev = None if act is None else accel.move(act, accel.device)
        tau_dev = scaled_cut(hot.tau, opts)
        with phase(opts.timer, "ffn_hot"):
            h = _hot_h(hot, x_dev, act_dev, variant, tau_dev)  # (T, k): compact rows' neurons
            if h is None:
                y = _hot(hot, x_dev, act_dev, variant, accel.gather_hot, tau_dev)
            else:
                y = hot.down_t.rows_sum(h)
        if opts.stats is not None and h is not None and tau_dev is not None:
            opts.stats.record(l, h != 0)  # neurons predicted and not cut, as the host counts
        elif opts.stats is not None and act_dev is not None:
            opts.stats.record(l, act_dev)
        return move(accel, y, x.device)
    sel = [] if act is None else [act]
    if hot is None and tau is not None:  # CPU-only with a cut: count the rows really added

        def cold_cut(x_host: Tensor, sel_host: list[Tensor]) -> Tensor:
            act_host = sel_host[0] if sel_host else None
            y, kept = ffn_cut(
                x_host, blk.ffn_gate, blk.ffn_up, blk.ffn_down_t, variant, act_host, tau
            )
            if opts.stats is not None:
                opts.stats.record_counts(l, kept)
            return y

        return run_split(accel, x, sel, None, cold_cut, opts)
    tau_dev = None if hot is None else scaled_cut(hot.tau, opts)  # (k,) on the device, or None

    def hot_part(x_dev: Tensor, sel_dev: list[Tensor]) -> Tensor:
        act_dev = sel_dev[0] if sel_dev else None
        return _hot(hot, x_dev, act_dev, variant, accel.gather_hot, tau_dev)

    def cold_part(x_host: Tensor, sel_host: list[Tensor]) -> Tensor:
        act_host = sel_host[0] if sel_host else None
        if act_host is not None and opts.stats is not None:
            opts.stats.record(l, act_host)  # a hybrid's statistics count the predicted rows
        return _cold(blk, hot, x_host, act_host, variant, tau)  # (T, n_embd) on the host

    return run_split(
        accel, x, sel, hot_part if hot is not None else None, cold_part, opts, keep=(tau_dev,)
    )


def run_split(
    accel: Accelerator | None,
    x: Tensor,
    sel: list[Tensor],
    hot: Callable[[Tensor, list[Tensor]], Tensor] | None,
    cold: Callable[[Tensor, list[Tensor]], Tensor],
    opts: RunOptions = SPARSE,
    *,
    keep: tuple[Tensor | None, ...] = (),
) -> Tensor:
    """One hot/cold split, whatever selected its rows (the FFN's and a mixture's).

    Args:
        accel: the accelerator holding the hot rows (None: CPU-only, ``hot`` None).
        x: (T, n_embd) the FFN input, on any device.
        sel: the selector's tensors (the predictor's (T, n_ff) mask; the router's (T, k) ids and
            weights; none), on any device.
        hot: ``hot(x, sel)`` on the device -> (T, n_embd) there, queued on the side stream (no
            host sync inside), or None without hot rows.
        cold: ``cold(x, sel)`` on the host -> (T, n_embd) f32 there.
        opts: for the timer (phases ``ffn_hot``, ``wait``, ``ffn_cold``).
        keep: other device tensors the hot part reads (kept allocated for the side stream).

    Returns:
        hot + cold, (T, n_embd) f32 on x's device. The host waits once, for x and the selector
        (not for the hot part); the main stream waits for the hot part, the host does not.
    """
    y_hot = None
    if hot is not None:
        assert accel is not None
        x_dev = accel.move(x, accel.device)
        sel_dev = [accel.move(t, accel.device) for t in sel]
        with accel.side_stream(x_dev, *sel_dev, *keep), phase(opts.timer, "ffn_hot"):
            y_hot = hot(x_dev, sel_dev)  # queued
    with phase(opts.timer if accel is not None else None, "wait"):
        x_host, *sel_host = _to_host(accel, [x, *sel])  # one wait, for the selector
    with phase(opts.timer if y_hot is not None else None, "ffn_cold"):
        y_cold = cold(x_host, sel_host)
    if y_hot is None:
        return move(accel, y_cold, x.device)
    accel.join(y_hot)  # the main stream waits for the hot part; the host does not
    if y_hot.device == x.device:
        return y_hot + accel.move(y_cold, x.device)
    return accel.move(y_hot, x.device) + y_cold


def _to_host(accel: Accelerator | None, ts: list[Tensor]) -> list[Tensor]:
    """The tensors on the host, with one wait for those on the device."""
    on_dev = [t for t in ts if t.device != HOST]
    if not on_dev:
        return ts
    assert accel is not None
    got = iter(accel.fetch(on_dev))
    return [next(got) if t.device != HOST else t for t in ts]


def _hot_h(
    hot: HotRows, x: Tensor, act: Tensor | None, variant: FFNVariant, tau: Tensor | None
) -> Tensor | None:
    """The fused kernels' activation of the hot rows: x (T, n_embd), act (T, n_ff) bool, tau
    (k,), on the device -> h (T, k), 0 where the predictor is off or the cut drops a neuron;
    None where the fused kernels do not run this layer."""
    if hot.gate_up is None or (hot.gate is not None and variant not in gpu_kernels.VARIANTS):
        return None
    gu = hot.gate_up.linear(x, act, hot.bucket)  # (T, 2k); 0 where the predictor is off
    if hot.gate is None:  # ungated: (T, k) up rows; act(0) = 0 keeps the mask
        return cut(glu(None, gu, variant, inplace=True), tau)
    return gpu_kernels.glu(gu, tau, variant)


def _hot(
    hot: HotRows,
    x: Tensor,
    act: Tensor | None,
    variant: FFNVariant,
    gather: bool,
    tau: Tensor | None,
) -> Tensor:
    # x (T, n_embd), act (T, n_ff) bool, tau (k,), all on the device -> (T, n_embd) f32 there
    h = _hot_h(hot, x, act, variant, tau)  # the fused kernels: three ops, no host round trip
    if h is not None:
        return hot.down_t.rows_sum(h)
    if gather and act is not None and x.shape[0] == 1:
        idx = act[0, hot.bucket].nonzero().squeeze(1)  # (r,) active compact rows: a host sync
        h = cut(glu_rows(x[0], hot.gate, hot.up, idx, variant), None if tau is None else tau[idx])
        return hot.down_t.gather_axpy(h, idx)[None]
    h = cut(glu(gate_linear(hot.gate, x), hot.up.linear(x), variant, inplace=True), tau)  # (T, k)
    if act is not None:
        h = h.mul_(act.index_select(1, hot.bucket))  # predictor gating, no host round trip
    return hot.down_t.rows_sum(h)


def _cold(
    blk, hot: HotRows | None, x: Tensor, act: Tensor | None, variant: FFNVariant, tau
) -> Tensor:
    # x (T, n_embd), act (T, n_ff) bool, tau (n_ff,) or None, all on the host -> (T, n_embd) f32
    gate, up, down_t = blk.ffn_gate, blk.ffn_up, blk.ffn_down_t
    if hot is None:  # every row is cold: the CPU-only FFN (without a cut)
        if act is None:
            return ffn_dense(x, gate, up, down_t, variant)
        if x.shape[0] == 1:
            idx = act[0].nonzero().squeeze(1)
            return ffn_rows(x[0], gate, up, down_t, variant, idx)[None]
        return ffn_masked(x, gate, up, down_t, variant, act)
    if x.shape[0] == 1:  # decode: only the predicted-active cold rows
        idx = hot.cold_idx if act is None else (act[0] & hot.cold).nonzero().squeeze(1)
        if tau is not None:
            return _rows_cut(x[0], gate, up, down_t, variant, idx, tau)[0][None]
        return ffn_rows(x[0], gate, up, down_t, variant, idx)[None]
    mask = hot.cold.expand(x.shape[0], -1) if act is None else act & hot.cold  # (T, n_ff)
    return ffn_union(x, gate, up, down_t, variant, mask, tau)
