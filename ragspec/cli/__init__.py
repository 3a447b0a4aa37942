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


def main():  # pragma: no cover
    app()
