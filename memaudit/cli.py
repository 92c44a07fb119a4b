"""The memaudit command line: one small module per command group in memaudit/commands/.

Only the CLI prints. Bad input becomes one line on stderr and exit code 2; `--debug`
shows the traceback. torch and jax are imported only inside the commands that need them.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import warnings
from typing import Annotated

import typer

try:  # typer >= 0.20 vendors click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover
    from click import exceptions as click_exc

import pickle

from memaudit import __version__
from memaudit.commands import collect as collect_cmd
from memaudit.commands import data as data_cmd
from memaudit.commands import epsilon as epsilon_cmd
from memaudit.commands import parallel as parallel_cmd
from memaudit.commands import probe as probe_cmd
from memaudit.commands import report as report_cmd
from memaudit.commands import sweep as sweep_cmd
from memaudit.commands import train as train_cmd
from memaudit.errors import MemauditError, without_values

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
collect_cmd.register(app)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# where a disk or quota is full, and what to do
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# libraries whose log lines would come before memaudit's own one line
QUIET_LOGGERS = ("datasets", "transformers", "huggingface_hub", "jax", "jaxlib", "absl", "torch",
                 "flwr", "submitit", "filelock", "urllib3")


def _os_error_line(exc: OSError) -> str:
    name = exc.filename if exc.filename is not None else "a file"
    if exc.errno in _FULL:
        return (f"{_FULL[exc.errno]} writing '{name}'; free space there (or raise the quota), or "
                "choose another --out on a disk with room")
    what = exc.strerror or type(exc).__name__
    return f"{what}: '{name}'; check the path, its type (file or folder) and its permissions"


def error_line(exc: BaseException) -> str:
    """The one line shown for an error: memaudit's own message, or for an error from the OS,
    torch, safetensors, JSON or YAML a line naming the file, the cause and what to do. A data
    value quoted by Python's conversion errors is never shown."""
    if isinstance(exc, MemauditError):
        return _one_line(exc)
    if isinstance(exc, ValueError) and not isinstance(exc, UnicodeDecodeError):
        return without_values(_one_line(exc))  # a data value quoted by Python is never shown
    if isinstance(exc, ImportError):
        return (f"a part of memaudit or one of its dependencies is missing ({_one_line(exc)}); "
                "reinstall memaudit (bash scripts/setup.sh, or pip install -e . with the extra you need)")
    if isinstance(exc, OSError):
        return _os_error_line(exc)
    if isinstance(exc, UnicodeDecodeError):
        return "a file is not valid UTF-8 text; give a UTF-8 file"
    if isinstance(exc, pickle.UnpicklingError):
        return ("a file holds a pickled object, which memaudit does not load (unpickling can run code); "
                "give a safetensors checkpoint (model.safetensors) or a run directory memaudit wrote")
    if isinstance(exc, MemoryError):
        return (f"out of memory ({_one_line(exc)[:120]}); ask for less (fewer steps, e.g. a smaller -T; "
                "a smaller batch, model or probe set) or use a machine with more memory")
    return (f"unexpected {type(exc).__name__}: {_one_line(exc)[:200]} (re-run with --debug for the "
            "traceback, and report it if the input looks right)")


def quiet_libraries() -> None:
    """Only memaudit's own line on stderr: the libraries' log lines and warnings off (`--debug`
    keeps them).
    datasets and transformers read their verbosity from the environment when they load."""
    os.environ.setdefault("DATASETS_VERBOSITY", "critical")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "critical")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # the worker processes a sweep starts
    for name in QUIET_LOGGERS:  # CRITICAL, a level JAX accepts (jax_logging_level mirrors its logger)
        logging.getLogger(name).setLevel(logging.CRITICAL)


def main(argv: list[str] | None = None) -> int:
    """Entry point. Returns the exit code (the console script exits with it)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    if not debug:
        quiet_libraries()
    try:
        with warnings.catch_warnings():
            if not debug:  # a library's warnings (transformers, torch, sklearn) are not the user's
                warnings.simplefilter("ignore")
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
    except KeyboardInterrupt:
        typer.echo("memaudit: interrupted", err=True)
        code = 130
    except Exception as e:
        if debug:
            raise
        typer.echo(f"memaudit: error: {error_line(e)}", err=True)
        code = 2
    if argv is None:
        sys.exit(code)
    return code


if __name__ == "__main__":
    main()
