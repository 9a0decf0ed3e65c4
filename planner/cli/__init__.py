"""The `shardplan` command line.

Exit codes: 0 ok, 2 bad input (a one-line message naming the cause), 3 no plan fits.

Each verb is a module here with `add_parser(verbs)` and `run(args)`; this module builds
the parser from them and turns what a run raises into one line and an exit code.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from planner.cli import (
    calibrate,
    compare,
    ending,
    explain,
    export,
    plan,
    profiles,
    run,
    validate,
    zoo,
)
from planner.cli.args import Parser, Verbs, one_line
from planner.errors import ShardplanError, SignalInterrupt

#: Each verb's parser, in `shardplan --help` order.
_ADD_PARSERS: tuple[Callable[[Verbs], None], ...] = (
    plan.add_parser, zoo.add_parser, run.add_parser, export.add_parser, calibrate.add_parser,
    profiles.add_parser, explain.add_parser, compare.add_parser, validate.add_parser,
)
#: Each verb's run; zoo's also takes the config flags argparse left over, so main calls it.
_RUNS: dict[str, Callable[[argparse.Namespace], int]] = {
    "plan": plan.run, "run": run.run, "export": export.run, "calibrate": calibrate.run,
    "profiles": profiles.run, "explain": explain.run, "compare": compare.run,
    "validate": validate.run,
}


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="shardplan", description=__doc__.splitlines()[0] if __doc__ else "")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=Parser)
    for add_parser in _ADD_PARSERS:
        add_parser(verbs)
    return parser


def console() -> NoReturn:
    """The `shardplan` console script: `main`, ending the process as `planner.cli.ending`
    says (a large plan's objects are not freed one by one)."""
    ending.console(main)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:  # bad flags (and --help) end argparse with SystemExit: return its code instead
        args, extra = parser.parse_known_args(argv)
        if extra and args.verb != "zoo":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as done:
        return int(done.code or 0)
    try:
        if args.verb == "zoo":
            return zoo.run(args, extra)
        return _RUNS[args.verb](args)
    except ShardplanError as exc:
        print(f"shardplan: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except SignalInterrupt as stopped:
        print(f"shardplan: stopped by {signal.Signals(stopped.signum).name}",
              file=sys.stderr)
        return 128 + stopped.signum
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("shardplan: error: this machine ran out of memory planning the model; try "
              "fewer devices per search (--parallel pins, --mesh) or a smaller --max-mesh-axes",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `shardplan ... | head`: the reader left; not an error
        _silence_stdout()
        return 0


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null so the interpreter's final flush
    does not raise again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
