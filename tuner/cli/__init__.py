"""Console entry point `tuner`. Parsing and printing only: the work is in the modules below
tuner/. Exit codes (docs/design.md): 0 success, 2 bad input (one line on stderr), 1 internal."""

from __future__ import annotations

import sys

# Each module registers its subcommands on `app` when imported, in the order --help lists
# them: the data flow (inspect -> pad/verify -> optimize -> serve), then design. A command
# imports its work inside its function, so that `tuner --help` and each command start without
# loading onnx, onnxruntime or the server (0.2 s rather than 1.9 s for `--help`;
# tests/test_cli_errors.py checks it).
from tuner.cli import design_cmd  # noqa: F401,E402
from tuner.cli import inspect_cmd  # noqa: F401,E402
from tuner.cli import optimize_cmd  # noqa: F401,E402
from tuner.cli import serve_cmd  # noqa: F401,E402
from tuner.cli import convert_cmd, pad_cmd, verify_cmd  # noqa: F401,E402
from tuner.cli.app import ReaderWentAway, app
from tuner.errors import BadInput

EXIT_OK, EXIT_INTERNAL, EXIT_BAD_INPUT = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; turn BadInput into exit 2 with one line, anything unexpected into exit 1."""
    try:
        rv = app(args=argv, prog_name="tuner", standalone_mode=False)
        # Without standalone mode typer *returns* exit codes: Ctrl-C comes back as 130,
        # `raise typer.Exit(n)` as n. Commands themselves return None.
        if isinstance(rv, int) and not isinstance(rv, bool) and rv:
            if rv == 130:
                print("tuner: interrupted", file=sys.stderr)
            return rv
    except BadInput as e:
        print(f"tuner: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("tuner: interrupted", file=sys.stderr)
        return 130
    except (BrokenPipeError, ReaderWentAway):
        return _reader_went_away()
    except SystemExit as e:  # typer.Exit / click usage errors raised in standalone-free mode
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - the last line of defence: exit 1, say what broke
        return _handle_other(e)
    return EXIT_OK


def _handle_other(e: Exception) -> int:
    """Usage errors, Exit and Abort from the parser, else an internal error (exit 1).

    Matched by name along the class's ancestry, not by class: older typer raises click's
    exceptions, newer typer (0.29 here) its own vendored copies (typer._click), and an
    isinstance check against one set lets the other through as a traceback with exit 1."""
    names = {cls.__name__ for cls in type(e).__mro__}
    if "Exit" in names and hasattr(e, "exit_code"):
        return int(e.exit_code)
    if "Abort" in names:
        print("tuner: aborted", file=sys.stderr)
        return 130
    if "NoArgsIsHelpError" in names:  # bare `tuner` or `tuner CMD`: the help is the answer
        print(e.format_message(), file=sys.stderr)
        return EXIT_BAD_INPUT
    if "ClickException" in names:  # bad flag, missing argument, out-of-range value
        print(f"tuner: error: {_one_line(e.format_message())}{_help_hint(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import traceback

    traceback.print_exc()
    print(f"tuner: internal error: {type(e).__name__}: {e}", file=sys.stderr)
    return EXIT_INTERNAL


def _reader_went_away() -> int:
    """`tuner ... | head`: the reader closed the pipe, which is no error of ours. Point stdout
    at /dev/null so the interpreter's final flush cannot raise again, and exit as a program
    killed by SIGPIPE would (128 + 13), as `cat` and friends do."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured): nothing to flush
        pass
    return 141


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _help_hint(e: Exception) -> str:
    ctx = getattr(e, "ctx", None)
    path = getattr(ctx, "command_path", None)
    return f" (see '{path} --help')" if path else ""


if __name__ == "__main__":
    sys.exit(main())
