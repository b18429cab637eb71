"""The fidelity probe's surface label: route, adapter and salt each get their own series."""

from __future__ import annotations

from kvroute.router.outcomes import surface_of
from kvroute.router.requests import parse_request


def test_surfaces_name_route_adapter_and_salt() -> None:
    chat = parse_request(
        "POST", "/v1/chat/completions", [], b'{"model":"m","messages":[{"role":"user","content":"x"}]}'
    )
    salted = parse_request("POST", "/v1/completions", [], b'{"model":"m","prompt":"x","cache_salt":"s"}')
    assert surface_of(chat) == "chat"
    assert surface_of(chat, lora="adapter") == "chat+lora"
    assert surface_of(salted) == "completions+salted"
    assert surface_of(salted, lora="adapter") == "completions+lora+salted"
