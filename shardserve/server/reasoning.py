"""`--reasoning-parser`: a reasoning model's thinking, `<think> ... </think>`, apart from its answer.

Chat responses then carry the thinking in the message's (a stream's deltas') `reasoning` field, and
under its older name `reasoning_content` too, as vLLM's clients read one or the other; `content`
holds what follows `</think>`. Two parsers, vLLM's names:
- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ): the template opens the think block in the
  prompt, so the output is thinking until `</think>` (all of it when the output stops first);
- `qwen3`: Qwen3 thinks only where the output opens with `<think>` or the prompt leaves a think
  block open; otherwise (`chat_template_kwargs: {"enable_thinking": false}` closes it in the
  prompt, instruct models never open one) the whole output is content.
A leading `<think>` in the output is dropped either way. Streaming uses the same split of the text
so far: text that may still turn out to be `</think>` (or the opening `<think>`) is held back until
the next tokens decide, so the deltas add up to the non-streamed fields.
"""
from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class ReasoningParser:
    def __init__(self, name: str, prompt: str = "") -> None:
        if name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
        # Thinking from the first output token: R1's template always opens the block; Qwen3's where
        # the prompt's last think block is still open.
        self.starts_in_reasoning = name == "deepseek_r1" or prompt.rfind(START) > prompt.rfind(END)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning, content) of the output text so far: reasoning None where the output does not
        think. Before the output ends (`final` False), text that may still become a tag is in neither."""
        stripped = text.lstrip()
        if stripped.startswith(START):
            begin = len(text) - len(stripped) + len(START)
        elif not final and stripped and START.startswith(stripped):
            return "", ""   # may yet open with <think>: undecided
        elif self.starts_in_reasoning:
            begin = 0
        else:
            return None, text
        end = text.find(END, begin)
        if end >= 0:
            return text[begin:end], text[end + len(END):]
        if final:
            return text[begin:], ""
        return text[begin:len(text) - _partial_tag(text, begin)], ""


def _partial_tag(text: str, begin: int) -> int:
    """Length of the longest end of text[begin:] that begins END (and may become it)."""
    for n in range(min(len(END) - 1, len(text) - begin), 0, -1):
        if END.startswith(text[len(text) - n:]):
            return n
    return 0
