"""One check for every object the chart (or docs/deploy.md) renders, offline.

Objects of Kubernetes' own API groups: kubernetes-validate's schemas, strict (unknown fields are errors), for
the oldest Kubernetes the chart supports (Chart.yaml ``kubeVersion``) and the newest the library knows.
Custom resources, which it has no schema for: the CRD schemas of crd_schemas.py.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate

from tests.deploy.crd_schemas import CRD_SCHEMAS, validate_custom_resource

K8S_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())


def check_object(obj: dict[str, Any]) -> None:
    """Raise AssertionError, saying where and why, unless ``obj`` is valid."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if (obj["apiVersion"], obj["kind"]) in CRD_SCHEMAS:
        try:
            validate_custom_resource(obj)
        except jsonschema.ValidationError as exc:
            raise AssertionError(
                f"{where} breaks its CRD's schema: {exc.message} at {list(exc.absolute_path)}"
            ) from None
        return
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(
                f"{where} is invalid for Kubernetes {version}: {exc.message} at {list(exc.path)}"
            ) from None
        except kubernetes_validate.SchemaNotFoundError:
            raise AssertionError(
                f"{where}: no Kubernetes {version} schema and no CRD schema for {obj['apiVersion']}"
            ) from None
