"""The typer application that every subcommand module registers on."""

import typer

app = typer.Typer(
    name="tuner",
    help="shapetuner: find a transformer's GEMM shapes in its ONNX graph, pad them to sizes the "
         "hardware likes without changing outputs, measure, and serve the fastest exact variant.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # docstrings are wrapped at 100 columns in the source: let click rewrap them to the terminal
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from tuner import __version__

        write_out(f"tuner (shapetuner) {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version,
                                       is_eager=True, help="print the version and exit")) -> None:
    # `tuner`'s own options (the help text is the app's, above)
    del version


class ReaderWentAway(Exception):
    """stdout's reader closed the pipe (`tuner inspect X | head`). Not an OSError on purpose:
    click turns a BrokenPipeError into its own exit 1; the entry point answers this with 141,
    as a program killed by SIGPIPE exits."""


def write_out(text: str) -> None:
    """Write `text` to stdout and flush; ReaderWentAway when the reader has gone."""
    import sys

    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise ReaderWentAway() from None


ROLES_HELP = ("NAME=ROLE: give graph input NAME the role ROLE (token_ids, attention_mask, "
              "position_ids, token_type_ids, kv_cache, inputs_embeds, other) where the graph's "
              "structure cannot decide; repeatable")


def exit_not_exact(accuracy, as_json: bool, what: str):
    """A gated rewrite that failed its gate: the accuracy table (or JSON) on stdout, one line
    on stderr, exit 1 (nothing was written)."""
    import json

    if as_json:
        print(json.dumps({"written": False, "accuracy": accuracy.to_json()}))
    else:
        print(accuracy.table())
        typer.echo(f"tuner: the {what} is not exact; nothing was written", err=True)
    raise SystemExit(1)  # not typer.Exit: click would drop the code


def roles_option():
    """The `--roles NAME=ROLE` option every command takes (see `with_roles`)."""
    return typer.Option([], "--roles", help=ROLES_HELP)


def with_roles(command):
    """Run a command whose `roles` parameter holds `--roles` values with those overrides in
    force (tuner.graph.roles.overriding), for every model it reads."""
    import functools

    @functools.wraps(command)
    def run(*args, **kwargs):
        from tuner.graph.role_overrides import overriding, parse_roles

        with overriding(parse_roles(kwargs.get("roles") or [])):
            return command(*args, **kwargs)

    return run
