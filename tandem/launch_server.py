"""`python -m tandem.launch_server --model-path DIR`: start a Tandem server."""

from __future__ import annotations

import argparse

from tandem.entrypoints.http_server import launch_server
from tandem.server_args import ServerArgs
from tandem.utils.process import exit_now


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tandem.launch_server", description=__doc__)
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    try:
        server_args.validate()
    except ValueError as e:  # one line naming the flag, like argparse's own errors
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    launch_server(server_args)
    exit_now(0)  # everything has shut down; skip the slow interpreter teardown


if __name__ == "__main__":
    main()
