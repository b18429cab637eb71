"""The router: HTTP surface, forwarding, worker registry, admin REST and the CLI."""
