"""`python -m tandem.launch_server --model-path DIR`: start a Tandem server."""

from __future__ import annotations

import argparse

from tandem.entrypoints.http_server import launch_server
from tandem.server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.launch_server", description=__doc__)
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    launch_server(ServerArgs.from_cli_args(args))


if __name__ == "__main__":
    main()
