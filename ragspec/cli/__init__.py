"""The `ragspec` command line (typer). Heavy imports happen inside commands, so `--help` is instant.

Each command group lives in its own module (`index`, `evaluate`, `bench`, `answer`, `models`); this one
builds the app and registers every command, in the order `--help` lists them."""

from __future__ import annotations

import typer

from ragspec.cli import answer, bench, evaluate, index, models

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="ragspec: retrieval-augmented generation with drafts copied from the retrieved context.",
    pretty_exceptions_enable=False,
)

app.command()(index.index)
app.command()(index.search)
app.command()(index.info)
app.command("eval-retrieval")(evaluate.eval_retrieval)
app.command("eval-attribution")(evaluate.eval_attribution)
app.command("eval-answers")(evaluate.eval_answers)
app.command("eval-compare")(evaluate.eval_compare)
app.command("bench-replay")(bench.bench_replay)
app.command("bench-search")(bench.bench_search)
app.command()(bench.bench)
app.command()(answer.ask)
app.command()(answer.serve)
app.command()(models.models)


def main():
    """The `ragspec` script: the app, then `exit_without_teardown` with its exit code."""
    try:
        app()
        code = 0
    except SystemExit as done:  # click ends every command this way, errors included
        code = done.code
    exit_without_teardown(code)


def exit_without_teardown(code) -> None:
    """End the process as a normal exit would, less Python's teardown of the modules it imported.

    After a command that imported torch and transformers, that teardown (freeing every module's objects one by
    one) took about 1.2 s of each `ragspec ask` and 1 s of each `search`, after the output was complete
    (docs/benchmarks.md, "A command's exit"). A normal exit's other steps are kept, in its order: non-daemon
    threads joined, atexit handlers run (logging's flush among them), the standard streams flushed (status 120
    where that fails, as Python does); then os._exit. A Python without those hooks (`threading._shutdown`,
    `atexit._run_exitfuncs`) exits the normal way."""
    import atexit
    import os
    import sys
    import threading

    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        code = 1
    join_threads, run_exit_handlers = getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_exit_handlers is None:
        sys.exit(code)
    join_threads()
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed pipe (`ragspec search … | head`)
            code = code or 120
    os._exit(code)
