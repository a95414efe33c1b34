"""The notebook-facing API: ``load`` a file, then generate, stream or score text."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from powerpy.chat import Message, render_chat
from powerpy.generate import Response, generate, stream_generate
from powerpy.gguf_io import GGUFFile, read_gguf
from powerpy.loader import load_weights, model_args
from powerpy.model import Model
from powerpy.sampling import SamplingParams
from powerpy.tokenizer import Tokenizer

if TYPE_CHECKING:
    from powerpy.runtime import HybridRuntime

log = logging.getLogger(__name__)


@dataclass
class LLM:
    """A loaded model with its tokenizer. Keep it alive while its weights are in use: the
    weights are memory-mapped from ``file``."""

    model: Model
    tokenizer: Tokenizer
    file: GGUFFile
    path: Path
    load_seconds: float
    runtime: HybridRuntime | None = None  # set when a hybrid placement is applied

    def tokenize(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text`` (special tokens parsed, BOS per the file)."""
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling) -> str:
        """Generated text; ``sampling`` takes the fields of ``SamplingParams``."""
        return generate(self, prompt, max_tokens, SamplingParams(**sampling))

    def stream(
        self, prompt: str | Sequence[int], max_tokens: int = 128, **sampling
    ) -> Iterator[Response]:
        """Stream ``Response`` records; ``sampling`` takes the fields of ``SamplingParams``."""
        return stream_generate(self, prompt, max_tokens, SamplingParams(**sampling))

    def logits(self, prompt: str | Sequence[int]) -> torch.Tensor:
        """Logits (T, n_vocab) f32 of every position of ``prompt`` in one fresh pass."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        cache = self.model.new_cache(len(ids))
        return self.model.forward(torch.tensor(ids, dtype=torch.long), cache, all_logits=True)

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
        tok = self.tokenizer
        bos, eos = (self._special_text(i) for i in (tok.bos_id, tok.eos_id))
        text = render_chat(
            tok.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            source=str(self.path),
        )
        if not tokenize:
            return text
        return tok.encode(text, add_bos=tok.add_bos and not (bos and text.startswith(bos)))

    def chat(self, messages: Sequence[Message], max_tokens: int = 256, **sampling) -> str:
        """The assistant's reply to a conversation (stops at the model's end-of-turn token)."""
        return "".join(r.text for r in self.stream_chat(messages, max_tokens, **sampling))

    def stream_chat(
        self, messages: Sequence[Message], max_tokens: int = 256, **sampling
    ) -> Iterator[Response]:
        """Stream the assistant's reply to a conversation as ``Response`` records."""
        ids = self.apply_chat_template(messages, tokenize=True)
        return stream_generate(self, ids, max_tokens, SamplingParams(**sampling))

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.tokenizer.token_to_piece(token_id, special=True).decode("utf-8", "replace")

    @property
    def sparsity(self):
        """Per-layer predicted sparsity counters (``SparsityStats``) of the tokens run so far."""
        return self.model.sparsity


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
) -> LLM:
    """Load a GGUF (dense) or PWRI (sparse) model.

    Args:
        path: model file; None loads the default model (SmolLM2-135M-Instruct).
        threshold: predictor threshold; None uses the file's powerinfer.sparse_threshold or 0.0.
        weight_format: "auto", "f32" or "raw" (see ``loader.load_weights``).
        progress: show a progress bar while loading.
        vram_budget: PWRI models: hybrid CPU-accelerator placement for this many GiB
            (``powerpy.runtime.enable_hybrid``; its summary is ``llm.runtime.summary()``). The
            GPU index is reused or generated per spec §10.3; for the other index options call
            ``enable_hybrid`` on a model loaded without a budget.
        device: the accelerator: "cuda[:N]", "cpu" (emulated) or None (CUDA when present,
            else CPU-only with ``llm.runtime`` None).
        n_ctx: context the accelerator KV cache is reserved for (default min(2048, training)).
        ffn_act: "relu" or "silu" to override the FFN activation the file implies (a dense
            GGUF runs SiLU; a dense GGUF of a ReLU model needs "relu"). See
            ``ModelArgs.with_ffn_act``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is malformed or not a supported model.
    """
    from powerpy.models import default_model_path

    path = Path(path) if path is not None else default_model_path()
    t0 = time.perf_counter()
    gf = read_gguf(path)
    args = model_args(gf).with_ffn_act(ffn_act, source=str(path))
    tokenizer = Tokenizer.from_gguf_kv(gf.kv)
    weights = load_weights(gf, args, weight_format=weight_format, progress=progress)
    model = Model(args, weights, threshold=threshold)
    llm = LLM(model, tokenizer, gf, path, 0.0)
    if vram_budget is not None:
        from powerpy.runtime import enable_hybrid

        llm.runtime = enable_hybrid(llm, vram_budget, device=device, n_ctx=n_ctx)
    llm.load_seconds = time.perf_counter() - t0
    log.debug("loaded %s in %.2f s", path, llm.load_seconds)
    return llm
