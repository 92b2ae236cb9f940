"""CLI: ``python -m serve_app.models {list,build NAME DIR,path NAME}``."""

from __future__ import annotations

import argparse
import sys

from serve_app.models import BUILTIN_MODELS, build_model, ensure_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve_app.models", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the builtin models")
    build = sub.add_parser("build", help="write a builtin model directory to DIR")
    build.add_argument("name", choices=sorted(BUILTIN_MODELS))
    build.add_argument("dir")
    path = sub.add_parser("path", help="build NAME into the cache if needed and print its directory")
    path.add_argument("name", choices=sorted(BUILTIN_MODELS))
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(sorted(BUILTIN_MODELS)))
    elif args.command == "build":
        print(build_model(args.name, args.dir))
    else:
        print(ensure_model(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
