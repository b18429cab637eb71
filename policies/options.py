"""Reading policy options: config values (YAML/JSON scalars) checked into the types a policy computes with.

Options arrive untyped (``policy_options`` in the config, ``create_policy(name, **options)``); each policy
refuses names it does not know and converts the values it uses here, so a wrong type is a ``ValueError``
naming the option at construction, not a ``TypeError`` in the middle of a decision.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping


def refuse_unknown(policy: str, options: Mapping[str, object], known: Collection[str]) -> None:
    """``ValueError`` listing the known options when ``options`` names any other."""
    unknown = set(options) - set(known)
    if unknown:
        raise ValueError(f"unknown {policy} options {sorted(unknown)}; known: {sorted(known)}")


def as_float(value: object, what: str) -> float:
    """``float(value)`` for numbers and numeric strings; ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, int | float | str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ValueError(f"{what} must be a number, got {value!r}")


def as_int(value: object, what: str) -> int:
    """``int(value)`` for numbers and integer strings; ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, int | float | str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"{what} must be an integer, got {value!r}")
