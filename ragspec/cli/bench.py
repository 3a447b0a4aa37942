"""`ragspec bench`, `bench-replay` and `bench-search`: decoding speed, drafters replayed over a run's outputs,
query latency; and the tables they print."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from ragspec.cli.common import run, write_json_atomic
from ragspec.console import quiet_libraries
from ragspec.errors import RagspecError


def bench_replay(
    result_path: Path = typer.Argument(..., metavar="RESULT", help="a `ragspec bench --json` result (or a merge)"),
    prompts: Path = typer.Option(Path("../shared/data/spec_bench/question.jsonl"), "--prompts"),
    methods: str = typer.Option("pld,suffix,auto,oracle", "--methods", help="replayable: none, pld, trie, suffix, "
                                "auto, oracle"),
    json_out: Path | None = typer.Option(None, "--json", help="write the replay JSON here"),
    cost_path: Path | None = typer.Option(None, "--cost", help="model the steps with this t(n) instead of the "
                                          "run's own (a JSON with a cost_model, e.g. examples/gpu_check.py curve's): "
                                          "a projection, never a measurement"),
):
    """Replay drafters over a bench run's recorded greedy outputs, without the model: tokens per step and the
    decode speed-up modelled from that run's t(n), beside what the run measured (tune here, confirm with bench).
    With --cost, the same outputs projected onto another verifier's t(n) (a GPU, a bigger model)."""

    def body():
        quiet_libraries()
        from rich.console import Console
        from rich.table import Table
        from transformers import AutoTokenizer

        from ragspec.bench.replay import replay_result
        from ragspec.console import progress
        from ragspec.models.generator import generator_source

        try:
            result = json.loads(result_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise RagspecError(f"cannot read bench result {result_path}: {e}") from e
        if not prompts.exists():
            raise RagspecError(f"{prompts} does not exist")
        rows = {}
        with open(prompts, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    rows[str(obj.get("question_id"))] = obj
        chosen = [m.strip() for m in methods.split(",") if m.strip()]
        cost = None
        if cost_path is not None:
            from ragspec.decoding.budget import CostModel

            try:
                curve = json.loads(cost_path.read_text(encoding="utf-8"))
                cost = CostModel(**{k: curve["cost_model"][k] for k in ("sizes", "ms")})
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RagspecError(f"--cost {cost_path}: not a JSON with a cost_model of sizes and ms ({e})") from e
        tok = AutoTokenizer.from_pretrained(generator_source(result.get("model") or "qwen2.5-coder-0.5b-instruct"))
        cats = result["categories"] if "categories" in result else {result.get("category"): result}
        total = sum(len(r.get("vanilla_outputs") or {}) for r in cats.values()) * len(chosen)
        if not total:
            raise RagspecError(f"{result_path} keeps no vanilla outputs (a run from before they were recorded)")
        if cost is None and not any(r.get("cost_model") for r in cats.values()):
            raise RagspecError(f"{result_path} was run with a fixed --budget: it measured no t(n) to model steps with")
        with progress() as bar:
            task = bar.add_task("replaying", total=total)
            out = replay_result(result, rows, tok, chosen, progress=lambda: bar.advance(task), cost=cost)
        if cost is not None:
            out["projection"] = {"cost_from": str(cost_path), "cost_model": cost.as_dict(),
                                 "what": curve.get("what", "another verifier's t(n)"),
                                 "note": "a projection: these outputs' drafts and steps, timed by that t(n)"}
        if not out["categories"]:
            raise RagspecError(f"none of the prompts recorded in {result_path} is in {prompts} (another prompts file?)")
        if json_out:
            write_json_atomic(json_out, out)
        title = (f"replay of {result_path.name} projected on {cost_path.name}'s t(n): modelled decode speed-up "
                 "(tokens/step)" if cost is not None else
                 f"replay of {result_path.name}: modelled decode speed-up (tokens/step), measured beside")
        t = Table(title=title)
        t.add_column("category", justify="left")
        for m in chosen:
            t.add_column(m, justify="right")
        for cat, row in out["categories"].items():
            cells = []
            for m in chosen:
                v = row[m]
                cell = f"{v['decode_speedup_model']:.2f}× ({v['tokens_per_step']:.2f})"
                if v["measured_decode_speedup"] is not None:
                    cell += f" · ran {v['measured_decode_speedup']:.2f}× ({v['measured_tokens_per_step'] or 1:.2f})"
                cells.append(cell)
            t.add_row(cat, *cells)
        Console(width=None if sys.stdout.isatty() else 200).print(t)

    run(body)


def bench_search(
    index_path: Path = typer.Argument(..., metavar="INDEX"),
    queries: Path | None = typer.Option(None, "--queries", help=".jsonl (text field) or one query per line"),
    n: int = typer.Option(200, "-n", help="queries to time (sampled from the index's chunks without --queries)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Query latency: p50/p95 of dense search alone and of the whole retrieval stage."""

    def body():
        quiet_libraries()
        from ragspec.eval.latency import bench_queries, sample_queries
        from ragspec.index.reader import Index
        from ragspec.retrieve.retriever import Retriever
        from ragspec.settings import RetrieverSettings

        idx = Index(index_path)
        qs = sample_queries(idx, queries, n)
        result = bench_queries(Retriever(idx, RetrieverSettings()), qs)
        result["index"] = str(index_path)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        from rich.console import Console

        out = Console(highlight=False, soft_wrap=True)
        out.print(f"{result['queries']} queries on {index_path} ({result['faiss']}, {result['chunks']} chunks)")
        for name, m in result["latency_ms"].items():
            out.print(f"  {name:22} p50 {m['p50']:8.2f} ms   p95 {m['p95']:8.2f} ms")

    run(body)


def bench(
    prompts: Path = typer.Option(Path("../shared/data/spec_bench/question.jsonl"), "--prompts"),
    category: str = typer.Option("rag", "--category", help="a Spec-Bench category, several (a,b,c), or all (each category in turn)"),
    limit: int | None = typer.Option(None, "--limit", help="at most N prompts (of each category with all)"),
    offset: int = typer.Option(0, "--offset", help="skip the category's first N prompts (a held-out fold)"),
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct", "--model"),
    methods: str | None = typer.Option(None, "--methods",
                                          help="vanilla, hf-pld (llama-pld with --backend llama.cpp), llama (plain "
                                               "llama.cpp greedy on the same GGUF, in a transformers run), none, pld, trie, "
                                               "suffix, pldplus-h, pldplus-a, lookahead, ngrammys, auto, oracle (the ceiling); default: "
                                               "vanilla,<peer>,pld,trie,suffix,oracle"),
    backend: str = typer.Option("transformers", "--backend", help="transformers or llama.cpp (the GGUF as shipped)"),
    dtype: str = typer.Option("auto", "--dtype", help="transformers: float32, bfloat16, int8, gguf, or auto (what "
                                                      "generator.dtype auto picks on this machine)"),
    device: str = typer.Option("auto", "--device", help="transformers: auto (cuda when present), cpu or cuda"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    budget: str = typer.Option("auto", "--budget", help="draft tree size: auto (cost-aware) or a number"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result JSON here"),
    plot_out: Path | None = typer.Option(None, "--plot", help="write accepted-length histograms (PNG)"),
    merge: list[str] | None = typer.Option(None, "--merge", help="no run: merge these result JSONs (runs of "
                                              "some categories each) into one table (and --json)"),
):
    """Decoding speed: vanilla greedy vs HF prompt lookup vs ragspec drafters, outputs checked identical."""

    def body():
        quiet_libraries()
        if merge:
            return _merge_runs(merge, json_out)
        from ragspec.bench.decoding import LLAMA, load_prompts, plot, run_bench
        from ragspec.console import progress
        from ragspec.models.generator import load_generator

        if not prompts.exists():
            raise RagspecError(f"{prompts} does not exist")
        if max_new_tokens < 1:
            raise RagspecError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
        if limit is not None and limit < 1:
            raise RagspecError(f"--limit must be at least 1, not {limit}")
        rows = load_prompts(prompts, category, limit, offset)
        if backend not in ("transformers", "llama.cpp"):
            raise RagspecError(f"--backend must be transformers or llama.cpp, not '{backend}'")
        if backend == "llama.cpp":
            from ragspec.models.generator import load_llama_generator

            lm, tok = load_llama_generator(model)
        else:
            dev = _bench_device(device, dtype)
            dt = _bench_dtype(model, dev) if dtype == "auto" else dtype
            lm, tok = load_generator(model, dev, dt)
        peer = "llama-pld" if backend == "llama.cpp" else "hf-pld"
        chosen = methods or f"vanilla,{peer},pld,trie,suffix,oracle"
        b = budget if budget == "auto" else int(budget)
        chosen_methods = [m.strip() for m in chosen.split(",") if m.strip()]
        write = (lambda r: write_json_atomic(json_out, r)) if json_out else None
        from rich.console import Console
        from rich.table import Table

        out = Console(width=None if sys.stdout.isatty() else 200)  # a log file gets the whole table
        if category == "all" or "," in category:
            from ragspec.bench.decoding import run_categories

            with progress() as bar:
                task = bar.add_task(f"all categories × {len(rows)}", total=len(rows))
                result = run_categories(lm, tok, rows, chosen_methods, max_new_tokens, b,
                                        progress=lambda: bar.advance(task), model_name=model, on_result=write,
                                        label=category)
            if plot_out:
                for cat, r in result["categories"].items():
                    plot(r, plot_out.with_name(f"{plot_out.stem}-{cat}{plot_out.suffix}"))
            out.print(_category_table(result, model, backend, max_new_tokens))
            first = next(iter(result["categories"].values()))
            _print_machine(out, first)
            return
        with progress() as bar:
            task = bar.add_task(f"{category} × {len(rows)}", total=len(rows))
            result = run_bench(lm, tok, rows, chosen_methods, max_new_tokens,
                               b, progress=lambda: bar.advance(task), model_name=model, category=category,
                               on_prompt=write)
        if plot_out:
            plot(result, plot_out)

        label = backend if backend == "llama.cpp" else f"{backend}/{result['dtype']}"
        t = Table(title=f"{model} ({label}) — {category}, {len(rows)} prompts, {max_new_tokens} new tokens")
        vs = LLAMA in result["methods"]
        for col in ("method", "tok/s", "prefill tok/s", "decode tok/s", "speed-up",
                    *(["vs llama: e2e · prefill · decode"] if vs else []), "of ceiling", "tok/step", "nodes/step",
                    "draft · inputs · forward · accept · trim (ms/step)", "identical", "mem MB"):
            t.add_column(col, justify="left" if col == "method" else "right")
        for m, r in result["methods"].items():
            f = lambda v, fmt="{:.2f}": "–" if v is None else fmt.format(v)  # noqa: E731
            split = " · ".join(f"{v:.1f}" for v in r["step_ms"].values()) if r.get("step_ms") else "–"
            ratios = [" · ".join(f(r["vs_llama"][k], "{:.2f}×") for k in ("end_to_end", "prefill", "decode"))] if vs else []
            t.add_row(m, f(r["tokens_per_s"]), f(r["prefill_tokens_per_s"], "{:.0f}"), f(r["decode_tokens_per_s"]),
                      f(r["speedup"], "{:.2f}×"), *ratios, f(r.get("of_ceiling"), "{:.0%}"), f(r["mean_accepted"]),
                      f(r["tree_nodes_per_step"]), split,
                      "reference" if m == "vanilla" else "–" if r["identical"] is None else f"{r['identical']}/{len(rows)}",
                      f(r["drafter_memory_mb_4k"]))
        out.print(t)
        _print_machine(out, result)

    run(body)


def _bench_device(device: str, dtype: str) -> str:
    """The device a transformers bench runs on: cuda when asked or (auto) present; int8 and gguf are CPU kernels."""
    import torch

    if device not in ("auto", "cpu", "cuda"):
        raise RagspecError(f"--device must be auto, cpu or cuda, not '{device}'")
    if device == "cuda" and not torch.cuda.is_available():
        raise RagspecError("--device cuda: torch sees no CUDA device on this machine")
    if dtype in ("int8", "gguf"):
        if device == "cuda":
            raise RagspecError(f"--dtype {dtype} runs on the CPU only; on cuda use bfloat16 or float32")
        return "cpu"
    return _default_device() if device == "auto" else device


def _bench_dtype(model: str, device: str = "cpu") -> str:
    """What `generator.dtype: auto` runs for this model here (the machine's calibration, measured once) for a
    bench-shaped ask: a 1,024-token prompt and a 128-token answer drafted by suffix. On CUDA: bfloat16."""
    from ragspec.console import console
    from ragspec.machine.table import resolve
    from ragspec.settings import GeneratorSettings

    if device == "cuda":
        return "bfloat16"
    choice = resolve(GeneratorSettings(model=model, backend="transformers"), "cpu", 1024, 128, "suffix",
                     progress=lambda line: console.print(line))
    console.print(f"--dtype auto: {choice.dtype} ({choice.reason})")
    return choice.dtype


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _merge_runs(paths: list[str], json_out: Path | None) -> None:
    from rich.console import Console

    from ragspec.bench.decoding import merge_categories

    runs = []
    for p in paths:
        try:
            runs.append(json.loads(Path(p).read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            raise RagspecError(f"cannot read bench result {p}: {e}") from e
    result = merge_categories(runs)
    if json_out:
        write_json_atomic(json_out, result)
    first = next(iter(result["categories"].values()))
    out = Console(width=None if sys.stdout.isatty() else 200)
    out.print(_category_table(result, result["model"], first.get("backend", "transformers"), result["max_new_tokens"]))
    if not result["complete"]:
        out.print("[yellow]some merged categories were stopped before their last prompt (\"complete\": false)[/]")
    machines: dict[str, list[str]] = {}  # parts may come from other machines: each CPU with its categories
    for cat, r in result["categories"].items():
        machines.setdefault(_cpu_line(r.get("machine") or r["cpu"]), []).append(cat)  # "cpu": an older run
    for line, cats in machines.items():
        out.print(line + (f" ({', '.join(cats)})" if len(machines) > 1 else ""))


def _category_table(result: dict, model: str, backend: str, max_new_tokens: int):
    """`bench --category all`: one row per category, a column per method: speed-up over vanilla (tokens per
    step); the oracle column is the ceiling; identical counts the outputs of the methods checked against
    vanilla (neither vanilla itself nor `llama`)."""
    from rich.table import Table

    cats = result["table"]
    methods = list(next(iter(cats.values())))
    t = Table(title=f"{model} ({backend}) — all categories, {max_new_tokens} new tokens: speed-up (tokens/step)")
    t.add_column("category", justify="left")
    t.add_column("prompts", justify="right")
    for m in methods:
        t.add_column("oracle (ceiling)" if m == "oracle" else m, justify="right")
    t.add_column("identical", justify="right")
    for cat, row in cats.items():
        n = next(iter(row.values()))["prompts"]
        cells = [f"{v['speedup']:.2f}×" + (f" ({v['mean_accepted']:.2f})" if v["mean_accepted"] else "")
                 for v in row.values()]
        # the reference (vanilla) and plain llama.cpp are not compared: only the methods checked against vanilla
        checked = [v["identical"] for v in row.values() if v["identical"] is not None]
        t.add_row(cat, str(n), *cells, f"{sum(checked)}/{n * len(checked)}")
    return t


def _cpu_line(machine: dict) -> str:
    return f"CPU: {machine['model']} · {machine['threads']} threads · {' '.join(machine['flags'])}"


def _print_machine(out, result: dict) -> None:
    out.print(_cpu_line(result["machine"]))
    mm = result["machine"]["matmul_gflops"]
    out.print("matmul ceilings (GFLOP/s): " + " · ".join(f"{k} {mm[k]}" for k in ("float32", "bfloat16", "int8")
                                                         if k in mm))
