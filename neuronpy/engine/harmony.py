"""gpt-oss's "harmony" format: the special tokens that frame its messages, how a chat template
that speaks it is recognised, and which of its tokens end a reply.

A harmony reply is a run of messages, each `<|channel|>CHANNEL<|message|>BODY` closed by
`<|end|>` (and the next one opened by `<|start|>assistant`): `analysis` (the reasoning),
`commentary` (a preamble, or a tool call when it names a recipient: `to=functions.NAME`) and
`final` (the answer). The prompt ends with `<|start|>assistant`, so the reply begins at
`<|channel|>`; `<|return|>` ends a reply after its answer and `<|call|>` after a tool call.
engine/output.py's HarmonyParser reads a reply into reasoning, content and tool calls.

A leaf: engine/reasoning.py and engine/tools.py register the format's name from here.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

NAME = "harmony"  # the reasoning parser's and the tool format's name

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
# Every token the parser reads: kept in the decoded text, though they are special tokens
# (decoding would skip them otherwise, and the messages' frames would run together).
TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# What ends a reply: the answer's end and a tool call's end (gpt-oss's generation config names
# them as EOS too, but a checkpoint or a GGUF file may not).
STOP_TOKENS = (RETURN, CALL)

REASONING_CHANNEL = "analysis"
# the reasoning block's markers, for what reads a reasoning parser as a start and an end
# marker (a prompt that opened the block, a constrained reply's optional block)
REASONING_START = f"{CHANNEL}{REASONING_CHANNEL}{MESSAGE}"
# Where a call's recipient begins in its header (`to=functions.NAME`)
FUNCTIONS = "functions."
# What a constrained reply writes before its answer (after its analysis message, if any)
FINAL_FRAME = f"{START}assistant{CHANNEL}final{MESSAGE}"


def is_harmony_template(template: object) -> bool:
    """Whether a chat template writes harmony's framing: its channel and message tokens."""
    return isinstance(template, str) and CHANNEL in template and MESSAGE in template


def stop_token_ids(tokenizer: Any, eos: Collection[int] = ()) -> frozenset[int]:
    """The ids of harmony's reply-ending tokens in `tokenizer` (none when it has no such
    tokens: not a harmony tokenizer), with `eos`. `tokenizer`: a transformers tokenizer."""
    found = set(eos)
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token_id, token in added.items():
        if str(token) in STOP_TOKENS or getattr(token, "content", None) in STOP_TOKENS:
            found.add(int(token_id))
    return frozenset(found)
