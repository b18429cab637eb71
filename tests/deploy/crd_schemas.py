"""Small JSON schemas for the custom resources the chart renders, which kubernetes-validate cannot know.

kubernetes-validate carries the schemas of Kubernetes' own API groups only. For the CRDs the chart can emit
these schemas check what an API server with the CRD installed would refuse (required fields, types, enums,
ranges), written from the CRDs themselves:

- ``InferencePool`` (``inference.networking.k8s.io/v1``): from ``config/crd/bases/
  inference.networking.k8s.io_inferencepools.yaml`` of kubernetes-sigs/gateway-api-inference-extension,
  v1.0.0 to v1.6.0. The chart keeps to what every v1 release accepts: ``endpointPickerRef`` always set
  (required in v1.0.0), one target port (v1.0.0 allows one; later releases up to eight), ``appProtocol``
  only when asked (v1.4.0 and later).
- ``ServiceMonitor`` (``monitoring.coreos.com/v1``): from prometheus-operator's CRD (``spec.selector`` and
  ``spec.endpoints`` required; endpoints by port name).
- ``HTTPRoute`` (``gateway.networking.k8s.io/v1``): the fields the chart sets, from Gateway API v1.

Unknown fields are refused here (``additionalProperties: false``) although a real API server would prune
them silently: a misspelt field is a bug either way, and this is where it shows.
"""

from __future__ import annotations

from typing import Any

import jsonschema

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_LABEL_VALUE = {"type": "string", "maxLength": 63, "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}
#: Prometheus durations as the operator's CRD accepts them (1h30m, 15s, 500ms).
_DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": _DNS_LABEL,
        "namespace": _DNS_LABEL,
        "labels": {"type": "object", "additionalProperties": _LABEL_VALUE},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def _resource(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
    }


INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    {
        "type": "object",
        "additionalProperties": False,
        "required": ["selector", "targetPorts", "endpointPickerRef"],
        "properties": {
            "selector": {
                "type": "object",
                "additionalProperties": False,
                "required": ["matchLabels"],
                "properties": {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "additionalProperties": _LABEL_VALUE,
                    }
                },
            },
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 1,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["number"],
                    "properties": {"number": _PORT},
                },
            },
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
            "endpointPickerRef": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name"],
                "properties": {
                    "group": {"type": "string", "maxLength": 253},
                    "kind": {"type": "string", "pattern": r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"},
                    "name": _NAME,
                    "port": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["number"],
                        "properties": {"number": _PORT},
                    },
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                # The CRD's CEL rule: port is required when kind is Service (or unset, which means Service).
                "if": {"not": {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}}},
                "then": {"required": ["name", "port"]},
            },
        },
    },
)

SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    {
        "type": "object",
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": {
                "type": "object",
                "properties": {
                    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "matchExpressions": {"type": "array"},
                },
                "additionalProperties": False,
            },
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {
                        "port": {"type": "string", "minLength": 1},
                        "targetPort": {"type": ["string", "integer"]},
                        "path": {"type": "string", "pattern": "^/"},
                        "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {
                            "type": "string",
                            "pattern": _DURATION,
                        },
                    },
                    "additionalProperties": False,
                },
            },
        },
        "additionalProperties": False,
    },
)

HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "parentRefs": {
                "type": "array",
                "maxItems": 32,
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "group": {"type": "string"},
                        "kind": {"type": "string"},
                        "namespace": _DNS_LABEL,
                        "name": _NAME,
                        "sectionName": {"type": "string"},
                        "port": _PORT,
                    },
                },
            },
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "maxItems": 16,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matches": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "path": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                            "value": {"type": "string", "pattern": "^/", "maxLength": 1024},
                                        },
                                    }
                                },
                            },
                        },
                        "backendRefs": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["name"],
                                "additionalProperties": False,
                                "properties": {
                                    "group": {"type": "string"},
                                    "kind": {"type": "string"},
                                    "name": _NAME,
                                    "namespace": _DNS_LABEL,
                                    "port": _PORT,
                                    "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
)

#: (apiVersion, kind) -> schema, for every custom resource the chart may render.
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCE_POOL,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTP_ROUTE,
}


def validate_custom_resource(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when ``obj`` breaks its CRD's rules (KeyError: not a known CRD)."""
    schema = CRD_SCHEMAS[(obj["apiVersion"], obj["kind"])]
    jsonschema.Draft202012Validator(schema).validate(obj)
