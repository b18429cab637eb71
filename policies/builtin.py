"""Imports every built-in policy module so their @register_policy decorators run."""

from kvroute.policies import approx_text, cost, least_load, prefix, round_robin  # noqa: F401
