"""HF LLaMA-family checkpoint or dense GGUF + predictor directory -> PowerInfer (PWRI) model file.

Layout (spec §5, PowerInfer's ``convert.py``):

- HF input: ``q_proj``/``k_proj`` rows are permuted from HF rotate-half order to ggml's
  interleaved pairs (``n_head`` for q, ``n_head_kv`` for k); GGUF input is already permuted.
- ``ffn_down_t = down_proj.T`` (contiguous, neuron-major); dense GGUF ``ffn_down`` likewise.
- ``blk.{l}.fc1.weight`` / ``fc2.weight`` come from ``PREDICTOR_DIR/model_{l}.pt`` untransposed.
- ``powerinfer.sparse_threshold`` (FLOAT32) is written iff ``PREDICTOR_DIR/config.json`` has
  ``sparse_threshold``; ``powerpy.sparse_activation = "silu"`` when the predictors were trained
  on magnitude labels of a SiLU model (``config.json``: ``"sparse_activation": "silu"``).
- Types: ``f16`` (default) writes 2-D tensors as F16 and 1-D as F32; ``f32`` all F32;
  ``q8_0``/``q4_0`` quantize 2-D tensors whose rows are whole 32-blocks (others F16).
- Tensor order: model tensors, then predictors. Magic ``PWRI``.

Tensors stream one at a time (HF shards through ``safetensors.safe_open``, GGUF through its
memory map), so memory stays near the largest single tensor. The output is written to a
temporary file and renamed into place; an input is never overwritten.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from powerpy import quants
from powerpy.constants import (
    PWRI_MAGIC,
    GGMLType,
    GGUFValueType,
    Keys,
    Names,
    TokenType,
)
from powerpy.gguf_io import GGUFFile, GGUFStreamWriter, read_gguf

log = logging.getLogger(__name__)

OUTTYPES = {"f32": GGMLType.F32, "f16": GGMLType.F16, "q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}  # llama_ftype: ALL_F32, MOSTLY_*
HF_MODEL_TYPES = ("llama", "mistral")
ACTIVATIONS = ("relu", "silu")
_PRED_RE = re.compile(r"model_(\d+)\.pt")
_PRED_KEYS = ("fc1.weight", "fc2.weight")

_HF_SKIP = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


# ----------------------------------------------------------------------------------- maths
def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> ggml interleaved pairs, per head (llama.cpp's permute).

    Within each head of ``d`` rows, new row ``2m`` = old row ``m`` and new row ``2m+1`` = old row
    ``m + d/2``: w (n_head * d, n_embd) -> same shape.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot permute {rows} rows into {n_head} heads of even size")
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`permute_qk` (ggml interleaved -> HF rotate-half)."""
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Predictors:
    """A validated predictor directory."""

    files: list[Path]  # model_{l}.pt in layer order
    hidden: list[int]  # H_l
    threshold: float | None  # config.json sparse_threshold
    activation: str | None  # config.json sparse_activation ("relu"/"silu")


def load_predictor_file(path: Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Load one ``model_{l}.pt`` safely (``weights_only=True``).

    Raises:
        ValueError: an unsafe pickle (refused), an unreadable file, or keys other than exactly
            ``fc1.weight`` and ``fc2.weight``; the message names the file.
    """
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{path}: refused to load: not a plain tensor state dict, and unpickling it could run "
            f"arbitrary code ({first}); re-save it with torch.save(model.state_dict())"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError) as e:
        if mmap and "mmap" in str(e):  # legacy (non-zip) format cannot be mapped
            return load_predictor_file(path, mmap=False)
        raise ValueError(f"{path}: cannot read predictor ({e})") from None
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path}: expected a state dict of tensors, got {type(sd).__name__}")
    if sorted(sd) != sorted(_PRED_KEYS):
        raise ValueError(
            f"{path}: a predictor must hold exactly fc1.weight and fc2.weight, found {sorted(sd)}"
        )
    return dict(sd)


def read_predictor_config(pred_dir: Path) -> tuple[float | None, str | None]:
    """``(sparse_threshold, sparse_activation)`` of ``PREDICTOR_DIR/config.json`` (None if absent).

    Raises:
        ValueError: invalid JSON, a threshold that is not a finite number, an unknown activation.
    """
    path = pred_dir / "config.json"
    if not path.is_file():
        return None, None
    cfg = _read_json(path)
    thr = cfg.get("sparse_threshold")
    if thr is not None:
        if isinstance(thr, bool) or not isinstance(thr, (int, float)) or not np.isfinite(thr):
            raise ValueError(f"{path}: sparse_threshold {thr!r} is not a finite number")
        thr = float(thr)
    act = cfg.get("sparse_activation")
    if act is not None and act not in ACTIVATIONS:
        raise ValueError(f"{path}: sparse_activation {act!r} is not one of {ACTIVATIONS}")
    return thr, act


def scan_predictors(pred_dir: str | os.PathLike[str], n_layer: int, n_embd: int, n_ff: int):
    """Check a predictor directory against the model's dimensions.

    Loads ``model_0.pt``, ``model_1.pt``, … up to the first missing index (memory-mapped when
    possible) and checks count and shapes.

    Args:
        pred_dir: the directory.
        n_layer, n_embd, n_ff: the model's dimensions.

    Returns:
        A ``Predictors`` record.

    Raises:
        FileNotFoundError: the directory does not exist.
        ValueError: wrong count, wrong shapes, or a refused file (message names file and numbers).
    """
    d = Path(pred_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"predictor directory {d} does not exist")
    files = []
    while (d / f"model_{len(files)}.pt").is_file():
        files.append(d / f"model_{len(files)}.pt")
    if len(files) != n_layer:
        others = sorted(p.name for p in d.iterdir() if _PRED_RE.fullmatch(p.name))
        extra = f" (files: {', '.join(others[:6])}{' …' if len(others) > 6 else ''})"
        raise ValueError(
            f"{d}: found {len(files)} predictors model_0.pt … model_{len(files) - 1}.pt but the "
            f"model has {n_layer} layers{extra if others else ''}"
        )
    hidden = []
    for path in files:
        sd = load_predictor_file(path, mmap=True)
        fc1, fc2 = sd["fc1.weight"], sd["fc2.weight"]
        if fc1.dim() != 2 or fc1.shape[1] != n_embd:
            raise ValueError(
                f"{path}: fc1.weight has shape {tuple(fc1.shape)}, expected (H, {n_embd})"
            )
        h = fc1.shape[0]
        if fc2.dim() != 2 or tuple(fc2.shape) != (n_ff, h):
            raise ValueError(
                f"{path}: fc2.weight has shape {tuple(fc2.shape)}, expected ({n_ff}, {h}) "
                f"(n_ff {n_ff}, H {h} from fc1)"
            )
        if not (torch.isfinite(fc1).all() and torch.isfinite(fc2).all()):
            raise ValueError(f"{path}: predictor weights are not all finite")
        hidden.append(h)
    thr, act = read_predictor_config(d)
    return Predictors(files, hidden, thr, act)


# ----------------------------------------------------------------------------------- HF source
class _HFSource:
    """Lazy access to the tensors of an HF safetensors checkpoint (one shard open at a time)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.dir = directory
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{directory}: no config.json (not an HF checkpoint)")
        self.config = _read_json(cfg_path)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = _read_json(index).get("weight_map", {})
            shard_names = sorted(set(weight_map.values()))
        else:
            shard_names = sorted(p.name for p in directory.glob("*.safetensors"))
        if not shard_names:
            raise FileNotFoundError(
                f"{directory}: no *.safetensors files (pytorch_model.bin is not supported: "
                "convert it to safetensors first)"
            )
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in shard_names:
            path = directory / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard named in the index is missing")
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    self.where[key] = path
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())
        self._open: tuple[Path, Any] | None = None

    def get(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy (BF16/F16/F32 sources)."""
        from safetensors import safe_open

        path = self.where[name]
        if self._open is None or self._open[0] != path:
            self.close()
            self._open = (path, safe_open(path, framework="pt").__enter__())
        t = self._open[1].get_tensor(name)
        if not t.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float")
        return t.float().numpy()

    def close(self) -> None:
        if self._open is not None:
            with contextlib.suppress(Exception):
                self._open[1].__exit__(None, None, None)
            self._open = None


def _hf_int(cfg: Mapping[str, Any], key: str, path: Path, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if v is None or isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{path}: config.json needs an integer {key!r}, got {v!r}")
    return v


def _hf_arch(src: _HFSource) -> dict[str, Any]:
    """Hyperparameters of an HF LLaMA-family config (and its checks)."""
    cfg, path = src.config, src.dir / "config.json"
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {mt!r} is not supported (supported: {HF_MODEL_TYPES})"
        )
    n_embd = _hf_int(cfg, "hidden_size", path)
    n_head = _hf_int(cfg, "num_attention_heads", path)
    n_head_kv = _hf_int(cfg, "num_key_value_heads", path, n_head)
    head_dim = cfg.get("head_dim") or n_embd // n_head
    if head_dim * n_head != n_embd or n_head % n_head_kv:
        raise ValueError(
            f"{path}: hidden_size {n_embd}, heads {n_head}/{n_head_kv} and head_dim {head_dim} "
            "are not a supported LLaMA layout"
        )
    if cfg.get("rope_scaling"):
        raise ValueError(f"{path}: rope_scaling {cfg['rope_scaling']!r} is not supported")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError(f"{path}: attention/MLP biases are not supported")
    return {
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "head_dim": head_dim,
        "n_layer": _hf_int(cfg, "num_hidden_layers", path),
        "n_ff": _hf_int(cfg, "intermediate_size", path),
        "n_ctx": _hf_int(cfg, "max_position_embeddings", path, 2048),
        "rms_eps": float(cfg.get("rms_norm_eps", 1e-5)),
        "rope_base": float(cfg.get("rope_theta", 10000.0)),
        "vocab_size": _hf_int(cfg, "vocab_size", path),
        "hidden_act": str(cfg.get("hidden_act", "silu")),
    }


# ----------------------------------------------------------------------------------- vocab
def vocab_kv_from_gguf(path: str | os.PathLike[str]) -> dict[str, tuple]:
    """The ``tokenizer.*`` key/values of a GGUF file, typed for ``write_gguf``.

    Raises:
        ValueError: the file has no tokenizer keys.
    """
    with read_gguf(path) as gf:
        kv = {k: v for k, v in gf.typed_kv().items() if k.startswith("tokenizer.")}
    if Keys.TOKENS not in kv:
        raise ValueError(f"{path}: has no tokenizer (no {Keys.TOKENS} key)")
    return kv


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _special_id(tok_cfg: Mapping[str, Any], key: str, vocab: Mapping[str, int]) -> int | None:
    v = tok_cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return vocab.get(v) if isinstance(v, str) else None


def _tokenizer_config_kv(
    tok_cfg: Mapping[str, Any], config: Mapping[str, Any], tokens: list[str]
) -> dict[str, tuple]:
    """Special-token ids, add_bos/add_eos and the chat template (llama.cpp's ``SpecialVocab``).

    An id comes from tokenizer_config.json's ``{role}_token`` (text or ``{"content": ...}``), else
    from config.json's ``{role}_token_id``; ids outside the vocabulary are ignored.
    """
    u32, n = GGUFValueType.UINT32, len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    kv: dict[str, tuple] = {}
    for key, role in (
        (Keys.BOS_ID, "bos"),
        (Keys.EOS_ID, "eos"),
        (Keys.UNK_ID, "unk"),
        (Keys.PAD_ID, "pad"),
    ):
        v = _special_id(tok_cfg, f"{role}_token", vocab)
        v = v if v is not None else config.get(f"{role}_token_id")
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
            kv[key] = (v, u32)
    for key, flag in ((Keys.ADD_BOS, "add_bos_token"), (Keys.ADD_EOS, "add_eos_token")):
        if isinstance(tok_cfg.get(flag), bool):
            kv[key] = (tok_cfg[flag], GGUFValueType.BOOL)
    if isinstance(tok_cfg.get("chat_template"), str):
        kv[Keys.CHAT_TEMPLATE] = (tok_cfg["chat_template"], GGUFValueType.STRING)
    return kv


def sentencepiece_kv(sp: Any) -> dict[str, tuple]:
    """The ``tokenizer.ggml.*`` key/values (llama vocabulary) of a SentencePiece processor."""
    arr = GGUFValueType.ARRAY
    n = sp.get_piece_size()
    types = []
    for i in range(n):
        if sp.is_unknown(i):
            types.append(TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(TokenType.CONTROL)
        elif sp.is_unused(i):
            types.append(TokenType.UNUSED)
        elif sp.is_byte(i):
            types.append(TokenType.BYTE)
        else:
            types.append(TokenType.NORMAL)
    kv: dict[str, tuple] = {
        Keys.TOKENIZER_MODEL: ("llama", GGUFValueType.STRING),
        Keys.TOKENS: ([sp.id_to_piece(i) for i in range(n)], arr, GGUFValueType.STRING),
        Keys.SCORES: (
            np.array([sp.get_score(i) for i in range(n)], np.float32),
            arr,
            GGUFValueType.FLOAT32,
        ),
        Keys.TOKEN_TYPE: (np.array(types, np.int32), arr, GGUFValueType.INT32),
    }
    for key, v in (
        (Keys.BOS_ID, sp.bos_id()),
        (Keys.EOS_ID, sp.eos_id()),
        (Keys.UNK_ID, sp.unk_id()),
    ):
        if v >= 0:
            kv[key] = (v, GGUFValueType.UINT32)
    return kv


def _sentencepiece_hf_kv(
    spm: Path, config: Mapping[str, Any], tok_cfg: Mapping[str, Any]
) -> dict[str, tuple]:
    """``sentencepiece_kv`` of ``spm`` with the checkpoint's added tokens and ``vocab_size``.

    As llama.cpp's convert_hf_to_gguf.py: added_tokens.json, then tokenizer_config.json's
    ``added_tokens_decoder``, set tokens by id (score -1000; CONTROL if "special", else
    USER_DEFINED with U+2581 read as a space); ids past the pieces extend the vocabulary, and ids
    up to config.json's ``vocab_size`` (padded embeddings) are ``[PAD{id}]`` (UNUSED, score -1000).
    """
    import sentencepiece

    kv = sentencepiece_kv(sentencepiece.SentencePieceProcessor(model_file=str(spm)))
    tokens, scores = list(kv[Keys.TOKENS][0]), list(kv[Keys.SCORES][0])
    types = list(kv[Keys.TOKEN_TYPE][0])
    added = {int(i): (t, False) for t, i in _read_json(spm.parent / "added_tokens.json").items()}
    for i, t in tok_cfg.get("added_tokens_decoder", {}).items():
        added[int(i)] = (t["content"], bool(t.get("special")))
    n_pieces = len(tokens)
    n = max(config.get("vocab_size") or 0, n_pieces, max(added, default=-1) + 1)
    n_pad = n - n_pieces - sum(i >= n_pieces for i in added)
    if n_pad:
        log.info("%s: %d pieces; %d UNUSED [PAD{id}] tokens pad it to %d", spm, n_pieces, n_pad, n)
    tokens += [f"[PAD{i}]" for i in range(n_pieces, n)]
    scores += [-1000.0] * (n - n_pieces)
    types += [TokenType.UNUSED] * (n - n_pieces)
    for i, (text, special) in added.items():
        tokens[i] = text if special else text.replace("\u2581", " ")
        scores[i] = -1000.0
        types[i] = TokenType.CONTROL if special else TokenType.USER_DEFINED
    arr = GGUFValueType.ARRAY
    kv[Keys.TOKENS] = (tokens, arr, GGUFValueType.STRING)
    kv[Keys.SCORES] = (np.array(scores, np.float32), arr, GGUFValueType.FLOAT32)
    kv[Keys.TOKEN_TYPE] = (np.array(types, np.int32), arr, GGUFValueType.INT32)
    return kv


def _bpe_kv(tj: Path, config: Mapping[str, Any], pre: str) -> dict[str, tuple]:
    """The ``gpt2`` vocabulary of a BPE ``tokenizer.json``, padded to config.json's vocab_size."""
    arr = GGUFValueType.ARRAY
    data = _read_json(tj)
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(
            f"{tj}: tokenizer model {model.get('type')!r} is not supported (BPE is); "
            "pass --vocab-gguf FILE"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for t in data.get("added_tokens", []):
        vocab[t["content"]] = int(t["id"])
        if t.get("special"):
            special.add(int(t["id"]))
    n = max(config.get("vocab_size", 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TokenType.UNUSED] * n
    added = {int(t["id"]) for t in data.get("added_tokens", [])}
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = (
            TokenType.CONTROL
            if i in special
            else (TokenType.USER_DEFINED if i in added else TokenType.NORMAL)
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    log.warning("%s: BPE vocabulary with pre-tokenizer %r (set it with --vocab-pre)", tj, pre)
    return {
        Keys.TOKENIZER_MODEL: ("gpt2", GGUFValueType.STRING),
        Keys.TOKENIZER_PRE: (pre, GGUFValueType.STRING),
        Keys.TOKENS: (tokens, arr, GGUFValueType.STRING),
        Keys.TOKEN_TYPE: (np.array(types, np.int32), arr, GGUFValueType.INT32),
        Keys.MERGES: (merges, arr, GGUFValueType.STRING),
    }


def vocab_kv_from_hf(directory: Path, config: Mapping[str, Any], pre: str) -> dict[str, tuple]:
    """Tokenizer key/values from ``tokenizer.model`` (SentencePiece) or ``tokenizer.json`` (BPE).

    tokenizer_config.json, where present, adds special-token ids, add_bos/add_eos, the chat
    template and (SentencePiece) added tokens; see ``_tokenizer_config_kv``.

    Args:
        directory: the HF checkpoint.
        config: its config.json.
        pre: ``tokenizer.ggml.pre`` for a BPE vocabulary (GGUF's name of the pre-tokenizer).

    Raises:
        FileNotFoundError: neither file exists (pass ``--vocab-gguf``).
        ValueError: a tokenizer.json whose model is not BPE.
    """
    spm, tj = directory / "tokenizer.model", directory / "tokenizer.json"
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    if spm.is_file():
        kv = _sentencepiece_hf_kv(spm, config, tok_cfg)
    elif tj.is_file():
        kv = _bpe_kv(tj, config, pre)
    else:
        raise FileNotFoundError(
            f"{directory}: no tokenizer.model or tokenizer.json; pass --vocab-gguf FILE (a GGUF "
            "of the same model) to copy its tokenizer"
        )
    kv.update(_tokenizer_config_kv(tok_cfg, config, kv[Keys.TOKENS][0]))
    return kv


# ----------------------------------------------------------------------------------- output
@dataclass
class _Tensor:
    name: str
    shape: tuple[int, ...]  # numpy shape
    ggml_type: GGMLType
    load: Callable[[], np.ndarray]  # float32 values of `shape`


def out_type(shape: tuple[int, ...], outtype: str) -> GGMLType:
    """The stored type of a tensor: 1-D -> F32; 2-D -> the outtype (F16 if rows are not blocks)."""
    if len(shape) == 1 or outtype == "f32":
        return GGMLType.F32
    t = OUTTYPES[outtype]
    if t in (GGMLType.Q8_0, GGMLType.Q4_0) and shape[-1] % 32:
        return GGMLType.F16
    return t


def _encode(t: _Tensor) -> np.ndarray:
    arr = np.asarray(t.load(), dtype=np.float32)
    if arr.shape != t.shape:
        raise ValueError(f"tensor {t.name!r}: produced shape {arr.shape}, expected {t.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"tensor {t.name!r} holds values that are not finite")
    return quants.quantize(arr, t.ggml_type).reshape(-1)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _write_stream(
    path: Path, kv: Mapping[str, tuple], plan: list[_Tensor], *, progress: bool
) -> None:
    """Write a PWRI file tensor by tensor (only one tensor in memory), atomically."""
    table = [(t.name, t.shape, t.ggml_type) for t in plan]
    with GGUFStreamWriter(path, kv, table, magic=PWRI_MAGIC) as w:
        for t in tqdm(plan, desc="convert", unit="tensor", disable=not progress):
            w.write(t.name, _encode(t).view(np.uint8), t.shape)


def _arch_kv(a: Mapping[str, Any], name: str, n_vocab: int | None) -> dict[str, tuple]:
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    arch = "llama"
    kv: dict[str, tuple] = {
        Keys.ARCHITECTURE: (arch, GGUFValueType.STRING),
        Keys.NAME: (name, GGUFValueType.STRING),
        Keys.CONTEXT_LENGTH.format(arch=arch): (a["n_ctx"], u32),
        Keys.EMBEDDING_LENGTH.format(arch=arch): (a["n_embd"], u32),
        Keys.BLOCK_COUNT.format(arch=arch): (a["n_layer"], u32),
        Keys.FEED_FORWARD_LENGTH.format(arch=arch): (a["n_ff"], u32),
        Keys.ROPE_DIMENSION_COUNT.format(arch=arch): (a["head_dim"], u32),
        Keys.ROPE_FREQ_BASE.format(arch=arch): (a["rope_base"], f32),
        Keys.HEAD_COUNT.format(arch=arch): (a["n_head"], u32),
        Keys.HEAD_COUNT_KV.format(arch=arch): (a["n_head_kv"], u32),
        Keys.RMS_EPS.format(arch=arch): (a["rms_eps"], f32),
    }
    if n_vocab is not None:
        kv[Keys.VOCAB_SIZE.format(arch=arch)] = (n_vocab, u32)
    return kv


def _predictor_tensors(preds: Predictors, outtype: str) -> list[_Tensor]:
    out = []
    for l, path in enumerate(preds.files):
        for key, template in zip(_PRED_KEYS, (Names.FC1, Names.FC2), strict=True):

            def load(path: Path = path, key: str = key) -> np.ndarray:
                return load_predictor_file(path, mmap=True)[key].float().numpy()

            shape = tuple(load_predictor_file(path, mmap=True)[key].shape)
            out.append(_Tensor(template.format(l=l), shape, out_type(shape, outtype), load))
    return out


def _resolve_activation(
    preds: Predictors, model_act: str | None, override: str | None, src: Path
) -> str:
    """The sparse activation the file is marked with: "relu" (PowerInfer's) or "silu"."""
    act = override or preds.activation
    if model_act is not None:
        model_kind = "silu" if model_act in ("silu", "swish") else "relu"
        if act is None and model_kind == "silu":
            raise ValueError(
                f"{src}: the model uses SiLU (hidden_act {model_act!r}) but the predictor config "
                'has no "sparse_activation": "silu" marker; train predictors with '
                "`powerpy train-predictors` or pass --activation silu"
            )
        if act is not None and act != model_kind:
            raise ValueError(
                f"{src}: hidden_act {model_act!r} but the predictors are marked {act!r}"
            )
    return act or "relu"


def _sparse_kv(thr: float | None, act: str) -> dict[str, tuple]:
    kv: dict[str, tuple] = {}
    if thr is not None:
        kv[Keys.SPARSE_THRESHOLD] = (float(thr), GGUFValueType.FLOAT32)
    if act == "silu":
        kv[Keys.SPARSE_ACTIVATION] = ("silu", GGUFValueType.STRING)
    return kv


def convert(
    src: str | os.PathLike[str],
    predictor_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    outtype: str = "f16",
    vocab_gguf: str | os.PathLike[str] | None = None,
    vocab_pre: str = "default",
    activation: str | None = None,
    name: str | None = None,
    progress: bool = False,
) -> Path:
    """Build a PowerInfer (PWRI) model file.

    Args:
        src: an HF LLaMA-family checkpoint directory (config.json + safetensors, BF16/F16/F32,
            sharded or not) or a dense GGUF file (already q/k-permuted; a PWRI file is accepted
            too, its predictors are replaced).
        predictor_dir: ``model_{l}.pt`` per layer and an optional ``config.json``.
        out: the output file; written atomically, and never one of the inputs.
        outtype: "f16" (default), "f32", "q8_0" or "q4_0".
        vocab_gguf: copy the tokenizer from this GGUF (HF sources; default: tokenizer.model or
            tokenizer.json of the checkpoint).
        vocab_pre: ``tokenizer.ggml.pre`` for a tokenizer.json BPE vocabulary.
        activation: override the predictors' ``sparse_activation`` ("relu" or "silu").
        name: ``general.name`` (default: the source's name).
        progress: show a progress bar.

    Returns:
        The output path.

    Raises:
        FileNotFoundError: a missing input.
        ValueError: unsupported source, mismatched predictors (file and numbers named), an
            output that is an input, a bad outtype or activation.
    """
    src_p, pred_p, out_p = Path(src), Path(predictor_dir), Path(out)
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {tuple(OUTTYPES)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    if not src_p.exists():
        raise FileNotFoundError(f"source {src_p} does not exist")
    if out_p.is_dir():
        raise IsADirectoryError(f"output {out_p} is a directory")
    inputs = [src_p, Path(vocab_gguf)] if vocab_gguf else [src_p]
    for d in (src_p, pred_p):
        if d.is_dir():
            inputs += [f for f in d.iterdir() if f.is_file()]
    for p in inputs:
        if _same_file(out_p, p):
            raise ValueError(f"output {out_p} would overwrite the input {p}")
    if not out_p.parent.is_dir():
        raise FileNotFoundError(f"cannot write {out_p}: directory {out_p.parent} does not exist")

    if src_p.is_dir():
        _convert_hf(
            src_p, pred_p, out_p, outtype, vocab_gguf, vocab_pre, activation, name, progress
        )
    else:
        _convert_gguf(src_p, pred_p, out_p, outtype, activation, name, progress)
    log.debug("wrote %s", out_p)
    return out_p


def _convert_hf(
    src: Path,
    pred_dir: Path,
    out: Path,
    outtype: str,
    vocab_gguf: str | os.PathLike[str] | None,
    vocab_pre: str,
    activation: str | None,
    name: str | None,
    progress: bool,
) -> None:
    hf = _HFSource(src)
    try:
        a = _hf_arch(hf)
        preds = scan_predictors(pred_dir, a["n_layer"], a["n_embd"], a["n_ff"])
        act = _resolve_activation(preds, a["hidden_act"], activation, src)
        if vocab_gguf is not None:
            vocab = vocab_kv_from_gguf(vocab_gguf)
        else:
            vocab = vocab_kv_from_hf(src, hf.config, vocab_pre)
        n_tokens = len(vocab[Keys.TOKENS][0])
        if n_tokens != a["vocab_size"]:
            raise ValueError(
                f"tokenizer has {n_tokens} tokens but {src / 'config.json'} has vocab_size "
                f"{a['vocab_size']}"
            )
        kv = _arch_kv(a, name or src.name, None)
        kv[Keys.FILE_TYPE] = (FILE_TYPES[outtype], GGUFValueType.UINT32)
        kv.update(_sparse_kv(preds.threshold, act))
        kv.update(vocab)

        plan: list[_Tensor] = []
        known = set()

        def add(
            hf_name: str,
            gguf_name: str,
            expect: tuple[int, ...],
            n_head: int = 0,
            transpose: bool = False,
        ) -> None:
            """Plan one tensor: permute q/k rows for ``n_head`` heads, or transpose."""
            if hf_name not in hf.shapes:
                raise ValueError(f"{src}: tensor {hf_name!r} is missing")
            if hf.shapes[hf_name] != expect:
                raise ValueError(
                    f"{src}: tensor {hf_name!r} has shape {hf.shapes[hf_name]}, expected {expect}"
                )
            known.add(hf_name)

            def load() -> np.ndarray:
                arr = hf.get(hf_name)
                if n_head:
                    arr = permute_qk(arr, n_head)
                return np.ascontiguousarray(arr.T) if transpose else arr

            shape = expect[::-1] if transpose else expect
            plan.append(_Tensor(gguf_name, shape, out_type(shape, outtype), load))

        d, ff, gqa, nv = a["n_embd"], a["n_ff"], a["head_dim"] * a["n_head_kv"], a["vocab_size"]
        nh, nkv = a["n_head"], a["n_head_kv"]
        add("model.embed_tokens.weight", Names.TOKEN_EMBD, (nv, d))
        for l in range(a["n_layer"]):
            p = f"model.layers.{l}."
            add(p + "input_layernorm.weight", Names.ATTN_NORM.format(l=l), (d,))
            add(p + "self_attn.q_proj.weight", Names.ATTN_Q.format(l=l), (d, d), n_head=nh)
            add(p + "self_attn.k_proj.weight", Names.ATTN_K.format(l=l), (gqa, d), n_head=nkv)
            add(p + "self_attn.v_proj.weight", Names.ATTN_V.format(l=l), (gqa, d))
            add(p + "self_attn.o_proj.weight", Names.ATTN_OUTPUT.format(l=l), (d, d))
            add(p + "post_attention_layernorm.weight", Names.FFN_NORM.format(l=l), (d,))
            add(p + "mlp.gate_proj.weight", Names.FFN_GATE.format(l=l), (ff, d))
            add(p + "mlp.up_proj.weight", Names.FFN_UP.format(l=l), (ff, d))
            add(p + "mlp.down_proj.weight", Names.FFN_DOWN_T.format(l=l), (d, ff), transpose=True)
        add("model.norm.weight", Names.OUTPUT_NORM, (d,))
        if "lm_head.weight" in hf.shapes:
            add("lm_head.weight", Names.OUTPUT, (nv, d))
        left = sorted(k for k in hf.shapes if k not in known and not _HF_SKIP.fullmatch(k))
        if left:
            raise ValueError(
                f"{src}: {len(left)} tensors are not part of a LLaMA model, e.g. {left[:3]}"
            )
        plan += _predictor_tensors(preds, outtype)
        _write_stream(out, kv, plan, progress=progress)
    finally:
        hf.close()


def _convert_gguf(
    src: Path,
    pred_dir: Path,
    out: Path,
    outtype: str,
    activation: str | None,
    name: str | None,
    progress: bool,
) -> None:
    from powerpy.loader import model_args

    with read_gguf(src) as gf:
        args = model_args(gf)
        preds = scan_predictors(pred_dir, args.n_layer, args.n_embd, args.n_ff)
        act = _resolve_activation(preds, None, activation, src)
        if act == "relu" and not gf.sparse:
            log.warning(
                "%s: a dense GGUF carries no activation; the PWRI file will run ReLU (ReGLU) "
                'FFNs. Mark SiLU predictors with "sparse_activation": "silu".',
                src,
            )
        kv: dict[str, tuple] = {}
        for key, spec in gf.typed_kv().items():
            if key in (Keys.SPARSE_THRESHOLD, Keys.SPARSE_ACTIVATION):
                continue
            if key == Keys.FILE_TYPE:
                spec = (FILE_TYPES[outtype], GGUFValueType.UINT32)
            if key == Keys.NAME and name is not None:
                spec = (name, GGUFValueType.STRING)
            kv[key] = spec
        kv.setdefault(Keys.FILE_TYPE, (FILE_TYPES[outtype], GGUFValueType.UINT32))
        kv.update(_sparse_kv(preds.threshold, act))
        plan = list(_gguf_tensors(gf, outtype))
        plan += _predictor_tensors(preds, outtype)
        _write_stream(out, kv, plan, progress=progress)


def _gguf_tensors(gf: GGUFFile, outtype: str) -> Iterator[_Tensor]:
    drop = re.compile(r"blk\.\d+\.fc[12]\.weight|" + re.escape(Names.ROPE_FREQS))
    for tname, info in gf.tensors.items():
        if drop.fullmatch(tname):
            continue
        shape = tuple(info.shape)
        if tname.endswith(".ffn_down.weight"):
            new = tname.replace(".ffn_down.weight", ".ffn_down_t.weight")
            shape_t = shape[::-1]

            def load_t(tname: str = tname) -> np.ndarray:
                return np.ascontiguousarray(gf.dequantize(tname).T)

            yield _Tensor(new, shape_t, out_type(shape_t, outtype), load_t)
        else:

            def load(tname: str = tname) -> np.ndarray:
                return gf.dequantize(tname)

            yield _Tensor(tname, shape, out_type(shape, outtype), load)
