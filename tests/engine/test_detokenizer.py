"""IncrementalDetokenizer with the real SmolLM2 tokenizer: incremental text, multi-byte characters,
stop strings and what may be streamed while a request runs."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from shardserve.engine.detokenizer import IncrementalDetokenizer
from shardserve.models.loader import default_model_path
from shardserve.sampling_params import SamplingParams
from shardserve.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "Café au lait, s'il vous plaît — très élégant!",
    "Emoji time: 😀🎉👍🏽 done",
    "我们正在测试中文文本的解码。",
    "Mixed: naïve 😀 中文 ok\n\n  indented\ttab",
    " the answer is: 42\n\nDone",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_path(default_model_path())


@dataclass
class Step:
    text: str          # output_text after the step
    released: str      # releasable_text() after the step (finished once a stop string hit)
    stop: str | None


def stream(tok: Tokenizer, text: str, params: SamplingParams | None = None, prompt: str = "Say it:",
           chunk: int = 1) -> tuple[IncrementalDetokenizer, list[Step]]:
    """Feed `text`'s tokens `chunk` at a time, stopping as the engine would when a stop string hits."""
    params = params or SamplingParams()
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), params)
    steps = []
    for i in range(0, len(ids), chunk):
        stop = detok.add_tokens(ids[i:i + chunk], min(i + chunk, len(ids)))
        steps.append(Step(detok.output_text, detok.releasable_text(finished=stop is not None), stop))
        if stop is not None:
            break
    return detok, steps


def pending_stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(1, len(s)):
            if text.endswith(s[:k]):
                best = max(best, k)
    return best


# ---- plain decoding -------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tok, text, chunk):
    ids = tok.encode(text, add_special_tokens=False)
    detok, steps = stream(tok, text, chunk=chunk)
    assert detok.output_text == tok.decode(ids) == text
    assert all(s.stop is None for s in steps)
    for earlier, later in zip(steps, steps[1:]):          # text only ever grows
        assert later.text.startswith(earlier.text)


@pytest.mark.parametrize("text", [t for t in TEXTS if not t.isascii()])
def test_multibyte_characters_never_emitted_broken(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    if "😀" in text or "中" in text:   # these really are split over tokens: a naive decode breaks them
        assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))
    _, steps = stream(tok, text)
    for s in steps:
        assert "\ufffd" not in s.text and "\ufffd" not in s.released


def test_emoji_appears_whole_once_its_last_byte_arrives(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1 and all(tok.decode([i]) == "\ufffd" for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("x", add_special_tokens=False), SamplingParams())
    for n, token_id in enumerate(ids, 1):
        detok.add_tokens([token_id], n)
        assert detok.output_text == ("😀" if n == len(ids) else "")


def test_prompt_text_is_not_part_of_the_output(tok):
    detok, _ = stream(tok, " world!", prompt="Hello")
    assert detok.output_text == " world!"


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.eos_token_id
    ids = tok.encode("Hi there", add_special_tokens=False) + [eos] + tok.encode(" more", add_special_tokens=False)
    for skip, expected in ((True, "Hi there more"), (False, "Hi there<|im_end|> more")):
        detok = IncrementalDetokenizer(tok, [], SamplingParams(skip_special_tokens=skip))
        for n, t in enumerate(ids, 1):
            detok.add_tokens([t], n)
        assert detok.output_text == expected


# ---- stop strings -------------------------------------------------------------------------
def test_stop_string_is_not_emitted_and_truncates(tok):
    params = SamplingParams(stop=["world"])
    detok, steps = stream(tok, "Hello world, this is a test.", params)
    assert steps[-1].stop == "world" and len(steps) == 2
    assert detok.output_text == "Hello "
    assert detok.releasable_text(True) == "Hello "


def test_include_stop_str_in_output(tok):
    params = SamplingParams(stop=["world"], include_stop_str_in_output=True)
    detok, steps = stream(tok, "Hello world, this is a test.", params)
    assert steps[-1].stop == "world"
    assert detok.output_text == detok.releasable_text(True) == "Hello world"


@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_straddling_tokens(tok, chunk):
    text = "The stop word is STOP here"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert " ST" in pieces and "OP" in pieces      # "STOP" is split over two tokens
    detok, steps = stream(tok, text, SamplingParams(stop=["STOP"]), chunk=chunk)
    assert steps[-1].stop == "STOP"
    assert sum(1 for s in steps) == (pieces.index("OP") // chunk) + 1   # found as soon as it completes
    assert detok.output_text == "The stop word is "


def test_stop_string_spanning_many_tokens(tok):
    text = "a1b2c3d4e5 xyzzy"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) >= 10                           # one character per token here
    detok, steps = stream(tok, text, SamplingParams(stop=["2c3d4"]))
    assert steps[-1].stop == "2c3d4" and len(steps) == 8   # at the 8th token, "4"
    assert detok.output_text == "a1b"


def test_earliest_of_several_stop_strings_wins(tok):
    ids = tok.encode("Hello world, this is a test.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[" test", "world", "zzz"]))
    assert detok.add_tokens(ids, len(ids)) == "world"    # all at once: both present
    assert detok.output_text == "Hello "


@pytest.mark.parametrize("text,stop,expected", [
    ("我们正在测试中文文本的解码。", "中文", "我们正在测试"),
    ("Emoji time: 😀🎉👍🏽 done", "🎉", "Emoji time: 😀"),
    ("Café au lait, s'il vous plaît", "é au", "Caf"),
])
def test_multibyte_stop_strings(tok, text, stop, expected):
    detok, steps = stream(tok, text, SamplingParams(stop=[stop]))
    assert steps[-1].stop == stop and detok.output_text == expected


def test_no_stop_before_min_tokens(tok):
    text = "Hello world, this is a test."
    _, steps = stream(tok, text, SamplingParams(stop=["world"], min_tokens=5))
    assert all(s.stop is None for s in steps) and steps[-1].text == text
    _, steps = stream(tok, text, SamplingParams(stop=["world"], min_tokens=2))
    assert steps[-1].stop == "world" and len(steps) == 2


# ---- what may be streamed -----------------------------------------------------------------
def test_releasable_text_without_stop_strings_is_everything(tok):
    _, steps = stream(tok, TEXTS[0])
    assert all(s.released == s.text for s in steps)


@pytest.mark.parametrize("text,stops", [
    ("The stop word is STOP here", ["STOP"]),
    ("The stop word is STOP here", ["STOP", "word is X"]),
    ("a1b2c3d4e5 xyzzy", ["2c3d4"]),
    ("a1b2c3d4e5 xyzzy", ["c3d4e5 xyzzy!"]),       # never completes
    ("我们正在测试中文文本的解码。", ["中文文本"]),
])
def test_releasable_text_holds_back_possible_stop_prefix(tok, text, stops):
    params = SamplingParams(stop=stops)
    detok, steps = stream(tok, text, params)
    final = detok.releasable_text(True)
    assert final == detok.output_text
    previous = ""
    for s in steps:
        assert s.released.startswith(previous)       # streamed text is never taken back
        assert final.startswith(s.released)          # nor contradicted by the stop truncation
        if s.stop is None:                           # still running: hold back a partial stop
            assert len(s.released) <= len(s.text) - pending_stop_prefix(s.text, stops)
        assert not any(stop in s.released for stop in stops)
        previous = s.released


def test_releasable_text_hides_partial_stop_mid_stream(tok):
    text = "The stop word is STOP here"
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["STOP"]))
    upto = pieces.index(" ST") + 1
    assert detok.add_tokens(ids[:upto], upto) is None
    assert detok.output_text == "The stop word is ST"
    assert "S" not in detok.releasable_text(False)[len("The stop word is"):]
    assert detok.releasable_text(True) == "The stop word is ST"   # a finished request shows all
