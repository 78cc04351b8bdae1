"""The CLI's error boundary and its consoles: every failure becomes one ``error: ...`` line.

:func:`error_boundary` wraps each command: a user error (``ValueError`` and friends raised with a message
naming the culprit, :class:`CLIError`, an infeasible constraint set, a data-dependent op met while
tracing, with the model's own source line) prints as one line on stderr with exit code 2; ``-vv``
re-raises instead. A reader that closes the pipe early is not a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import NoReturn

import click
import typer
from rich.console import Console
from rich.text import Text

logger = logging.getLogger("apmodel.cli")


class _ResultConsole(Console):
    """The results console: a reader that closes the pipe early (``apmodel explain ... | head
    -1``) took what it wanted, which is not a failure (rich exits 1 there)."""

    def on_broken_pipe(self) -> None:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        raise SystemExit(0)


def results_console() -> Console:
    """Console for results on stdout; wide tables when stdout is not a terminal (pipes, files)."""
    console = _ResultConsole()
    if not console.is_terminal:
        console.width = 140
    return console


class CLIError(Exception):
    """A user error the CLI found itself; printed as is (one line, exit code 2)."""


def _one_line(text: str) -> str:
    """The first non-empty line of ``text``: an error is always one line on the terminal."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return str(text).strip()


def _fail(msg: str, code: int = 2) -> NoReturn:
    """Print ``error: msg`` on stderr as one literal line and exit with ``code``.

    ``msg`` goes in a ``Text`` (no markup: ``[workload]`` stays) and ``soft_wrap`` keeps a long
    message on one line for scripts that grep it."""
    console = Console(stderr=True, soft_wrap=True, highlight=False)
    console.print(Text.assemble(("error:", "bold red"), " ", _one_line(msg)))
    raise typer.Exit(code)


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (outermost first)."""
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return chain


def _user_frame(chain: list[BaseException]) -> str | None:
    """``file:line in function`` of the innermost frame of user code (the model) in a traceback."""
    import sysconfig
    import traceback

    import torch

    skip = tuple(os.path.join(d, "") for d in (os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"]))
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the apmodel package
    for exc in reversed(chain):  # innermost exception first
        frames = traceback.extract_tb(exc.__traceback__)
        # apmodel's torch-function mode (capture's constants) runs inside the model's own calls: not a caller
        ours_at = [i for i, f in enumerate(frames)
                   if os.path.abspath(f.filename).startswith(ours) and f.name != "__torch_function__"]
        # only frames called from apmodel (the model's code), never the CLI machinery around it
        start = ours_at[-1] + 1 if ours_at else 0
        user = [f for f in frames[start:] if not f.filename.startswith("<")
                and not os.path.abspath(f.filename).startswith((*skip, ours))]
        if user:
            f = user[-1]
            return f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
    return None


def _data_dependent(exc: BaseException) -> str | None:
    """A one-line description of a data-dependent op hit while tracing, or None."""
    chain = _exception_chain(exc)
    from apmodel._torch_private import is_data_dependent_error  # torch's own error classes

    hit = next((e for e in chain if is_data_dependent_error(e)), None)
    if hit is None:
        return None
    func = getattr(hit, "func", None)
    op = str(func) if func is not None else None
    if op is None:
        what = f"a data-dependent value ({_one_line(str(hit))})"
    elif "_local_scalar_dense" in op:
        what = f"data-dependent op {op} (Tensor.item(), or Python control flow on a tensor value)"
    elif type(hit).__name__ == "DynamicOutputShapeException":
        what = f"data-dependent op {op} (its output shape depends on tensor values)"
    else:
        what = f"data-dependent op {op}"
    where = _user_frame(chain)
    return (f"{what}{f' at {where}' if where else ''}: the planner traces on the meta device, where tensor "
            "values are unknown; shapes and control flow must not depend on them")


def describe_error(exc: BaseException) -> str:
    """The one-line message the CLI prints for ``exc`` (it names the offending thing)."""
    import solvers

    if isinstance(exc, CLIError):
        return str(exc)
    if isinstance(exc, solvers.Infeasible):
        return f"infeasible: {exc}"
    dd = _data_dependent(exc)
    if dd is not None:
        return dd
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return exc.args[0]  # str(KeyError) adds quotes around the message
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, (ValueError, KeyError)):
        return str(exc)  # our libraries raise these with a message naming the culprit
    return f"{type(exc).__name__}: {_one_line(str(exc))} (run with -vv for the traceback)"


@contextlib.contextmanager
def error_boundary(verbose: int = 0) -> Iterator[None]:
    """The CLI's one error boundary: any exception becomes one ``error:`` line and exit code 2.

    ``-vv`` re-raises instead, so the traceback is there when debugging."""
    try:
        yield
    except (click.exceptions.Exit, click.exceptions.Abort, click.exceptions.ClickException):
        raise  # typer.Exit from _fail, usage errors: click prints and exits itself
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except BrokenPipeError:  # the reader closed the pipe early (`apmodel explain ... | head -1`): not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush goes nowhere
        raise typer.Exit(0) from None
    except Exception as e:
        if verbose >= 2:
            raise
        logger.debug("command failed", exc_info=True)
        _fail(describe_error(e))
