"""The notebook-facing API: ``load`` a file, then generate, stream, chat or score text.

``LLM`` is the only object that knows the model, its tokenizer and its file together; the layers
below it (``generate``, ``chat``, ``bench``, the pipeline) take a model and a tokenizer.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from powerpy.chat import ChatSession, Message, encode_chat
from powerpy.config import ModelArgs
from powerpy.errors import TokenizerError
from powerpy.formats.gguf_reader import GGUFFile, check_tensor_sizes, read_gguf
from powerpy.generate import Response, generate, stream_generate
from powerpy.model import numerics, stack_decode
from powerpy.model.loader import load_weights
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions, SparsityStats
from powerpy.model.stage import stage_activations, stage_file, stage_index_path
from powerpy.model.transformer import Model
from powerpy.sampling import SamplingParams
from powerpy.tokenizer import Tokenizer

if TYPE_CHECKING:
    from powerpy.placement.runtime import HybridRuntime

log = logging.getLogger(__name__)


@dataclass
class LLM:
    """A loaded model with its tokenizer. Keep it alive while its weights are in use: the
    weights are views of ``file``'s bytes (read into memory, or mapped with ``use_mmap``).

    Attributes:
        model: the model (args and weights; shared by every session).
        tokenizer: the file's tokenizer.
        file: the open file.
        path: its path.
        load_seconds: load time.
        options: the run options of this handle's own calls (``generate``, ``stream``,
            ``logits``, ``chat``); its ``stats`` collect their predicted sparsity.
        runtime: the hybrid placement applied at load, or None (CPU-only).
    """

    model: Model
    tokenizer: Tokenizer
    file: GGUFFile
    path: Path
    load_seconds: float = 0.0
    options: RunOptions = field(default_factory=RunOptions)
    runtime: HybridRuntime | None = None

    def tokenize(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` (special tokens parsed, BOS per the file)."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling) -> str:
        """Generated text; ``sampling`` takes the fields of ``SamplingParams``."""
        return generate(
            self.model,
            self.tokenizer,
            prompt,
            max_tokens,
            SamplingParams(**sampling),
            opts=self.options,
        )

    def stream(
        self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling
    ) -> Iterator[Response]:
        """Stream ``Response`` records; ``sampling`` takes the fields of ``SamplingParams``."""
        return stream_generate(
            self.model,
            self.tokenizer,
            prompt,
            max_tokens,
            SamplingParams(**sampling),
            opts=self.options,
        )

    def logits(
        self, prompt: str | Sequence[int], *, cache_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """Logits (T, n_vocab) f32 of every position of ``prompt`` in one fresh pass.

        ``cache_dtype``: the KV cache's type (default f16 on the host, as llama.cpp's;
        ``torch.float32`` keeps keys and values exact, for comparisons with f32 references)."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        cache = self.model.new_cache(len(ids), dtype=cache_dtype)
        tokens = torch.tensor(ids, dtype=torch.long)
        return self.model.forward(tokens, cache, self.options, all_logits=True)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
    ) -> str | list[int]:
        """A conversation as the model's chat prompt (its ``tokenizer.chat_template``).

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
            add_generation_prompt: end with the assistant's turn header.
            tokenize: return token ids (BOS added per the file, unless the template wrote it).

        Raises:
            ValueError: malformed messages or a failing template.
        """
        return encode_chat(
            self.tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            source=str(self.path),
        )

    def chat(self, messages: Sequence[Message], max_tokens: int = 256, **sampling) -> str:
        """The assistant's reply to a conversation (stops at the model's end-of-turn token)."""
        return "".join(r.text for r in self.stream_chat(messages, max_tokens, **sampling))

    def stream_chat(
        self, messages: Sequence[Message], max_tokens: int = 256, **sampling
    ) -> Iterator[Response]:
        """Stream the assistant's reply to a conversation as ``Response`` records."""
        ids = self.apply_chat_template(messages, tokenize=True)
        return self.stream(ids, max_tokens, **sampling)

    def chat_session(self, *, system: str | None = None, n_ctx: int | None = None) -> ChatSession:
        """A conversation that keeps its own KV cache between turns (see ``ChatSession``)."""
        return ChatSession(
            self.model,
            self.tokenizer,
            system=system,
            n_ctx=n_ctx,
            opts=self.options,
            source=str(self.path),
        )

    @property
    def sparsity(self) -> SparsityStats | None:
        """Per-layer predicted sparsity counters of this handle's calls so far (None: dense)."""
        return self.options.stats if self.options.sparse else None

    @property
    def name(self) -> str:
        """The model file's name without ``.gguf`` and ``.powerinfer`` (for titles)."""
        name = self.path.name.removesuffix(".gguf").removesuffix(".powerinfer")
        return name or self.path.name

    # --- display
    def __repr__(self) -> str:
        a = self.model.args
        mode = self.mode
        where = f", hybrid on {self.runtime.device}" if self.runtime is not None else ""
        return f"<LLM {self.name}: {a.arch}, {a.n_layer} layers, {mode}{where}>"

    @property
    def mode(self) -> str:
        """How this handle's calls run the FFN, in words: "dense", "sparse, threshold T", and
        where a file says so, the layers its predictors gate and the layers it cuts."""
        if not self.sparse_run:
            return "dense"
        blk, o = self.model.weights.blk, self.options
        gated = sum(b.sparse_layer for b in blk)
        cut = sum(b.down_tau is not None for b in blk) if o.cut_scale else 0
        parts = [f"threshold {o.threshold:g}"] if gated == len(blk) else []
        if 0 < gated < len(blk):
            parts.append(f"predictors in {gated} of {len(blk)} layers at threshold {o.threshold:g}")
        if cut:
            scale = f" x{o.cut_scale:g}" if o.cut_scale != 1 else ""
            parts.append(f"cut{scale} in {cut} of {len(blk)} layers")
        return "sparse, " + (", ".join(parts) or "every layer ungated")

    @property
    def sparse_run(self) -> bool:
        """This handle's calls run the predictors."""
        return self.options.sparse and self.model.can_gate

    def _repr_html_(self) -> str:
        from powerpy import _html
        from powerpy._fs import fmt_bytes

        a = self.model.args
        items = [
            ("file", str(self.path)),
            ("size", fmt_bytes(self.path.stat().st_size)),
            ("architecture", f"{a.arch}, {a.ffn_variant.value} FFN"),
            ("layers", a.n_layer),
            ("n_embd / n_ff", f"{a.n_embd} / {a.n_ff}"),
            ("heads (KV)", f"{a.n_head} ({a.n_head_kv})"),
            ("vocabulary", a.n_vocab),
            ("context (training)", a.n_ctx_train),
            ("mode", self.mode),
            (
                "placement",
                "CPU only" if self.runtime is None else f"hybrid on {self.runtime.device}",
            ),
            ("load time", f"{self.load_seconds:.2f} s"),
        ]
        return _html.pairs(self.name, items)


def load(
    path: str | Path | None = None,
    *,
    threshold: float | None = None,
    weight_format: str = "auto",
    progress: bool = False,
    vram_budget: float | None = None,
    device: str | None = None,
    n_ctx: int | None = None,
    ffn_act: str | None = None,
    dense: bool = False,
    cache_type: str = "f16",
    use_mmap: bool = False,
    cut_scale: float = 1.0,
    exact_activations: bool = False,
    native_kernels: bool = True,
    cuda_graphs: bool = True,
    defer_cold: bool = False,
    layers: range | None = None,
    **placement_options,
) -> LLM:
    """Load a GGUF (dense) or PWRI (sparse) model.

    Args:
        path: model file; None loads the default model (SmolLM2-135M-Instruct).
        threshold: predictor threshold; None: the file's ``powerinfer.sparse_threshold``,
            then 0.0 (PowerInfer's order; the command line's ``--sparse-threshold`` defaults to
            the environment variable ``LLAMA_SPARSE_PRED_THRESHOLD``).
        dense: run without the predictors (the dense FFN) by default.
        weight_format: "auto", "f32" or "raw" (see ``loader.load_weights``).
        progress: show a progress bar while loading.
        vram_budget: PWRI models and mixtures of experts: hybrid CPU-accelerator placement
            for this many GiB (``powerpy.placement.runtime.place``; its summary is
            ``llm.runtime.summary()``). The GPU index is reused or generated as in
            ``docs/architecture.md#index-lifecycle``.
        placement_options: further keywords of ``place`` (``reset_gpu_index``,
            ``disable_gpu_index``, ``activation_dir``, ``capacity_mode``, ``kv_elem_bytes``,
            ``n_cpu_moe``: a mixture's experts placed as llama.cpp's ``--n-cpu-moe``, within
            the free VRAM when ``vram_budget`` is None).
        device: the accelerator: "cuda[:N]", "cpu" (emulated) or None (CUDA when present,
            else CPU-only with ``llm.runtime`` None).
        n_ctx: positions the accelerator KV caches are reserved for (default
            ``ModelArgs.default_n_ctx``: the training context, at most 4096).
        ffn_act: "relu" or "silu" to override the FFN activation the file implies (a dense
            GGUF runs SiLU; a dense GGUF of a ReLU model needs "relu"). See
            ``ModelArgs.with_ffn_act``.
        cache_type: "f16" (default, llama.cpp's) or "f32": the type of host KV caches
            (``Model.new_cache``). With f16 and quantized activations, attention follows
            llama.cpp's numerics bit for bit (``powerpy.model.ggml_numerics``).
        use_mmap: map the file (llama.cpp's default) instead of reading it into memory. The
            default reads it into anonymous memory in 2 MiB transparent huge pages: sparse
            decode gathers scattered rows, and with 4 KiB file pages nearly every row costs a
            TLB miss (about 18% of decode speed on a 1B Q4_0 model). A file larger than the
            available memory is mapped anyway.
        cut_scale: scales the file's per-layer FFN cuts (``powerpy.ffn_down_threshold``) in
            sparse runs: 0 turns them off, larger values skip more down rows
            (``RunOptions.cut_scale``).
        exact_activations: keep f32 activations in quantized matmuls, float64 RoPE angles and
            torch's attention (default: llama.cpp's numerics; ``RunOptions.numerics``).
        native_kernels: compute with the native CPU kernels where they apply (False: torch's
            code paths only).
        cuda_graphs: replay a fully placed model's decode step as a captured graph (False: run
            the same step eagerly; ``RunOptions.graphs``).
        defer_cold: a hybrid decode step adds each layer's host rows to the residual stream a
            layer late, overlapping the CPU's part with the next layer's device work; it
            changes the computation (``RunOptions.defer_cold``).
        layers: load only these layers, as one stage of a model split by layer range
            (``powerpy.model.stage``; ``powerpy.cluster`` chains stages): the model then takes
            the residual stream instead of token ids unless it holds layer 0, and returns it
            instead of logits unless it holds the last layer. A stage maps its file (it reads
            only its layers' pages) and keeps its GPU index in
            ``<model>.layers-A-B.generated.gpuidx``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is malformed or not a supported model.
    """
    from powerpy.default_model import default_model_path

    RunOptions(cut_scale=cut_scale)  # its check, before the file is read
    if cache_type not in CACHE_TYPES:
        raise ValueError(
            f"cache type {cache_type!r} is not supported: use one of {list(CACHE_TYPES)}"
        )
    path = Path(path) if path is not None else default_model_path()
    t0 = time.perf_counter()
    gf = read_gguf(path, in_memory=not use_mmap and layers is None, progress=progress)
    check_tensor_sizes(gf)
    ends = (True, True)
    if layers is not None:
        gf = stage_file(gf, layers)
        ends = gf.ends
    args = ModelArgs.from_gguf(gf).with_ffn_act(ffn_act, source=str(path))
    try:
        tokenizer = Tokenizer.from_gguf_kv(gf.kv)
    except TokenizerError as e:  # the tokenizer reads key/values: name the file here
        raise TokenizerError(f"{path}: {e}") from None
    num = Numerics(native=native_kernels, quantized_activations=not exact_activations)
    with numerics.using(num):  # without the native kernels, quantized matrices load as f16
        weights = load_weights(gf, args, weight_format=weight_format, progress=progress, ends=ends)
    model = Model(args, weights, cache_dtype=CACHE_TYPES[cache_type])
    stats = SparsityStats.empty(args.n_layer, args.ffn_neurons)
    threshold = resolve_threshold(threshold, args.sparse_threshold)
    opts = RunOptions(
        sparse=not dense,
        threshold=threshold,
        stats=stats,
        cut_scale=cut_scale,
        numerics=num,
        graphs=cuda_graphs,
        defer_cold=defer_cold,
    )
    llm = LLM(model, tokenizer, gf, path, options=opts)
    if vram_budget is not None or placement_options.get("n_cpu_moe") is not None:
        from powerpy.placement.runtime import place

        budget = -1.0 if vram_budget is None else vram_budget  # n_cpu_moe alone: the free VRAM
        act = placement_options.pop("activation_dir", None)
        links = contextlib.nullcontext(act)
        if layers is not None:  # the stage's own index, and its layers' statistics
            placement_options.setdefault("index_path", stage_index_path(path, layers))
            links = stage_activations(act or path.parent / "activation", layers)
        with links as act:
            llm.runtime = place(
                model,
                gf,
                budget,
                device=device,
                n_ctx=n_ctx,
                activation_dir=act,
                **placement_options,
            )
        if llm.runtime is not None:
            llm.model = llm.runtime.model
    stack_decode.prepare(llm.model, opts)  # the layouts decode reads, as llama.cpp repacks
    llm.load_seconds = time.perf_counter() - t0
    log.debug("loaded %s in %.2f s", path, llm.load_seconds)
    return llm


CACHE_TYPES = {"f16": torch.float16, "f32": torch.float32}  # host KV cache types (-ctk/-ctv)


def resolve_threshold(threshold: float | None, file_value: float) -> float:
    """The predictor threshold: the argument, else the file's key (``file_value``, 0.0 when
    the file has none), as PowerInfer reads it at load. The environment variable
    ``LLAMA_SPARSE_PRED_THRESHOLD`` is the command line's default of ``--sparse-threshold``
    (``powerpy.commands.common``), not read here.

    Raises:
        ValueError: the threshold is NaN or +inf.
    """
    value = file_value if threshold is None else float(threshold)
    if math.isnan(value) or value == math.inf:
        raise ValueError(f"threshold {value} is not usable: give a finite number (or -inf)")
    return value
