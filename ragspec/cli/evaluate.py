"""`ragspec eval-retrieval`, `eval-attribution` and `eval-answers`: retrieval, attribution and answer quality
on public data sets."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from ragspec.cli.common import index_settings, run, write_json_atomic
from ragspec.console import console, quiet_libraries
from ragspec.errors import RagspecError


def eval_retrieval(
    corpus: Path = typer.Option(Path("../shared/data/scifact/corpus.jsonl"), "--corpus"),
    queries: Path = typer.Option(Path("../shared/data/scifact/queries.jsonl"), "--queries"),
    qrels: Path = typer.Option(Path("../shared/data/scifact/qrels/train.tsv"), "--qrels"),
    index_type: str = typer.Option("auto", "--index-type", help="the ANN index compared with exact search"),
    embedder: str | None = typer.Option(None, "--embedder"),
    embed_dtype: str | None = typer.Option(None, "--embed-dtype"),
    out: Path | None = typer.Option(None, "--out", help="where to keep the built indexes (reused)"),
    limit: int | None = typer.Option(None, "--limit", help="evaluate the first N queries"),
    reranker: str | None = typer.Option(None, "--reranker"),
    as_json: bool = typer.Option(False, "--json"),
):
    """nDCG@10, Recall@100, MRR@10 per stage, and ANN recall@10 against exact search."""

    def body():
        quiet_libraries()
        from ragspec.eval.retrieval import evaluate, load_qrels, load_queries
        from ragspec.index.builder import build_index
        from ragspec.index.reader import Index
        from ragspec.paths import ragspec_home

        for p in (corpus, queries, qrels):
            if not p.exists():
                raise RagspecError(f"{p} does not exist")
        from ragspec.models.registry import DEFAULT_EMBEDDER

        flavour = f"{(embedder or DEFAULT_EMBEDDER).replace('/', '_')}-{embed_dtype or 'auto'}"
        base = out or ragspec_home() / "eval" / corpus.resolve().parent.name / flavour
        exact_settings = index_settings(embedder=embedder, embed_dtype=embed_dtype, index_type="flat")
        build_index(corpus, base / "exact", exact_settings)
        exact = Index(base / "exact")
        ann = None
        if index_type != "flat":
            ann_settings = index_settings(embedder=embedder, embed_dtype=embed_dtype, index_type=index_type)
            build_index(corpus, base / f"ann-{index_type}", ann_settings, reuse_from=base / "exact")
            ann = Index(base / f"ann-{index_type}")
            if ann.manifest["faiss"]["kind"] == "flat":
                ann = None  # auto chose exact search: nothing approximate to compare
        qs, qr = load_queries(queries), load_qrels(qrels)
        result = evaluate(exact, qs, qr, ann_index=ann, limit=limit, reranker=reranker)
        if as_json:
            sys.stdout.write(json.dumps(result, indent=2) + "\n")
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"{corpus} — {result['queries']} queries, {result['embedder']} ({result['embed_dtype']})")
        for col in ("stage", "nDCG@10", "Recall@100", "MRR@10"):
            t.add_column(col, justify="right" if col != "stage" else "left")
        for name, m in result["stages"].items():
            t.add_row(name, f"{m['ndcg@10']:.4f}", f"{m['recall@100']:.4f}", f"{m['mrr@10']:.4f}")
        Console().print(t)
        if result["ann_recall@10"] is not None:
            Console().print(f"ANN recall@10 vs exact: {result['ann_recall@10']:.4f} "
                            f"({result['ann_factory']}, nprobe {result['ann_nprobe']}); by nprobe: "
                            + ", ".join(f"{p}: {r:.4f}" for p, r in result["ann_recall@10_by_nprobe"].items()))

    run(body)


def eval_attribution(
    data: Path = typer.Option(Path("../shared/data/quotesum/dev_public.jsonl"), "--data", help="QuoteSum JSONL"),
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct", "--model", help="whose tokenizer (and hidden states)"),
    method: str = typer.Option("trie", "--drafting", help="drafter whose provenance breaks ties"),
    min_words: int = typer.Option(3, "--min-words"),
    min_chars: int = typer.Option(10, "--min-chars"),
    chars_one_word: bool = typer.Option(False, "--chars-one-word", help="only one-word spans qualify by --min-chars"),
    disambiguation: str = typer.Option("context", "--disambiguation", help="words found in several sources: "
                                       "neighbours | context | neighbours-context"),
    skip_question: bool = typer.Option(False, "--skip-question", help="no citation for a span the question holds"),
    folds: int | None = typer.Option(None, "--folds", help="K-fold: choose the settings on K-1 folds "
                                        "(record i is in fold i % K), score the held-out fold"),
    min_precision: float = typer.Option(0.98, "--min-precision", help="with --folds: the attribution precision "
                                        "a setting needs on the training folds to be chosen (if any reaches it)"),
    criterion: str = typer.Option("pooled", "--criterion", help="with --folds: pooled (F1 over the training folds "
                                  "together) | worst-fold (the lowest F1 of the training folds)"),
    limit: int | None = typer.Option(None, "--limit"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
):
    """Copied-span attribution on QuoteSum (PLD+ Appendix D): token P/R/F1 for copied and for source."""

    def body():
        quiet_libraries()
        from ragspec.console import progress
        from ragspec.eval.attribution import cross_validate, default_grid, load_records, prepare, score_all
        from ragspec.pipeline.prompt import PromptBuilder

        if not data.exists():
            raise RagspecError(f"{data} does not exist")
        if method.startswith("pldplus"):  # hidden states: the model itself
            from ragspec.models.generator import load_generator

            lm, tok = load_generator(model)
        else:  # the drafter needs the tokenizer only
            from transformers import AutoTokenizer

            from ragspec.models.generator import generator_source

            lm, tok = None, AutoTokenizer.from_pretrained(generator_source(model))
        rows = load_records(data, limit)
        builder = PromptBuilder(tok, "quote")
        grid = default_grid() if folds else []
        with progress() as bar:
            # the teacher-forced drafting is done once per record; each setting only re-runs the matcher
            task = bar.add_task("QuoteSum drafting", total=len(rows))
            prepared = []
            for rec in rows:
                prepared.append(prepare(rec, builder, tok, lm, method))
                bar.advance(task)
            if folds:
                task = bar.add_task(f"{len(grid)} settings", total=len(grid))
                cv = cross_validate(prepared, folds, grid, min_precision, progress=lambda: bar.advance(task),
                                    criterion=criterion)
        setting = {"min_words": min_words, "min_chars": min_chars, "chars_one_word": chars_one_word,
                   "disambiguation": disambiguation, "skip_question": skip_question}
        r = {"records": len(rows), "method": method, **setting, **score_all(prepared, setting)}
        if folds:
            r["cross_validation"] = cv
            r.update({k: cv[k] for k in ("folds", "mean", "spread")})
        if as_json:
            sys.stdout.write(json.dumps(r, indent=2) + "\n")
            return
        if folds:
            from rich.table import Table

            t = Table(title=f"QuoteSum {folds}-fold ({len(rows)} records, {method}; record i held out in fold "
                            f"i % {folds}; settings: best {criterion} training F1 with precision >= {min_precision})")
            for col in ("held out", "records", "min words", "min chars", "1 word", "disambiguation", "skip q.",
                        "copied P", "copied R", "copied F1", "attr. P", "attr. R", "attr. F1"):
                t.add_column(col, justify="left" if col in ("held out", "disambiguation") else "right")

            def row(name, n, s, c, a):
                return [name, n, *s, *(f"{c[m]:.4f}" for m in ("precision", "recall", "f1")),
                        *(f"{a[m]:.4f}" for m in ("precision", "recall", "f1"))]

            for f in cv["folds"]:
                s = f["setting"]
                t.add_row(*row(f"fold {f['fold']}", str(f["records"]),
                               (str(s["min_words"]), str(s["min_chars"]), "yes" if s["chars_one_word"] else "no",
                                s["disambiguation"], "yes" if s["skip_question"] else "no"), f["copied"],
                               f["attribution"]))
            t.add_row(*row("mean", "", ("",) * 5, cv["mean"]["copied"], cv["mean"]["attribution"]))
            for stat in ("min", "max", "std"):
                t.add_row(*row(stat, "", ("",) * 5,
                               {m: v[stat] for m, v in cv["spread"]["copied"].items()},
                               {m: v[stat] for m, v in cv["spread"]["attribution"].items()}))
            console.print(t)
            console.print(f"all records, the given settings ({setting}):")
        for part in ("copied", "attribution"):
            m = r[part]
            console.print(f"{part:12} P {m['precision']:.4f}  R {m['recall']:.4f}  F1 {m['f1']:.4f}  "
                          f"({m['tokens']} gold copied tokens, {r['records']} records)")

    run(body)


def eval_answers(
    data: Path = typer.Option(..., "--data", help="the question set (clapnq: a file, or a folder with both files)"),
    fmt: str = typer.Option(..., "--format", help="nq | clapnq | specbench"),
    retrieve: Path | None = typer.Option(None, "--retrieve", help="retrieve from this index instead of "
                                            "answering over each record's own passages"),
    spec: Path | None = typer.Option(None, "--pipeline", help="pipeline YAML (default settings without it)"),
    style: str | None = typer.Option(None, "--style", help="override prompt.style (quote | free | brief)"),
    model: str | None = typer.Option(None, "--model", help="override generator.model"),
    limit: int | None = typer.Option(None, "--limit", help="the first N records (clapnq folder: N of each file)"),
    max_new_tokens: int | None = typer.Option(None, "--max-new-tokens", help="override generator.max_new_tokens"),
    relevance_floor: str | None = typer.Option(None, "--relevance-floor", help="override prompt.relevance_floor "
                                                  "(auto | off | a cosine): decline when no source is about the "
                                                  "question"),
    relevance_doubt: str | None = typer.Option(None, "--relevance-doubt", help="override prompt.relevance_doubt "
                                                  "(auto | none | a cosine): up to it the model is offered to "
                                                  "decline"),
    source_tokens: str | None = typer.Option(None, "--source-tokens", help="override prompt.source_tokens "
                                                "(auto | off | N): cut the sources to N tokens of the windows "
                                                "that bear on the question"),
    source_cache: str | None = typer.Option(None, "--source-cache", help="override generator.source_cache (on | "
                                               "off | auto): reuse each source piece's KV across asks"),
    cache_recompute: int | None = typer.Option(None, "--cache-recompute", help="override generator."
                                                  "source_cache_recompute: first tokens of each piece computed in "
                                                  "full"),
    cache_blend: float | None = typer.Option(None, "--cache-blend", help="override generator.source_cache_blend: "
                                                "fraction of cached piece tokens recomputed, the most deviating"),
    cache_select: str | None = typer.Option(None, "--cache-select", help="override generator.source_cache_select "
                                               "(deviation | attention): which piece tokens --cache-blend recomputes"),
    cache_temperature: float | None = typer.Option(None, "--cache-temperature", help="override generator."
                                                      "source_cache_temperature: reused piece keys divided by it "
                                                      "(APE)"),
    skip: int = typer.Option(0, "--skip", help="leave out the first N records (clapnq folder: N of each file), "
                                               "to keep tuning and report records apart"),
    numbers: str | None = typer.Option(None, "--records", help="only these records, numbered from 1 in the order "
                                          "read after --skip and --limit (clapnq folder: answerable first), "
                                          "e.g. the few a setting changes"),
    json_out: Path | None = typer.Option(None, "--json", help="write the result JSON here (rewritten after "
                                            "every record)"),
):
    """Answer quality: contains-a-reference, token F1, refusals, citation coverage, TTFT and decode speed."""

    def body():
        quiet_libraries()
        from ragspec.console import progress
        from ragspec.eval.answers import FORMATS, pick_records, read_records, record_sources, score, summarize
        from ragspec.machine.table import cpu_info
        from ragspec.pipeline import Pipeline
        from ragspec.pipeline.prompt import STYLES
        from ragspec.spec import load_spec

        if fmt not in FORMATS:
            raise RagspecError(f"--format '{fmt}' is not one of {', '.join(FORMATS)}")
        if style is not None and style not in STYLES:
            raise RagspecError(f"--style '{style}' is not one of {', '.join(STYLES)}")
        if limit is not None and limit < 1:
            raise RagspecError("--limit must be at least 1")
        if max_new_tokens is not None and max_new_tokens < 1:
            raise RagspecError("--max-new-tokens must be at least 1")
        if skip < 0:
            raise RagspecError("--skip must be 0 or more")
        if source_cache is not None and source_cache not in ("on", "off", "auto"):
            raise RagspecError(f"--source-cache must be on, off or auto, not '{source_cache}'")
        if cache_recompute is not None and cache_recompute < 0:
            raise RagspecError("--cache-recompute must be 0 or more")
        if cache_blend is not None and not 0 <= cache_blend <= 1:
            raise RagspecError(f"--cache-blend must be a fraction from 0 to 1, not {cache_blend}")
        if cache_select is not None and cache_select not in ("deviation", "attention"):
            raise RagspecError(f"--cache-select must be deviation or attention, not '{cache_select}'")
        if cache_temperature is not None and not 0 < cache_temperature <= 2:
            raise RagspecError(f"--cache-temperature must be above 0 and at most 2, not {cache_temperature}")
        from ragspec.settings import parse_source_tokens

        try:
            budget = parse_source_tokens(source_tokens) if source_tokens is not None else None
        except RagspecError:
            raise RagspecError(f"--source-tokens must be auto, off or a number of tokens (1 or more), "
                               f"not '{source_tokens}'") from None
        if retrieve is not None and not retrieve.exists():
            raise RagspecError(f"index {retrieve} does not exist")
        records = read_records(data, fmt, limit, skip)
        if numbers is not None:
            records = pick_records(records, numbers)
        if retrieve is None and any(not r.passages for r in records):
            bad = next(r for r in records if not r.passages)
            raise RagspecError(f"record {bad.id} of {data} has no passage to answer over (use --retrieve INDEX)")
        d = load_spec(spec).model_dump()
        if style:
            d["prompt"]["style"] = style
        if model:
            d["generator"]["model"] = model
        if max_new_tokens:
            d["generator"]["max_new_tokens"] = max_new_tokens
        from ragspec.settings import parse_doubt, parse_floor

        for key, value, parse, words in (("relevance_floor", relevance_floor, parse_floor, "auto, off"),
                                         ("relevance_doubt", relevance_doubt, parse_doubt, "auto, none")):
            if value is None:
                continue
            try:
                d["prompt"][key] = parse(value)
            except RagspecError:
                flag = "--" + key.replace("_", "-")
                raise RagspecError(f"{flag} must be {words} or a cosine in [-1, 1], not '{value}'") from None
        if source_tokens is not None:
            d["prompt"]["source_tokens"] = budget
        if source_cache is not None:
            d["generator"]["source_cache"] = source_cache
        if cache_recompute is not None:
            d["generator"]["source_cache_recompute"] = cache_recompute
        if cache_blend is not None:
            d["generator"]["source_cache_blend"] = cache_blend
        if cache_select is not None:
            d["generator"]["source_cache_select"] = cache_select
        if cache_temperature is not None:
            d["generator"]["source_cache_temperature"] = cache_temperature
        pipe = Pipeline(load_spec(d), str(retrieve) if retrieve else None)
        with console.status("loading the model…"):
            if retrieve is not None:
                pipe.retriever  # noqa: B018 — a bad index fails before the model loads
            pipe.load()
        meta = {"format": fmt, "data": str(data), "style": pipe.spec.prompt.style,
                "decline": None if pipe.spec.prompt.system else pipe.decline, "model": pipe.spec.generator.model,
                "relevance_floor": pipe.relevance_gate.floor if pipe.relevance_gate else None,
                "relevance_doubt": pipe.relevance_gate.doubt if pipe.relevance_gate else None,
                "source_tokens": pipe.source_budget, "skip": skip, "picked": numbers,
                "source_cache": pipe.source_cache_on(),
                "source_cache_recompute": pipe.spec.generator.source_cache_recompute,
                "source_cache_blend": pipe.spec.generator.source_cache_blend,
                "source_cache_select": pipe.spec.generator.source_cache_select,
                "source_cache_temperature": pipe.spec.generator.source_cache_temperature,
                "drafting": pipe.spec.drafting.method, "max_new_tokens": pipe.spec.generator.max_new_tokens,
                "sources": "retrieved from " + str(retrieve) if retrieve else "the record's own passages",
                # what ran, and where: paired runs compare answers, and their timings only on one machine
                "backend": pipe.choice.backend if pipe.choice else None,
                "dtype": pipe.choice.dtype if pipe.choice else None,
                "cpu": {k: v for k, v in cpu_info().items() if k in ("model", "flags", "threads")},
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        rows = []
        with progress() as bar:
            task = bar.add_task(f"{fmt} × {len(records)}", total=len(records))
            for rec in records:
                kw = {} if retrieve is not None else {"documents": record_sources(rec)}
                rows.append(score(rec, pipe.ask(rec.question, **kw)))
                if json_out:
                    write_json_atomic(json_out, summarize(rows, **meta))
                bar.advance(task)
        r = summarize(rows, **meta)
        if json_out:
            write_json_atomic(json_out, r)
        f = lambda v, fmt="{:.3f}": "–" if v is None else fmt.format(v)  # noqa: E731
        console.print(
            f"{fmt} · {r['records']} records ({r['answerable']} answerable) · style {r['style']} · {r['model']}\n"
            f"answer contains {f(r['answer_contains'])} · token F1 {f(r['token_f1'])} · refusal "
            f"{f(r['refusal_rate'])} · false refusal {f(r['false_refusal_rate'])} · citation coverage "
            f"{f(r['citation_coverage'])} · {r['backend']}/{r['dtype']}\n"
            f"prompt {f(r['mean_prompt_tokens'], '{:.0f}')} tokens ({f(r['mean_source_tokens'], '{:.0f}')} of "
            f"sources; source budget {r['source_tokens'] or 'off'}; source cache "
            f"{'on, ' + f(r['mean_cache_reused_tokens'], '{:.0f}') + ' reused' if r['source_cache'] else 'off'}) · "
            f"TTFT p50 {f(r['ttft_ms_p50'], '{:.0f}')} ms · decode {f(r['decode_tokens_per_s'], '{:.2f}')} tok/s · "
            f"speed-up {f(r['speedup'], '{:.2f}×')}", soft_wrap=True, highlight=False)

    run(body)


def eval_compare(
    before: str = typer.Argument(..., help="an `eval-answers --json` file (the baseline, e.g. --source-tokens "
                                 "off); several joined with commas are one run (records 1-100,101-200)"),
    after: str = typer.Argument(..., help="the same over the same records (the setting under test)"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON"),
):
    """Two eval-answers runs over the same records, paired: each metric's means ± standard error, and the
    difference after − before ± its standard error (docs/evaluation.md, *Comparing two runs*)."""

    def body():
        from dataclasses import asdict

        from ragspec.eval.compare import paired, read_runs

        meta_a, rows_a = read_runs(before)
        meta_b, rows_b = read_runs(after)
        result = paired(rows_a, rows_b)
        if as_json:
            sys.stdout.write(json.dumps({"before": before, "after": after,
                                         "metrics": [asdict(p) for p in result]}, indent=2) + "\n")
            return
        from rich.table import Table

        def setting(m):
            ran = f"/{m['backend']}/{m['dtype']}" if m.get("dtype") else ""  # runs before 2026-11-28 lack it
            return (f"source budget {m.get('source_tokens') or 'off'}, source cache "
                    f"{'on' if m.get('source_cache') else 'off'}, {m.get('model')}{ran}")

        t = Table(title=f"{before} ({setting(meta_a)})  →  {after} ({setting(meta_b)})",
                  title_justify="left")
        for col in ("metric", "pairs", "before", "after", "after − before", "|Δ| ≤ 1 SE"):
            t.add_column(col, justify="left" if col == "metric" else "right", no_wrap=col == "metric")
        for p in result:
            t.add_row(p.metric, str(p.n), f"{p.mean_a:.3f} ± {p.se_a:.3f}", f"{p.mean_b:.3f} ± {p.se_b:.3f}",
                      f"{p.diff:+.3f} ± {p.se_diff:.3f}", "yes" if p.within_one_se() else "no")
        console.print(t)

    run(body)
