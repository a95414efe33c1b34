"""Special tokens: attributes, the roles read from metadata, detection by text, partitioning.

Token attributes follow llama.cpp's ``llama_token_attr``. Like llama.cpp's vocabulary loader,
tokens whose text names an end of turn, a FIM role or an end of generation are found by text and
marked CONTROL (:func:`detect_special`), and special tokens (CONTROL, USER_DEFINED and UNKNOWN)
are cut out of the text before the pre-tokenizer runs, longest token first
(:func:`partition`, llama.cpp's ``tokenizer_st_partition``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from enum import IntFlag

from powerpy.formats.constants import Keys, TokenType
from powerpy.tokenizer.unicode import C_SPACES

log = logging.getLogger(__name__)

__all__ = [
    "HIDDEN_ATTRS",
    "ROLE_KEYS",
    "SPECIAL_ATTRS",
    "TYPE_TO_ATTR",
    "TokenAttr",
    "detect_special",
    "partition",
]


class TokenAttr(IntFlag):
    """Per-token attributes, with llama.cpp's ``llama_token_attr`` bit values."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


TYPE_TO_ATTR = {
    TokenType.NORMAL: TokenAttr.NORMAL,
    TokenType.UNKNOWN: TokenAttr.UNKNOWN,
    TokenType.CONTROL: TokenAttr.CONTROL,
    TokenType.USER_DEFINED: TokenAttr.USER_DEFINED,
    TokenType.UNUSED: TokenAttr.UNUSED,
    TokenType.BYTE: TokenAttr.BYTE,
}
SPECIAL_ATTRS = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN
HIDDEN_ATTRS = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # not rendered unless asked for


# --- token texts llama.cpp recognises by name -----------------------------------------------------
EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<end_of_utterance>",
)
EOM_TEXTS = ("<|eom_id|>",)
FIM_TEXTS = {
    "fim_pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "fim_suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "fim_mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend\u2581of\u2581sentence\uff5c>",
        "[e~[",
    }
)
ROLE_KEYS = {
    "bos": Keys.BOS_ID,
    "eos": Keys.EOS_ID,
    "eot": Keys.EOT_ID,
    "eom": Keys.EOM_ID,
    "unk": Keys.UNK_ID,
    "sep": Keys.SEP_ID,
    "pad": Keys.PAD_ID,
    "mask": Keys.MASK_ID,
    "fim_pre": Keys.FIM_PRE_ID,
    "fim_suf": Keys.FIM_SUF_ID,
    "fim_mid": Keys.FIM_MID_ID,
    "fim_pad": Keys.FIM_PAD_ID,
    "fim_rep": Keys.FIM_REP_ID,
    "fim_sep": Keys.FIM_SEP_ID,
}
ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def detect_special(
    attrs: list[TokenAttr],
    texts: Sequence[str],
    token_to_id: Mapping[str, int],
    role_ids: dict[str, int | None],
    model_name: str,
) -> frozenset[int]:
    """Recognise EOT/EOM/FIM/EOG tokens by text and fix attributes, as llama.cpp does.

    Args:
        attrs: attributes per token id (updated in place).
        texts: token texts.
        token_to_id: vocabulary.
        role_ids: id per role of :data:`ROLE_KEYS` (missing roles found by text are filled in).
        model_name: ``general.name``; Phi-3 models get RSTRIP on their special tokens.

    Returns:
        The end-of-generation token ids.
    """
    tti = token_to_id

    def mark_control(tid: int) -> None:
        if not attrs[tid] & TokenAttr.CONTROL:
            log.debug("token %d %r looks like a control token: marking it CONTROL", tid, texts[tid])
            attrs[tid] |= TokenAttr.CONTROL

    detect = {"eot": EOT_TEXTS, "eom": EOM_TEXTS, **FIM_TEXTS}
    for role, candidates in detect.items():
        if role_ids.get(role) is not None:
            continue
        for text in candidates:
            tid = tti.get(text)
            if tid is not None:
                role_ids[role] = tid
                mark_control(tid)
                break

    for tid in tti.values():
        if attrs[tid] & TokenAttr.CONTROL and "unused" in texts[tid]:
            attrs[tid] |= TokenAttr.UNUSED

    eog: set[int] = set()
    for role in ("fim_pad", "fim_rep", "fim_sep"):
        if role_ids.get(role) is not None:
            eog.add(role_ids[role])  # type: ignore[arg-type]
    for text in EOG_TEXTS:
        tid = tti.get(text)
        if tid is not None:
            eog.add(tid)
            mark_control(tid)
    for text in ALWAYS_RENDERED:
        tid = tti.get(text)
        if tid is not None:
            attrs[tid] = TokenAttr.USER_DEFINED
    for role in ("eos", "eot", "eom"):
        if role_ids.get(role) is not None:
            eog.add(role_ids[role])  # type: ignore[arg-type]

    texts_of = {texts[t]: t for t in eog}
    if "<|end|>" in texts_of and (
        ("<|return|>" in texts_of and ("<|call|>" in texts_of or "<|calls|>" in texts_of))
        or (("<|call|>" in texts_of or "<|calls|>" in texts_of) and "<|flush|>" in texts_of)
    ):
        end_id = texts_of["<|end|>"]
        eog.discard(end_id)
        attrs[end_id] = TokenAttr.USER_DEFINED
    if "</s>" in texts_of and ("<|tool_response>" in texts_of or "<|plamo:eos|>" in texts_of):
        s_id = texts_of["</s>"]
        eog.discard(s_id)
        attrs[s_id] = TokenAttr.NORMAL

    name = model_name.lower()
    if "phi-3" in name or "phi3" in name:
        for tid in range(len(attrs)):
            if attrs[tid] & SPECIAL_ATTRS:
                attrs[tid] |= TokenAttr.RSTRIP
        if "</s>" in tti:
            attrs[tti["</s>"]] |= TokenAttr.RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in tti:
                attrs[tti[text]] &= ~TokenAttr.RSTRIP
    return frozenset(eog)


def partition(
    text: str,
    special_order: Sequence[int],
    attrs: Sequence[TokenAttr],
    texts: Sequence[str],
    parse_special: bool,
) -> list[str | int]:
    """Cut special tokens out of ``text``, longest first.

    Args:
        text: the text.
        special_order: special token ids, longest text first.
        attrs: attributes per token id (LSTRIP/RSTRIP eat C spaces next to the token).
        texts: token texts.
        parse_special: also recognise CONTROL/UNKNOWN tokens (USER_DEFINED ones always are).

    Returns:
        Raw-text pieces and token ids, in order.
    """
    frags: list[str | int] = [text] if text else []
    for sid in special_order:
        attr = attrs[sid]
        if not parse_special and attr & HIDDEN_ATTRS:
            continue
        stext = texts[sid]
        if not any(isinstance(f, str) and stext in f for f in frags):
            continue
        new: list[str | int] = []
        slen = len(stext)
        for f in frags:
            if isinstance(f, int) or stext not in f:
                new.append(f)
                continue
            base, end = 0, len(f)
            while True:
                m = f.find(stext, base, end)
                if m < 0:
                    if base < end:
                        new.append(f[base:end])
                    break
                left = m
                if attr & TokenAttr.LSTRIP:
                    while left > base and f[left - 1] in C_SPACES:
                        left -= 1
                if left > base:
                    new.append(f[base:left])
                new.append(sid)
                base = m + slen
                if attr & TokenAttr.RSTRIP:
                    while base < end and f[base] in C_SPACES:
                        base += 1
        frags = new
    return frags
