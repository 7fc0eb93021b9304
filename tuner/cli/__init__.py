"""Console entry point `tuner`. Parsing and printing only: the work is in the modules below
tuner/. Exit codes (DESIGN.md): 0 success, 2 bad input (one line on stderr), 1 internal."""

from __future__ import annotations

import sys

from tuner.cli.app import app
from tuner.errors import BadInput

# Each module registers its subcommands on `app` when imported, in the order --help lists
# them: the data flow (inspect -> pad/verify -> optimize -> serve), then design.
from tuner.cli import inspect_cmd  # noqa: F401,E402
from tuner.cli import pad_cmd, verify_cmd  # noqa: F401,E402
from tuner.cli import optimize_cmd  # noqa: F401,E402
from tuner.cli import serve_cmd  # noqa: F401,E402
from tuner.cli import design_cmd  # noqa: F401,E402

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
    except SystemExit as e:  # typer.Exit / click usage errors raised in standalone-free mode
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - the last line of defence: exit 1, say what broke
        import click

        if isinstance(e, click.exceptions.Exit):
            return e.exit_code
        if isinstance(e, click.ClickException):
            e.show()
            return EXIT_BAD_INPUT
        if isinstance(e, click.exceptions.Abort):
            print("tuner: aborted", file=sys.stderr)
            return 130
        import traceback

        traceback.print_exc()
        print(f"tuner: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_INTERNAL
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
