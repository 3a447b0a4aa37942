"""`ragspec models`: the model registry, converting an embedded generator, and `--calibrate`'s table."""

from __future__ import annotations

from pathlib import Path

import typer

from ragspec.cli.common import run
from ragspec.console import quiet_libraries
from ragspec.errors import RagspecError


def models(
    prepare: str | None = typer.Option(None, "--prepare", help="make what a generator's GGUF runs with now (config, "
                                       "tokenizer, packed blocks; otherwise on the first ask)"),
    verify: bool = typer.Option(False, "--verify", help="re-hash every cached model file"),
    calibrate: bool = typer.Option(False, "--calibrate", help="measure (or show) which backend and dtype run "
                                   "a generator fastest on this machine: what generator.backend auto takes"),
    model: str | None = typer.Option(None, "--model", help="the generator to calibrate (default: the default)"),
    force: bool = typer.Option(False, "--force", help="with --calibrate: measure again, even if cached"),
):
    """List the model registry: embedded offline models and where their weights are."""

    def body():
        from rich.console import Console

        from ragspec.models.generator import prepare_gguf
        from ragspec.models.gguf_cache import cache_dir, is_valid, kept_bytes
        from ragspec.models.registry import (
            DEFAULT_GENERATOR,
            EMBEDDED,
            ONLINE_EMBEDDER,
            ONLINE_RERANKER,
            part_paths,
        )

        out = Console(highlight=False, soft_wrap=True)
        if calibrate:
            quiet_libraries()
            _print_calibration(out, model or DEFAULT_GENERATOR, force)
            return
        if model or force:
            raise RagspecError("--model and --force go with --calibrate")
        if prepare:
            for path in prepare_gguf(prepare):  # an embedded generator or a local .gguf; anything else: one line
                out.print(f"{prepare}: {path}")
            return
        for m in EMBEDDED.values():
            try:
                part_paths(m)
                installed = "[green]installed[/]"
            except RagspecError:
                installed = f"[red]missing[/] ({m.pip_command})"
            cached = ""
            if m.fmt == "gguf":
                kept = kept_bytes(m)
                cached = ("  kept: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in kept.items())) if kept else ""
                if verify and "float folder" in kept and not is_valid(cache_dir(m), m, full=True):
                    cached += " [red](float folder damaged)[/]"
            out.print(f"{m.name:30} {m.kind:9} {installed}{cached}  [dim]{m.hub_id}; {m.note}[/]")
            if m.kind == "generator":
                from ragspec.machine.table import table_status

                out.print(f"{'':30} [dim]this machine: {table_status(m.name)}[/]")
        out.print(f"[dim]online defaults (need a reachable hub): embedder {ONLINE_EMBEDDER}, "
                  f"reranker {ONLINE_RERANKER}[/]")

    run(body)


SHAPES = ((1100, 32), (1100, 128), (1100, 256))  # asks `models --calibrate` predicts: 5 sources, 3 answer lengths


def _print_calibration(out, model: str, force: bool) -> None:
    """`ragspec models --calibrate`: the CPU, its matmul ceilings, each candidate's measurements and what
    `generator.backend: auto` takes for a typical ask."""
    from rich.table import Table

    from ragspec.machine import table as machine
    from ragspec.models.registry import lookup

    if lookup(model) is None and not Path(model).expanduser().exists():
        raise RagspecError(f"--model '{model}': not an embedded generator, a local folder or a .gguf file")
    cpu = machine.cpu_info()
    out.print(f"CPU: {cpu['model']} · {cpu['threads']} torch threads, {cpu['cores']} cores · flags of interest: "
              f"{' '.join(cpu['flags']) or 'none'}")
    mm = machine.matmul_ceilings()
    ceilings = " · ".join(f"{k} {mm[k]:.1f}" for k in ("float32", "bfloat16", "int8") if k in mm)
    skipped = "; ".join(f"{k}: {v}" for k, v in mm["skipped"].items())
    out.print(f"matmul {'×'.join(map(str, mm['shape']))} GFLOP/s: {ceilings}"
              + (f" [dim]({skipped})[/]" if skipped else ""))
    cached = machine.table_path(model).exists() and not force
    if not cached:
        out.print(f"measuring {model} (once per machine; about a minute per candidate on 2 cores)…")
    table = machine.machine_table(model, force=force, progress=lambda line: out.print(f"  {line}"))
    sizes = table["sizes"]
    cols = [f"t({n}) ms" for n in (1, 8, 16) if n in sizes]
    t = Table(title=f"{model} on this machine ({'cached' if cached else 'measured'} {table['measured_at']}; "
                    f"prompt / cache {table['context']} tokens)")
    t.add_column("candidate")
    store = f"warm store ms (blend 0 / {machine.BLEND})"
    for c in ["prefill tok/s", store, *cols, "decode ms/token"] + [f"{p} + {a} s" for p, a in SHAPES] + ["busy"]:
        t.add_column(c, justify="right")
    notes = []
    for row in table["candidates"]:
        name = f"{row['backend']}/{row['dtype']}"
        if "prefill_tps" not in row:
            why = row.get("skipped") or ("not measured: " + row["ruled_out"] if "ruled_out" in row else
                                         "failed: " + row.get("error", "?"))
            notes.append(f"{name}: {why}")
            continue
        ms = dict(zip(sizes, row["ms"]))
        share = row.get("cpu_share")
        warm = (f"{row['assembled_ms']:.0f} / {row.get('blended_ms', row['assembled_ms']):.0f}"
                if "assembled_ms" in row else row.get("assembly", "–"))
        t.add_row(name, f"{row['prefill_tps']:.0f}", warm, *[f"{ms[n]:.0f}" for n in (1, 8, 16) if n in ms],
                  f"{machine.decode_ms_per_token(row, 'suffix', sizes):.0f}",
                  *[f"{machine.predict_s(row, p, a, 'suffix', sizes):.1f}" for p, a in SHAPES],
                  "[yellow]yes[/]" if share is not None and share < machine.BUSY else "no")
    out.print(t)
    for n in notes:
        out.print(f"  [dim]{n}[/]")
    for p, a in SHAPES:
        c = machine.choose(table, p, a, "suffix")
        plan = " (what a pipeline plans for)" if a == machine.EXPECTED_ANSWER_TOKENS else ""
        out.print(f"auto picks [bold]{c.backend}/{c.dtype}[/] for a {p}-token prompt + {a}-token answer{plan}: "
                  f"{c.reason.split(': ', 1)[-1]}")
    p, a = SHAPES[0][0], machine.EXPECTED_ANSWER_TOKENS
    for blend in (0.0, machine.BLEND):
        c = machine.choose(table, p, a, "suffix", blend=blend)
        out.print(f"with the source cache on (warm, blend {blend:g}) auto picks [bold]{c.backend}/{c.dtype}[/] for a "
                  f"{p}-token prompt + {a}-token answer: {c.reason.split(': ', 1)[-1]}"
                  + (" (llama.cpp applies no CacheBlend: left out)" if blend else ""))
    out.print("[dim]predicted: prompt / prefill tok/s (with the cache: the warm store's assembly of a "
              f"{table['context']}-token prompt, scaled) + answer × decode ms/token, drafting accepting "
              f"{machine.ACCEPT:.0%} of draft tokens in a chain; busy: the measurement got under "
              f"{machine.BUSY:.0%} of its cores twice (other jobs ran), re-run with --force when idle[/]")
    out.print(f"[dim]cache: {machine.table_path(model)}[/]")
