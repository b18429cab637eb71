"""The ``kvroute`` command: one entry point, subcommands provided by the packages that own them.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func`` (a callable taking the parsed namespace and returning an exit code). Modules are imported
here only, so ``kvroute sim`` never loads the router and ``kvroute serve`` never loads the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand -> module providing add_parser()
SUBCOMMANDS = {
    "serve": "kvroute.apps.serve",
    "indexer": "kvroute.apps.indexer",
    "sim": "kvroute.apps.sim",
    "demo": "kvroute.apps.demo",
    "epp": "kvroute.apps.epp",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware router for vLLM pools")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Import only the module of the requested subcommand (or all of them for --help).
    wanted = [a for a in argv if a in SUBCOMMANDS][:1] or list(SUBCOMMANDS)
    for name in wanted:
        try:
            module = importlib.import_module(SUBCOMMANDS[name])
        except ModuleNotFoundError as exc:
            if not exc.name or not exc.name.startswith("kvroute"):
                raise
            subparsers.add_parser(name, help="(not available in this build)")
            continue
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        print(f"kvroute {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
