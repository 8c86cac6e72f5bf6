"""The ``flotilla`` command.

Subcommands import what they need lazily: ``flotilla resolve`` touches only
``flotilla.resolution`` (no torch, no ray) and answers in well under a second.
"""

from __future__ import annotations

import sys
from typing import Sequence

USAGE = """usage: flotilla <command> [options]

commands:
  resolve   resolve the server configuration for a model and platform, and print it
  serve     start the OpenAI-compatible endpoint on a Ray cluster
  bench     measure the in-process engine (`flotilla bench latency` / `flotilla bench offline`)
  deploy    deployment tools (`flotilla deploy wheelhouse DIR`: every wheel an air-gapped node needs)

run `flotilla <command> --help` for a command's options.
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "resolve":
        from flotilla.deploy.resolve_cmd import run_resolve

        return run_resolve(rest)
    if command == "bench":
        from flotilla.deploy.bench import run_bench

        return run_bench(rest)
    if command == "serve":
        from flotilla.deploy.serve_cmd import run_serve

        return run_serve(rest)
    if command == "deploy":
        return _deploy(rest)
    print(f"flotilla: unknown command {command!r}\n\n{USAGE}", file=sys.stderr, end="")
    return 2


DEPLOY_USAGE = """usage: flotilla deploy <tool> [options]

tools:
  wheelhouse  collect flotilla's wheel and every dependency's into a folder, for `pip install --no-index`
"""


def _deploy(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(DEPLOY_USAGE, end="")
        return 0 if argv else 2
    if argv[0] == "wheelhouse":
        from flotilla.deploy.wheelhouse import run_wheelhouse

        return run_wheelhouse(argv[1:])
    print(f"flotilla deploy: unknown tool {argv[0]!r}\n\n{DEPLOY_USAGE}", file=sys.stderr, end="")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
