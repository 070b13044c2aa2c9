"""The ``oakenkv`` command line. Thin: each command checks its arguments, then calls the library.

Commands import their library modules inside the function body so that ``oakenkv --help`` stays fast.

Errors a user can cause (a bad argument, a missing or corrupt file, a model path that is no model, a resource
limit) end the command with one ``error: ...`` line on stderr and exit code 2, never a traceback
(:func:`run`); ``--debug`` (anywhere on the line) or ``OAKENKV_DEBUG=1`` prints the traceback too. Every
command validates its arguments before anything expensive (loading a model, profiling, benchmarking): numbers
by their option's range, names against what exists, files by opening them, output paths by where they would be
written, memory by what the machine has. A bug (any other exception) still prints its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any

import typer

try:  # typer >= 0.24 runs on its own copy of click: its exceptions are the ones raised
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - older typer, on the click package
    from click import exceptions as _cx

# The command modules register their commands on ``app`` (and its sub-apps) when imported.
from oakenkv.cli import apps, bench, calibrate, eval, export, hw, sim  # noqa: F401
from oakenkv.cli._common import USER_ERROR, USER_ERRORS, app, message, print_error, show_warning


@functools.cache
def _command() -> Any:
    """The click command typer builds from ``app`` (built once: building it evaluates every command's signature)."""
    return typer.main.get_command(app)


def run(argv: list[str] | None = None, prog_name: str = "oakenkv") -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit code: 0, ``USER_ERROR`` (2)
    with one ``error:`` line for an error the user can fix, 130 on Ctrl-C. Other exceptions (bugs) propagate."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("OAKENKV_DEBUG", "") not in ("", "0")
    args = [a for a in args if a != "--debug"]
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        try:
            code = _command().main(args=args, prog_name=prog_name, standalone_mode=False)
            return code if isinstance(code, int) else 0
        except _cx.NoArgsIsHelpError as e:  # a group without a command: its help, as click prints it
            print(e.format_message(), file=sys.stderr)
            return USER_ERROR
        except _cx.UsageError as e:
            if debug:
                import traceback

                traceback.print_exc()
            where = e.ctx.command_path if e.ctx is not None else prog_name
            print_error(f"{e.format_message()} (see `{where} --help`)")
            return USER_ERROR
        except typer.Exit as e:
            return e.exit_code
        except typer.Abort:
            print_error("aborted")
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except USER_ERRORS as e:
            if debug:
                import traceback

                traceback.print_exc()
            print_error(message(e))
            return USER_ERROR


def main() -> None:
    """The console script: :func:`run` on ``sys.argv``, exiting with its code."""
    sys.exit(run())
