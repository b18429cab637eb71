"""Policies by name: the built-in ones plus any registered under the ``kvroute.policies`` entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

from kvroute.policies.base import Policy, PoolContext

_REGISTRY: dict[str, type[Policy]] = {}
_entry_points_loaded = False


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its ``name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def _load_builtins_and_plugins() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    import kvroute.policies.builtin  # noqa: F401  (registers the built-in policies)

    for ep in entry_points(group="kvroute.policies"):
        cls = ep.load()
        if isinstance(cls, type) and issubclass(cls, Policy):
            _REGISTRY.setdefault(cls.name or ep.name, cls)


def available_policies() -> list[str]:
    _load_builtins_and_plugins()
    return sorted(_REGISTRY)


def create_policy(name: str, pool: PoolContext | None = None, **options: object) -> Policy:
    """A new policy instance; unknown names raise KeyError listing what exists.

    With ``pool``, the policy is built through :meth:`Policy.for_pool` so it can use the pool's facts.
    """
    _load_builtins_and_plugins()
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; available: {', '.join(sorted(_REGISTRY))}") from None
    return cls.for_pool(pool, **options) if pool is not None else cls(**options)
