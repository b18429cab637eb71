"""The discovery keys of the config: YAML, environment, strictness."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvroute.config import ConfigError, load_config


def test_discovery_keys_from_yaml_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(
        "discovery:\n"
        "  grace_s: 10\n"
        "  kubernetes: {selector: app=vllm, namespace: inference, port_name: http, events_port: 5557}\n"
    )
    config = load_config(path, environ={"KVROUTE_DISCOVERY__DNS": '{"name": "vllm.svc", "srv": true}'})
    d = config.discovery
    assert d.grace_s == 10
    assert d.kubernetes is not None and d.kubernetes.selector == "app=vllm" and d.kubernetes.events_port == 5557
    assert d.dns is not None and d.dns.srv and d.dns.interval_s == 5.0 and d.dns.nameserver_port == 53
    assert load_config(environ={}).discovery.kubernetes is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("discovery: {kubernetes: {selector: app=vllm, selctor: x}}", "discovery.kubernetes.selctor"),
        ("discovery: {kubernetes: {namespace: x}}", "discovery.kubernetes.selector"),
        ("discovery: {dns: {name: x}}", "port is required"),
        ("discovery: {grace_s: -1}", "discovery.grace_s"),
        ("discovery: {dns: {name: x, port: 0}}", "discovery.dns.port"),
    ],
)
def test_bad_discovery_config_names_the_field(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "kvroute.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem.replace(".", r"\.")):
        load_config(path, environ={})
