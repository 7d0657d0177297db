"""The ``metronome`` command.

    metronome demo                      # the embedded default on the CPU: concurrent bounded sessions
    metronome demo --speech             # talk to it: bundled spoken questions, heard (Whisper) and answered
    metronome demo --model /path/to/hf_checkpoint --sessions 8
    metronome serve                     # worker + WebSocket gateway: the speech assistant; prints where to connect
    metronome serve --adapter energy    # the deterministic loudness-token stand-in instead
    metronome client speech.wav         # stream a WAV file through a session
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from importlib.metadata import PackageNotFoundError, version

from metronome.cpu import thread_wait_env


def installed_version() -> str:
    """The installed distribution's version; a source tree run through PYTHONPATH has none."""
    try:
        return version("metronome")
    except PackageNotFoundError:
        return "(not installed: running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    from metronome.cli import bench, client, demo, serving   # they load torch: after main() set its threads' env

    parser = argparse.ArgumentParser(prog="metronome", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(sub)
    serving.add_parsers(sub)
    client.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``metronome`` command. Without ``argv`` it owns the process (the console script, ``python -m
    metronome``) and ends it with ``exit_now``; with ``argv`` (a caller in the same process) it returns."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")   # gRPC's C core logs connection teardown at shutdown
    thread_wait_env(os.environ)   # idle OpenMP threads spin briefly, then sleep (read when torch loads)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = args.run(args) or 0
    except KeyboardInterrupt:
        code = 130
    if argv is None:
        exit_now(code)
    return code


def exit_now(code: int) -> None:
    """Exit once the command has closed what it opened, skipping interpreter teardown: there Triton's nanobind
    bindings report hundreds of "leaked" objects of their own, which drowned every Ctrl-C's log."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
