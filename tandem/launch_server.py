"""`python -m tandem.launch_server --model-path DIR|FILE.gguf`: start a Tandem server.

NOTE: everything but argparse is imported inside main(): the scheduler and detokenizer
processes are spawned, and a spawned child imports the parent's main module (this one)
before its target's; imports here would load the HTTP stack (FastAPI, uvicorn, the
routes) into every child as well."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    from tandem.entrypoints.http_server import launch_server
    from tandem.entrypoints.subprocesses import StartupError
    from tandem.model_executor.model_loader import check_model
    from tandem.server_args import ServerArgs
    from tandem.utils.process import exit_now

    parser = argparse.ArgumentParser(prog="python -m tandem.launch_server", description=__doc__)
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
    try:
        server_args.validate()
        check_model(server_args)
    except ValueError as e:  # one line naming the flag, like argparse's own errors
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    try:
        launch_server(server_args)
    except StartupError as e:  # a subprocess failed to start; it has logged its own details
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    exit_now(0)  # everything has shut down; skip the slow interpreter teardown


if __name__ == "__main__":
    main()
