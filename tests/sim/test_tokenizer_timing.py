"""Pure parts: the built-in tokenizer and the timing model (no servers)."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from kvroute.sim.presets import PRESETS, get_preset
from kvroute.sim.timing import decode_step_seconds, prefill_seconds, promote_seconds, transfer_seconds
from kvroute.sim.tokenizer import BuiltinTokenizer, encode_chat, render_chat, tokenize


def test_tokenize_is_stable_and_whitespace_based() -> None:
    assert tokenize("hello   world\nhello") == tokenize("hello world hello")
    ids = tokenize("hello world hello")
    assert ids[0] == ids[2] != ids[1]
    assert all(256 <= i < 128_256 for i in ids)


def test_chat_template_is_deterministic_and_shared() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    assert render_chat(messages) == "<|system|> be brief <|end|> <|user|> hi <|end|> <|assistant|>"
    assert encode_chat(messages) == tokenize(render_chat(messages))
    assert BuiltinTokenizer().encode_chat(messages, False) == tokenize(render_chat(messages, False))


def test_plain_dict_messages_render_as_any_other_mapping() -> None:
    """The fast path for plain dicts gives what the general path gives the same messages as other mappings."""
    messages = [
        {"role": "system", "content": "sys  text"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": ["x", {"type": "text", "text": "y"}, {"type": "image_url"}]},
        {"role": "tool", "content": "", "tool_call_id": "c1"},
    ]
    proxies = [MappingProxyType(m) for m in messages]
    assert render_chat(messages) == render_chat(proxies)
    assert render_chat(messages, False) == render_chat(proxies, False)
    for bad in ({"role": "", "content": "x"}, {"role": 3, "content": "x"}, {"role": "user", "content": 5}):
        with pytest.raises(ValueError):
            render_chat([bad])


@pytest.mark.parametrize("bad", [[{"content": "x"}], ["not a dict"], "text"])
def test_chat_template_rejects_malformed_messages(bad: object) -> None:
    with pytest.raises(ValueError):
        render_chat(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["llama-8b-h100", "qwen-32b-h100x2"])
def test_preset_reproduces_its_prefill_rate(name: str) -> None:
    """At time scale 1, a 2k-token prompt prefills within 5 % of the preset's nominal rate."""
    preset = get_preset(name)
    tokens = 2048
    rate = tokens / prefill_seconds(preset, tokens, 0)
    assert abs(rate - preset.prefill_tokens_per_s) / preset.prefill_tokens_per_s < 0.05


def test_timing_model_shapes() -> None:
    p = PRESETS["llama-8b-h100"]
    assert p.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    # Attention makes the same tokens slower deeper in the context; cached context is not recomputed.
    assert prefill_seconds(p, 1000, 30_000) > prefill_seconds(p, 1000, 0)
    assert prefill_seconds(p, 0, 10_000) == 0
    assert decode_step_seconds(p, 64) > decode_step_seconds(p, 1)
    assert promote_seconds(p, 10) == pytest.approx(10 * p.bytes_per_block / p.promote_bytes_per_s)
    # Fetching a 32k-token prefix beats recomputing it on this preset.
    assert transfer_seconds(p, 2048) < prefill_seconds(p, 32_768, 0)


def test_unknown_preset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("nope")
    with pytest.raises(ValueError, match="unknown preset fields"):
        get_preset("tiny", bogus=1)
