"""Reading an HF checkpoint for ``convert``: safetensors or ``pytorch_model*.bin`` shards
(lazily, one open at a time) and the tokenizer (``tokenizer.json`` BPE, GPT-2's ``vocab.json`` +
``merges.txt``, or SentencePiece ``tokenizer.model``, plus ``tokenizer_config.json``) mapped to
GGUF tokenizer key/values as llama.cpp's converter does."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from powerpy._fs import read_json
from powerpy.formats.constants import GGUFValueType, Keys, TokenType
from powerpy.formats.gguf_reader import read_gguf

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------- HF source
def load_state_dict(path: Path) -> dict[str, Any]:
    """One ``pytorch_model*.bin`` shard, loaded safely (``weights_only=True``) and memory-mapped
    where its format allows (the legacy non-zip format is read whole).

    Raises:
        ValueError: an unsafe pickle (refused), an unreadable file or not a state dict; the
            message names the file.
    """
    import pickle

    import torch

    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(
            f"{path}: refused to load: not a plain tensor state dict, and unpickling it could run "
            f"arbitrary code ({first}); convert the checkpoint to safetensors"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError) as e:
        if "mmap" not in str(e):
            raise ValueError(f"{path}: cannot read the shard ({e})") from None
        log.info("%s: legacy torch format, read whole (no memory map)", path)
        sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, Mapping):
        raise ValueError(f"{path}: expected a state dict, got {type(sd).__name__}")
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _shard_names(directory: Path) -> tuple[list[str], bool]:
    """The checkpoint's weight files and whether they are safetensors (preferred when both
    kinds are there, as transformers does)."""
    for index, pattern, safe in (
        ("model.safetensors.index.json", "*.safetensors", True),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin", False),
    ):
        if (directory / index).is_file():
            weight_map = read_json(directory / index).get("weight_map", {})
            return sorted(set(weight_map.values())), safe
        names = sorted(p.name for p in directory.glob(pattern))
        if names:
            return names, safe
    raise FileNotFoundError(f"{directory}: no *.safetensors or pytorch_model*.bin weight files")


class HFSource:
    """Lazy access to the tensors of an HF checkpoint: safetensors shards, or
    ``pytorch_model*.bin`` shards (memory-mapped ``torch.load``), one shard open at a time."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.dir = directory
        cfg_path = directory / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{directory}: no config.json (not an HF checkpoint)")
        self.config = read_json(cfg_path)
        shard_names, self.safetensors = _shard_names(directory)
        self.where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name in shard_names:
            path = directory / name
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard named in the index is missing")
            if self.safetensors:
                with safe_open(path, framework="pt") as f:
                    for key in f.keys():
                        self.where[key] = path
                        self.shapes[key] = tuple(f.get_slice(key).get_shape())
            else:
                for key, t in load_state_dict(path).items():
                    self.where[key] = path
                    self.shapes[key] = tuple(t.shape)
        self._open: tuple[Path, Any] | None = None

    def get(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy (BF16/F16/F32 sources)."""
        from safetensors import safe_open

        path = self.where[name]
        if self._open is None or self._open[0] != path:
            self.close()
            if self.safetensors:
                self._open = (path, safe_open(path, framework="pt").__enter__())
            else:
                self._open = (path, load_state_dict(path))
        f = self._open[1]
        t = f.get_tensor(name) if self.safetensors else f[name]
        if not t.is_floating_point():
            raise ValueError(f"{path}: tensor {name!r} has dtype {t.dtype}, expected a float")
        return t.float().numpy()

    def close(self) -> None:
        if self._open is not None and self.safetensors:
            with contextlib.suppress(Exception):
                self._open[1].__exit__(None, None, None)
        self._open = None


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
    added = {int(i): (t, False) for t, i in read_json(spm.parent / "added_tokens.json").items()}
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
    data = read_json(tj)
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(
            f"{tj}: tokenizer model {model.get('type')!r} is not supported (BPE is); "
            "pass --vocab-gguf FILE"
        )
    return _bpe_model_kv(tj, model, data.get("added_tokens", []), config, pre)


def _bpe_files_kv(
    directory: Path, config: Mapping[str, Any], tok_cfg: Mapping[str, Any], pre: str
) -> dict[str, tuple]:
    """The ``gpt2`` vocabulary of GPT-2's ``vocab.json`` + ``merges.txt`` (OPT's checkpoints).

    Added tokens come from tokenizer_config.json's ``added_tokens_decoder``; the special tokens
    it names (bos/eos/unk/pad) are CONTROL tokens, as a tokenizer.json lists them."""
    vj = directory / "vocab.json"
    lines = (directory / "merges.txt").read_text(encoding="utf-8").splitlines()
    merges = [m for m in lines if m and not m.startswith("#version")]
    added = [
        {"id": int(i), "content": t["content"], "special": bool(t.get("special"))}
        for i, t in tok_cfg.get("added_tokens_decoder", {}).items()
    ]
    vocab = read_json(vj)
    listed = {a["id"] for a in added}
    for role in ("bos", "eos", "unk", "pad"):
        text = tok_cfg.get(f"{role}_token")
        text = text.get("content") if isinstance(text, dict) else text
        if isinstance(text, str) and text in vocab and vocab[text] not in listed:
            added.append({"id": vocab[text], "content": text, "special": True})
            listed.add(vocab[text])
    return _bpe_model_kv(vj, {"vocab": vocab, "merges": merges}, added, config, pre)


def _bpe_model_kv(
    source: Path,
    model: Mapping[str, Any],
    added_tokens: list[Mapping[str, Any]],
    config: Mapping[str, Any],
    pre: str,
) -> dict[str, tuple]:
    """The ``gpt2`` key/values of a BPE ``model`` (``vocab``: text -> id, ``merges``) and its
    added tokens (``id``, ``content``, ``special``), padded to config.json's vocab_size."""
    arr = GGUFValueType.ARRAY
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for t in added_tokens:
        vocab[t["content"]] = int(t["id"])
        if t.get("special"):
            special.add(int(t["id"]))
    n = max(config.get("vocab_size", 0), max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TokenType.UNUSED] * n
    added = {int(t["id"]) for t in added_tokens}
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = (
            TokenType.CONTROL
            if i in special
            else (TokenType.USER_DEFINED if i in added else TokenType.NORMAL)
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    log.warning("%s: BPE vocabulary with pre-tokenizer %r (set it with --vocab-pre)", source, pre)
    return {
        Keys.TOKENIZER_MODEL: ("gpt2", GGUFValueType.STRING),
        Keys.TOKENIZER_PRE: (pre, GGUFValueType.STRING),
        Keys.TOKENS: (tokens, arr, GGUFValueType.STRING),
        Keys.TOKEN_TYPE: (np.array(types, np.int32), arr, GGUFValueType.INT32),
        Keys.MERGES: (merges, arr, GGUFValueType.STRING),
    }


def vocab_kv_from_hf(directory: Path, config: Mapping[str, Any], pre: str) -> dict[str, tuple]:
    """Tokenizer key/values from ``tokenizer.model`` (SentencePiece), ``tokenizer.json`` (BPE)
    or ``vocab.json`` + ``merges.txt`` (GPT-2 BPE).

    tokenizer_config.json, where present, adds special-token ids, add_bos/add_eos, the chat
    template and (SentencePiece) added tokens; see ``_tokenizer_config_kv``.

    Args:
        directory: the HF checkpoint.
        config: its config.json.
        pre: ``tokenizer.ggml.pre`` for a BPE vocabulary (GGUF's name of the pre-tokenizer).

    Raises:
        FileNotFoundError: none of these files exists (pass ``--vocab-gguf``).
        ValueError: a tokenizer.json whose model is not BPE.
    """
    spm, tj = directory / "tokenizer.model", directory / "tokenizer.json"
    tok_cfg = read_json(directory / "tokenizer_config.json")
    if spm.is_file():
        kv = _sentencepiece_hf_kv(spm, config, tok_cfg)
    elif tj.is_file():
        kv = _bpe_kv(tj, config, pre)
    elif (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        kv = _bpe_files_kv(directory, config, tok_cfg, pre)
    else:
        raise FileNotFoundError(
            f"{directory}: no tokenizer.model, tokenizer.json or vocab.json; pass --vocab-gguf "
            "FILE (a GGUF of the same model) to copy its tokenizer"
        )
    kv.update(_tokenizer_config_kv(tok_cfg, config, kv[Keys.TOKENS][0]))
    return kv
