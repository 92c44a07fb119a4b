"""The memaudit command line: one small module per command group in memaudit/commands/.

Only the CLI prints. Bad input becomes one line on stderr and exit code 2; `--debug`
shows the traceback. torch and jax are imported only inside the commands that need them.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

from memaudit import __version__
from memaudit.commands import data as data_cmd
from memaudit.commands import epsilon as epsilon_cmd
from memaudit.commands import parallel as parallel_cmd
from memaudit.commands import probe as probe_cmd
from memaudit.commands import report as report_cmd
from memaudit.commands import sweep as sweep_cmd
from memaudit.commands import train as train_cmd
from memaudit.errors import MemauditError

app = typer.Typer(
    name="memaudit",
    help="Measure what a language model memorized, and how much of that risk DP-SGD and "
    "federated DP-FedAvg remove.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
_state = {"debug": False}


def _version(value: bool) -> None:
    if value:
        typer.echo(f"memaudit {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks on errors.")] = False,
) -> None:
    _state["debug"] = debug


app.add_typer(data_cmd.app, name="data")
app.add_typer(parallel_cmd.app, name="parallel")
train_cmd.register(app)
probe_cmd.register(app)
report_cmd.register(app)
sweep_cmd.register(app)
epsilon_cmd.register(app)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit code (the console script exits with it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        rv = app(args=args, prog_name="memaudit", standalone_mode=False)
        code = rv if isinstance(rv, int) else 0
    except click_exc.NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help())
        code = 0
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        typer.echo("memaudit: aborted", err=True)
        code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except click_exc.ClickException as e:
        # usage errors: one line naming the problem, and where to look
        typer.echo(f"memaudit: error: {_one_line(Exception(e.format_message()))} (see --help)", err=True)
        code = 2
    except (MemauditError, ValueError, FileNotFoundError, PermissionError, UnicodeDecodeError) as e:
        if debug:
            raise
        typer.echo(f"memaudit: error: {_one_line(e)}", err=True)
        code = 2
    except KeyboardInterrupt:
        typer.echo("memaudit: interrupted", err=True)
        code = 130
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
