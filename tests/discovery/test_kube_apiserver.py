"""Validates the Kubernetes API stand-in itself (no real cluster is available here): every object it
serves passes the official OpenAPI schemas (kubernetes-validate, strict), and lightkube, an independent
Kubernetes client, lists and watches it (bookmarks, and an ERROR 410 decoded as a 410 ApiError)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import kubernetes_validate
import orjson
import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod
from lightkube.types import OnErrorAction, OnErrorResult

from tests.discovery.kube_apiserver import KubeApiServer, make_pod, matches, parse_selector, status_object

K8S = "1.33"


def validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S, strict=True)


def validate_status(obj: dict[str, Any]) -> None:
    """meta/v1 Status is filed under ``status-meta-v1`` (kubernetes-validate's lookup by apiVersion misses it)."""
    import jsonschema
    from kubernetes_validate.utils import latest_version, schema_contents
    from referencing import Registry, Resource

    folder = f"kubernetes-json-schema/v{latest_version()}-local-strict"
    schema = schema_contents(f"{folder}/status-meta-v1.json", K8S)
    registry: Registry[Any] = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(schema_contents(f"{folder}/_definitions.json", K8S)) @ registry
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(obj)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validators.Draft202012Validator(schema, registry=registry).validate({**obj, "code": "410"})


def test_objects_match_the_official_schemas() -> None:
    for pod in (make_pod("a"), make_pod("b", ready=False), make_pod("c", phase="Pending", ready=False)):
        validate({"kind": "Pod", "apiVersion": "v1", **pod})
    validate({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": [make_pod("a")]})
    validate_status(status_object(410, "Expired", "too old resource version"))


def test_selectors() -> None:
    labels = {"app": "vllm", "pool": "a"}
    assert matches(parse_selector("app=vllm"), labels)
    assert matches(parse_selector("app==vllm,pool in (a, b)"), labels)
    assert not matches(parse_selector("app=vllm,pool notin (a)"), labels)
    assert matches(parse_selector("app,!gpu"), labels)
    assert not matches(parse_selector("app!=vllm"), labels)
    with pytest.raises(ValueError):
        parse_selector("app=(")


async def read_events(url: str, params: dict[str, str], count: int) -> list[dict[str, Any]]:
    """Raw wire check: chunked transfer, one JSON event per line."""
    events: list[dict[str, Any]] = []
    headers = {"Authorization": "Bearer s3cret"}
    async with (
        httpx.AsyncClient(timeout=5, trust_env=False) as client,
        client.stream("GET", url, params=params, headers=headers) as resp,
    ):
        assert resp.status_code == 200
        assert resp.headers["transfer-encoding"] == "chunked"
        assert resp.headers["content-type"].startswith("application/json")
        async for line in resp.aiter_lines():
            if line:
                events.append(orjson.loads(line))
            if len(events) >= count:
                break
    return events


async def test_list_and_watch_wire_format(apiserver: KubeApiServer) -> None:
    apiserver.add(make_pod("vllm-0"))
    apiserver.add(make_pod("web", labels={"app": "web"}))
    url = apiserver.url + "/api/v1/namespaces/default/pods"
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        assert (await client.get(url)).status_code == 401
        listed = (
            await client.get(url, params={"labelSelector": "app=vllm"}, headers={"Authorization": "Bearer s3cret"})
        ).json()
    validate(listed)
    assert [p["metadata"]["name"] for p in listed["items"]] == ["vllm-0"]
    version = listed["metadata"]["resourceVersion"]
    task = asyncio.create_task(
        read_events(
            url,
            {"labelSelector": "app=vllm", "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true"},
            4,
        )
    )
    await asyncio.sleep(0.3)
    apiserver.update("vllm-0", ready=False)
    apiserver.update("web", labels={"app": "vllm"})  # starts matching: ADDED for this watch
    apiserver.delete("vllm-0")
    events = await asyncio.wait_for(task, 5)
    kinds = [e["type"] for e in events]
    assert [k for k in kinds if k != "BOOKMARK"] == ["MODIFIED", "ADDED", "DELETED"], kinds
    assert "BOOKMARK" in kinds, kinds
    for event in events:
        if event["type"] == "BOOKMARK":
            assert set(event["object"]) == {"kind", "apiVersion", "metadata"}
            continue
        validate(event["object"])
        assert int(event["object"]["metadata"]["resourceVersion"]) > int(version)


async def test_lightkube_lists_and_watches_the_stand_in(apiserver: KubeApiServer) -> None:
    apiserver.add(make_pod("vllm-0"))
    config = KubeConfig.from_dict(
        {
            "clusters": [{"name": "c", "cluster": {"server": apiserver.url}}],
            "users": [{"name": "u", "user": {"token": "s3cret"}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "default"}}],
            "current-context": "x",
        }
    )
    client = AsyncClient(config)
    try:
        listing = client.list(Pod, namespace="default", labels={"app": "vllm"})
        pods = [pod async for pod in listing]
        assert [p.metadata.name for p in pods] == ["vllm-0"]
        assert pods[0].status.podIP == "127.0.0.1"
        version = listing.resourceVersion

        def raise_all(exc: Exception, count: int) -> OnErrorResult:
            return OnErrorResult(OnErrorAction.RAISE)

        seen: list[tuple[str, str | None]] = []

        async def watch() -> None:
            async for kind, pod in client.watch(
                Pod, namespace="default", labels={"app": "vllm"}, resource_version=version, on_error=raise_all
            ):
                seen.append((kind, pod.metadata.name))

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        apiserver.add(make_pod("vllm-1"))
        await asyncio.sleep(0.2)
        apiserver.expire_watches()
        with pytest.raises(ApiError) as info:
            await asyncio.wait_for(task, 5)
        assert info.value.status.code == 410
        assert ("ADDED", "vllm-1") in seen
    finally:
        await client.close()
