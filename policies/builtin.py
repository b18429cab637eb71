"""Imports every built-in policy module so their @register_policy decorators run."""

from kvroute.policies import least_load, round_robin  # noqa: F401
