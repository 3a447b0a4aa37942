"""The `ragspec` command line (typer). Heavy imports happen inside commands, so `--help` is instant."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from ragspec.console import console, human_bytes
from ragspec.errors import RagspecError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="ragspec: retrieval-augmented generation with drafts copied from the retrieved context.",
    pretty_exceptions_enable=False,
)


def _fail(message: str, code: int = 2):
    from ragspec.console import one_line

    console.print(f"[bold red]error:[/] {one_line(message)}", soft_wrap=True, emoji=False)
    raise typer.Exit(code)


def _run(fn):
    """Run a command body; user errors become one red line and exit code 2."""
    try:
        return fn()
    except RagspecError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def _write_json_atomic(path: Path, data) -> None:
    """Write JSON beside `path` and rename it into place: a run stopped mid-write never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("bm25s").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # transformers missing or changed: cosmetic only
        pass


def _index_settings(**overrides):
    from ragspec.settings import IndexSettings

    from pydantic import ValidationError

    from ragspec.spec import describe_error

    data = {k: v for k, v in overrides.items() if v is not None}
    try:
        return IndexSettings(**data)
    except ValidationError as exc:
        raise RagspecError(describe_error(exc, "index settings")) from None


@app.command()
def index(
    path: Path = typer.Argument(..., help="corpus folder (or one .jsonl/.json file)"),
    name: Optional[str] = typer.Option(None, "--name", help="index name (default: the corpus folder's name)"),
    out: Optional[Path] = typer.Option(None, "--out", help="index path (default: indexes/NAME)"),
    embedder: Optional[str] = typer.Option(None, "--embedder", help="embedded name, HF id or folder"),
    index_type: Optional[str] = typer.Option(None, "--index-type", help="auto | flat | ivfpq"),
    factory: Optional[str] = typer.Option(None, "--factory", help="exact FAISS factory, e.g. 'IVF4096,PQ64'"),
    chunk_tokens: Optional[int] = typer.Option(None, "--chunk-tokens", help="chunk size in tokens (256)"),
    overlap: Optional[int] = typer.Option(None, "--overlap", help="chunk overlap in tokens (32)"),
    embed_dtype: Optional[str] = typer.Option(None, "--embed-dtype", help="auto | float32 | bfloat16"),
    nprobe: Optional[int] = typer.Option(None, "--nprobe", help="IVF lists probed per query (16)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda"),
    spec: Optional[Path] = typer.Option(None, "--pipeline", help="take index settings from a pipeline YAML"),
    executor: str = typer.Option("local", "--executor", help="local | ray (chunk and embed on a Ray cluster)"),
    address: Optional[str] = typer.Option(None, "--address", help="with --executor ray: the cluster "
                                          "('auto', 'ray://HOST:10001'); default: start a local Ray"),
    embed_actors: int = typer.Option(1, "--embed-actors", help="with --executor ray: embedding actors"),
    gpus_per_actor: float = typer.Option(0.0, "--gpus-per-actor", help="with --executor ray: GPUs per actor "
                                         "(0: embed on CPU)"),
):
    """Build or update an index from a folder of documents."""

    def body():
        _quiet_libraries()
        from ragspec.index.builder import build_index, default_name
        from ragspec.paths import default_index_root

        base = {}
        if spec is not None:
            from ragspec.spec import load_spec

            base = load_spec(spec).index.model_dump()
        settings = _index_settings(**{
            **base,
            **{k: v for k, v in dict(
                embedder=embedder, index_type=index_type, faiss_factory=factory, chunk_tokens=chunk_tokens,
                overlap=overlap, embed_dtype=embed_dtype, nprobe=nprobe, device=device,
            ).items() if v is not None},
        })
        target = out or default_index_root() / (name or default_name(path))
        runner = _index_executor(executor, address, embed_actors, gpus_per_actor)
        s = build_index(path, target, settings, executor=runner)
        for note in s.notes:
            console.print(f"[dim]{note}[/]")
        if s.up_to_date:
            console.print(
                f"[green]up to date[/] {target}: {s.documents} documents, {s.chunks} chunks, nothing changed "
                f"({s.seconds:.1f} s)"
            )
            return
        console.print(
            f"[green]indexed[/] {target}: {s.documents} documents from {s.files} files "
            f"({s.added} added, {s.changed} changed, {s.deleted} deleted, {s.skipped} skipped), {s.chunks} chunks "
            f"({s.embedded} embedded, {s.reused} reused) in {s.seconds:.1f} s"
            + (f", {s.chunks_per_s:.1f} chunks/s embedding" if s.embedded else "")
            + f"; FAISS {s.factory} ({s.index_type}); {human_bytes(s.bytes)} on disk"
        )

    _run(body)


def _index_executor(kind: str, address: str | None, actors: int, gpus: float):
    """None (this process) or a RayExecutor; the Ray options are refused without --executor ray."""
    if kind == "local":
        if address is not None or actors != 1 or gpus != 0.0:
            raise RagspecError("--address, --embed-actors and --gpus-per-actor go with --executor ray")
        return None
    if kind != "ray":
        raise RagspecError(f"--executor must be local or ray (got '{kind}')")
    from ragspec.cluster import require_ray

    require_ray()
    from ragspec.cluster.indexing import RayExecutor

    return RayExecutor(address=address, embed_actors=actors, gpus_per_actor=gpus)


@app.command()
def search(
    args: list[str] = typer.Argument(..., metavar="[INDEX] QUERY", help="the query (after the index path when no --index)"),
    index_opt: Optional[Path] = typer.Option(None, "--index", help="index path, e.g. indexes/NAME"),
    k: int = typer.Option(5, "-k", "--top", help="results to show"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document (schema in README)"),
    mode: str = typer.Option("hybrid", "--mode", help="hybrid | dense | bm25"),
    reranker: Optional[str] = typer.Option(None, "--reranker", help="CrossEncoder name or folder"),
    where: Optional[list[str]] = typer.Option(None, "--where", help="metadata filter, repeatable: 'path=tutorial/*', "
                                              "'year>=2020', 'type in md,rst'"),
    diversity: Optional[float] = typer.Option(None, "--diversity", help="MMR strength, 0 (off) … 1"),
):
    """Search an index: rank, score, document path, character offsets, text."""

    def body():
        _quiet_libraries()
        from ragspec.retrieve.retriever import Retriever
        from ragspec.settings import RetrieverSettings

        if index_opt is not None:
            if len(args) != 1:
                raise RagspecError("with --index give just the query (quote it)")
            index_path, query = index_opt, args[0]
        elif len(args) == 2:
            index_path, query = Path(args[0]), args[1]
        else:
            raise RagspecError("give the index and the query: ragspec search --index INDEX QUERY")
        if k < 1:
            raise RagspecError("-k must be at least 1")
        if mode not in ("hybrid", "dense", "bm25"):
            raise RagspecError(f"--mode '{mode}' is not one of hybrid, dense, bm25")
        if diversity is not None and not 0 <= diversity <= 1:
            raise RagspecError("--diversity must be between 0 and 1")
        retriever = Retriever(str(index_path), RetrieverSettings(top_n=k, mode=mode, reranker=reranker))
        t = time.perf_counter()
        hits = retriever.search(query, top_n=k, filter=list(where) if where else None, diversity=diversity)
        ms = (time.perf_counter() - t) * 1000
        if as_json:
            doc = {"index": str(index_path), "query": query, "results": [h.as_json() for h in hits]}
            sys.stdout.write(json.dumps(doc, ensure_ascii=False, indent=2) + "\n")
            return
        from rich.console import Console

        out = Console(highlight=False, soft_wrap=True)
        for h in hits:
            out.print(f"[bold]{h.rank}.[/] [cyan]{h.path}[/]{'#' + h.key if h.key else ''} "
                      f"[dim][{h.start}:{h.end}] score {h.score:.4f}[/]")
            for l in h.locations[1:]:
                out.print(f"   [dim]also {l.kind} in[/] [cyan]{l.path}[/]{'#' + l.key if l.key else ''} "
                          f"[dim][{l.start}:{l.end}][/]")
            snippet = " ".join(h.text.split())
            out.print("   " + (snippet[:300] + ("…" if len(snippet) > 300 else "")))
        console.print(f"[dim]{len(hits)} results in {ms:.0f} ms ({', '.join(retriever.stages)})[/]")

    _run(body)


@app.command()
def info(index_path: Path = typer.Argument(..., metavar="INDEX"),
         as_json: bool = typer.Option(False, "--json"),
         verify: bool = typer.Option(False, "--verify", help="re-hash every file against the manifest")):
    """Describe an index: counts, embedder, FAISS, and which retrieval stages run."""

    def body():
        from ragspec.index.reader import Index
        from ragspec.retrieve.retriever import Retriever
        from ragspec.settings import RetrieverSettings

        idx = Index(index_path, verify=verify)
        m = idx.manifest
        stages = Retriever(idx, RetrieverSettings()).stages
        if as_json:
            sys.stdout.write(json.dumps({"index": str(index_path), "version": idx.folder.name,
                                         "manifest": {k: v for k, v in m.items() if k != "files"},
                                         "stages": stages}, indent=2) + "\n")
            return
        from rich.console import Console

        out = Console(highlight=False, soft_wrap=True)
        c, e, f = m["counts"], m["embedder"], m["faiss"]
        out.print(f"[bold]{index_path}[/] → {idx.folder.name}  (format {m['format_version']}, built {m['created']})")
        out.print(f"  corpus     {m['corpus']['root']}: {c['documents']} documents, {c['chunks']} chunks, "
                  f"{c.get('skipped', 0)} files skipped")
        out.print(f"  embedder   {e['name']} ({e['dimension']}-d, {e['dtype']}, normalised)")
        out.print(f"  chunker    {m['chunker']['tokens']} tokens, overlap {m['chunker']['overlap']}")
        out.print(f"  faiss      {f['factory']} ({f['kind']}, nprobe {f['nprobe']}"
                  + (f", refine ×{f['refine_k_factor']}" if f.get("refine_k_factor") else "")
                  + (f", each vector in {1 + f['spill']} lists ({f['spill_rule']})" if f.get("spill") else "") + ")")
        out.print(f"  stages     {' → '.join(stages)}")
        if verify:
            out.print("  [green]all files match their sha256[/]")

    _run(body)


@app.command("eval-retrieval")
def eval_retrieval(
    corpus: Path = typer.Option(Path("../shared/data/scifact/corpus.jsonl"), "--corpus"),
    queries: Path = typer.Option(Path("../shared/data/scifact/queries.jsonl"), "--queries"),
    qrels: Path = typer.Option(Path("../shared/data/scifact/qrels/train.tsv"), "--qrels"),
    index_type: str = typer.Option("auto", "--index-type", help="the ANN index compared with exact search"),
    embedder: Optional[str] = typer.Option(None, "--embedder"),
    embed_dtype: Optional[str] = typer.Option(None, "--embed-dtype"),
    out: Optional[Path] = typer.Option(None, "--out", help="where to keep the built indexes (reused)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="evaluate the first N queries"),
    reranker: Optional[str] = typer.Option(None, "--reranker"),
    as_json: bool = typer.Option(False, "--json"),
):
    """nDCG@10, Recall@100, MRR@10 per stage, and ANN recall@10 against exact search."""

    def body():
        _quiet_libraries()
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
        exact_settings = _index_settings(embedder=embedder, embed_dtype=embed_dtype, index_type="flat")
        build_index(corpus, base / "exact", exact_settings)
        exact = Index(base / "exact")
        ann = None
        if index_type != "flat":
            ann_settings = _index_settings(embedder=embedder, embed_dtype=embed_dtype, index_type=index_type)
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

    _run(body)


@app.command("eval-attribution")
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
    folds: Optional[int] = typer.Option(None, "--folds", help="K-fold: choose the settings on K-1 folds "
                                        "(record i is in fold i % K), score the held-out fold"),
    min_precision: float = typer.Option(0.98, "--min-precision", help="with --folds: the attribution precision "
                                        "a setting needs on the training folds to be chosen (if any reaches it)"),
    criterion: str = typer.Option("pooled", "--criterion", help="with --folds: pooled (F1 over the training folds "
                                  "together) | worst-fold (the lowest F1 of the training folds)"),
    limit: Optional[int] = typer.Option(None, "--limit"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON"),
):
    """Copied-span attribution on QuoteSum (PLD+ Appendix D): token P/R/F1 for copied and for source."""

    def body():
        _quiet_libraries()
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

    _run(body)


@app.command("eval-answers")
def eval_answers(
    data: Path = typer.Option(..., "--data", help="the question set (clapnq: a file, or a folder with both files)"),
    fmt: str = typer.Option(..., "--format", help="nq | clapnq | specbench"),
    retrieve: Optional[Path] = typer.Option(None, "--retrieve", help="retrieve from this index instead of "
                                            "answering over each record's own passages"),
    spec: Optional[Path] = typer.Option(None, "--pipeline", help="pipeline YAML (default settings without it)"),
    style: Optional[str] = typer.Option(None, "--style", help="override prompt.style (quote | free | brief)"),
    model: Optional[str] = typer.Option(None, "--model", help="override generator.model"),
    limit: Optional[int] = typer.Option(None, "--limit", help="the first N records (clapnq folder: N of each file)"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="override generator.max_new_tokens"),
    relevance_floor: Optional[str] = typer.Option(None, "--relevance-floor", help="override prompt.relevance_floor "
                                                  "(auto | off | a cosine): decline when no source is about the "
                                                  "question"),
    relevance_doubt: Optional[str] = typer.Option(None, "--relevance-doubt", help="override prompt.relevance_doubt "
                                                  "(auto | none | a cosine): up to it the model is offered to "
                                                  "decline"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the result JSON here (rewritten after "
                                            "every record)"),
):
    """Answer quality: contains-a-reference, token F1, refusals, citation coverage, TTFT and decode speed."""

    def body():
        _quiet_libraries()
        from ragspec.console import progress
        from ragspec.eval.answers import FORMATS, read_records, record_sources, score, summarize
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
        if retrieve is not None and not retrieve.exists():
            raise RagspecError(f"index {retrieve} does not exist")
        records = read_records(data, fmt, limit)
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
        pipe = Pipeline(load_spec(d), str(retrieve) if retrieve else None)
        with console.status("loading the model…"):
            if retrieve is not None:
                pipe.retriever  # noqa: B018 — a bad index fails before the model loads
            pipe.load()
        meta = {"format": fmt, "data": str(data), "style": pipe.spec.prompt.style,
                "decline": None if pipe.spec.prompt.system else pipe.decline, "model": pipe.spec.generator.model,
                "relevance_floor": pipe.relevance_gate.floor if pipe.relevance_gate else None,
                "relevance_doubt": pipe.relevance_gate.doubt if pipe.relevance_gate else None,
                "drafting": pipe.spec.drafting.method, "max_new_tokens": pipe.spec.generator.max_new_tokens,
                "sources": "retrieved from " + str(retrieve) if retrieve else "the record's own passages"}
        rows = []
        with progress() as bar:
            task = bar.add_task(f"{fmt} × {len(records)}", total=len(records))
            for rec in records:
                kw = {} if retrieve is not None else {"documents": record_sources(rec)}
                rows.append(score(rec, pipe.ask(rec.question, **kw)))
                if json_out:
                    _write_json_atomic(json_out, summarize(rows, **meta))
                bar.advance(task)
        r = summarize(rows, **meta)
        if json_out:
            _write_json_atomic(json_out, r)
        f = lambda v, fmt="{:.3f}": "–" if v is None else fmt.format(v)  # noqa: E731
        console.print(
            f"{fmt} · {r['records']} records ({r['answerable']} answerable) · style {r['style']} · {r['model']}\n"
            f"answer contains {f(r['answer_contains'])} · token F1 {f(r['token_f1'])} · refusal "
            f"{f(r['refusal_rate'])} · false refusal {f(r['false_refusal_rate'])} · citation coverage "
            f"{f(r['citation_coverage'])}\n"
            f"TTFT p50 {f(r['ttft_ms_p50'], '{:.0f}')} ms · decode {f(r['decode_tokens_per_s'], '{:.2f}')} tok/s · "
            f"speed-up {f(r['speedup'], '{:.2f}×')}", soft_wrap=True, highlight=False)

    _run(body)


@app.command("bench-replay")
def bench_replay(
    result_path: Path = typer.Argument(..., metavar="RESULT", help="a `ragspec bench --json` result (or a merge)"),
    prompts: Path = typer.Option(Path("../shared/data/spec_bench/question.jsonl"), "--prompts"),
    methods: str = typer.Option("pld,suffix,auto,oracle", "--methods", help="replayable: none, pld, trie, suffix, "
                                "auto, oracle"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the replay JSON here"),
):
    """Replay drafters over a bench run's recorded greedy outputs, without the model: tokens per step and the
    decode speed-up modelled from that run's t(n), beside what the run measured (tune here, confirm with bench)."""

    def body():
        _quiet_libraries()
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
        tok = AutoTokenizer.from_pretrained(generator_source(result.get("model") or "qwen2.5-coder-0.5b-instruct"))
        cats = result["categories"] if "categories" in result else {result.get("category"): result}
        total = sum(len(r.get("vanilla_outputs") or {}) for r in cats.values()) * len(chosen)
        if not total:
            raise RagspecError(f"{result_path} keeps no vanilla outputs (a run from before they were recorded)")
        if not any(r.get("cost_model") for r in cats.values()):
            raise RagspecError(f"{result_path} was run with a fixed --budget: it measured no t(n) to model steps with")
        with progress() as bar:
            task = bar.add_task("replaying", total=total)
            out = replay_result(result, rows, tok, chosen, progress=lambda: bar.advance(task))
        if not out["categories"]:
            raise RagspecError(f"none of the prompts recorded in {result_path} is in {prompts} (another prompts file?)")
        if json_out:
            _write_json_atomic(json_out, out)
        t = Table(title=f"replay of {result_path.name}: modelled decode speed-up (tokens/step), measured beside")
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

    _run(body)


@app.command("bench-search")
def bench_search(
    index_path: Path = typer.Argument(..., metavar="INDEX"),
    queries: Optional[Path] = typer.Option(None, "--queries", help=".jsonl (text field) or one query per line"),
    n: int = typer.Option(200, "-n", help="queries to time (sampled from the index's chunks without --queries)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Query latency: p50/p95 of dense search alone and of the whole retrieval stage."""

    def body():
        _quiet_libraries()
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

    _run(body)


@app.command()
def bench(
    prompts: Path = typer.Option(Path("../shared/data/spec_bench/question.jsonl"), "--prompts"),
    category: str = typer.Option("rag", "--category", help="a Spec-Bench category, several (a,b,c), or all (each category in turn)"),
    limit: Optional[int] = typer.Option(None, "--limit", help="at most N prompts (of each category with all)"),
    offset: int = typer.Option(0, "--offset", help="skip the category's first N prompts (a held-out fold)"),
    model: str = typer.Option("qwen2.5-coder-0.5b-instruct", "--model"),
    methods: Optional[str] = typer.Option(None, "--methods",
                                          help="vanilla, hf-pld (llama-pld with --backend llama.cpp), none, pld, trie, "
                                               "suffix, pldplus-h, pldplus-a, lookahead, ngrammys, auto, oracle (the ceiling); default: "
                                               "vanilla,<peer>,pld,trie,suffix,oracle"),
    backend: str = typer.Option("transformers", "--backend", help="transformers or llama.cpp (the GGUF as shipped)"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    budget: str = typer.Option("auto", "--budget", help="draft tree size: auto (cost-aware) or a number"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the result JSON here"),
    plot_out: Optional[Path] = typer.Option(None, "--plot", help="write accepted-length histograms (PNG)"),
    merge: Optional[list[str]] = typer.Option(None, "--merge", help="no run: merge these result JSONs (runs of "
                                              "some categories each) into one table (and --json)"),
):
    """Decoding speed: vanilla greedy vs HF prompt lookup vs ragspec drafters, outputs checked identical."""

    def body():
        _quiet_libraries()
        if merge:
            return _merge_runs(merge, json_out)
        from ragspec.bench.decoding import load_prompts, plot, run_bench
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
            lm, tok = load_generator(model)
        peer = "llama-pld" if backend == "llama.cpp" else "hf-pld"
        chosen = methods or f"vanilla,{peer},pld,trie,suffix,oracle"
        b = budget if budget == "auto" else int(budget)
        chosen_methods = [m.strip() for m in chosen.split(",") if m.strip()]
        write = (lambda r: _write_json_atomic(json_out, r)) if json_out else None
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

        t = Table(title=f"{model} ({backend}) — {category}, {len(rows)} prompts, {max_new_tokens} new tokens")
        for col in ("method", "tok/s", "decode tok/s", "speed-up", "of ceiling", "tok/step", "nodes/step",
                    "draft · inputs · forward · accept · trim (ms/step)", "identical", "mem MB"):
            t.add_column(col, justify="left" if col == "method" else "right")
        for m, r in result["methods"].items():
            f = lambda v, fmt="{:.2f}": "–" if v is None else fmt.format(v)  # noqa: E731
            split = " · ".join(f"{v:.1f}" for v in r["step_ms"].values()) if r.get("step_ms") else "–"
            t.add_row(m, f(r["tokens_per_s"]), f(r["decode_tokens_per_s"]), f(r["speedup"], "{:.2f}×"),
                      f(r.get("of_ceiling"), "{:.0%}"), f(r["mean_accepted"]), f(r["tree_nodes_per_step"]), split,
                      f"{r['identical']}/{len(rows)}", f(r["drafter_memory_mb_4k"]))
        out.print(t)
        _print_machine(out, result)

    _run(body)


def _merge_runs(paths: list[str], json_out: Optional[Path]) -> None:
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
        _write_json_atomic(json_out, result)
    first = next(iter(result["categories"].values()))
    out = Console(width=None if sys.stdout.isatty() else 200)
    out.print(_category_table(result, result["model"], first.get("backend", "transformers"), result["max_new_tokens"]))
    if not result["complete"]:
        out.print("[yellow]some merged categories were stopped before their last prompt (\"complete\": false)[/]")
    machines: dict[str, list[str]] = {}  # parts may come from other machines: each CPU with its categories
    for cat, r in result["categories"].items():
        machines.setdefault(_cpu_line(r["cpu"]), []).append(cat)
    for line, cats in machines.items():
        out.print(line + (f" ({', '.join(cats)})" if len(machines) > 1 else ""))


def _category_table(result: dict, model: str, backend: str, max_new_tokens: int):
    """`bench --category all`: one row per category, a column per method: speed-up over vanilla (tokens per
    step); the oracle column is the ceiling; identical counts every method's outputs."""
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
        same = sum(v["identical"] for v in row.values())
        t.add_row(cat, str(n), *cells, f"{same}/{n * len(row)}")
    return t


def _cpu_line(cpu: dict) -> str:
    return f"CPU: {cpu['model']} · {cpu['threads']} threads · {' '.join(cpu['flags'])}"


def _print_machine(out, result: dict) -> None:
    out.print(_cpu_line(result["cpu"]))
    mm = result["machine"]["matmul_gflops"]
    out.print("matmul ceilings (GFLOP/s): " + " · ".join(f"{k} {mm[k]}" for k in ("float32", "bfloat16", "int8")
                                                         if k in mm))


@app.command()
def ask(
    question: str = typer.Argument(...),
    index_path: Optional[Path] = typer.Option(None, "--index", help="index path (default: the spec's retriever.index)"),
    spec: Optional[Path] = typer.Option(None, "--pipeline", help="pipeline YAML (default: pipelines/default.yaml settings)"),
    as_json: bool = typer.Option(False, "--json", help="print the Answer as one JSON document (schema in README)"),
    no_stream: bool = typer.Option(False, "--no-stream", help="print the answer when it is complete"),
    model: Optional[str] = typer.Option(None, "--model", help="override generator.model"),
    method: Optional[str] = typer.Option(None, "--drafting", help="override drafting.method (none|pld|trie|suffix|pldplus-h|pldplus-a|lookahead|ngrammys|auto)"),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="override generator.max_new_tokens"),
    where: Optional[list[str]] = typer.Option(None, "--where", help="metadata filter, repeatable (see `search`)"),
):
    """Answer a question over an index: streamed, copied spans highlighted and cited, sources listed."""

    def body():
        _quiet_libraries()
        from ragspec.pipeline import Pipeline
        from ragspec.pipeline.answer import CitationEvent, DoneEvent, SourcesEvent, TextEvent
        from ragspec.spec import load_spec

        data = load_spec(spec).model_dump()
        if model:
            data["generator"]["model"] = model
        if method:
            data["drafting"]["method"] = method
        if max_new_tokens is not None:
            if max_new_tokens < 1:
                raise RagspecError(f"--max-new-tokens must be at least 1, not {max_new_tokens}")
            data["generator"]["max_new_tokens"] = max_new_tokens
        if where:
            data["retriever"]["filter"] = list(where)
        pipe = Pipeline(load_spec(data) if (model or method or max_new_tokens is not None or where) else load_spec(spec),
                        str(index_path) if index_path else None)
        with console.status("loading the index and the model…"):
            pipe.retriever  # noqa: B018 — open the index now, so a bad path fails before the model loads
            pipe.load(progress=lambda line: console.print(f"[dim]choosing a backend: {line}[/]"))
        from ragspec.console import PrefillProgress, status

        answer = None
        if as_json or no_stream:
            with status("answering…") as spinner:
                answer = pipe.ask(question, on_progress=PrefillProgress(spinner=spinner))
            if as_json:
                sys.stdout.write(json.dumps(answer.as_json(), ensure_ascii=False, indent=2) + "\n")
                return
            for w in answer.warnings:
                console.print(f"[yellow]warning:[/] {w}")
            _print_answer(answer)
        else:
            from rich.console import Console

            out = Console(highlight=False, soft_wrap=True)
            live = _LiveAnswer(out)
            reading = PrefillProgress()
            try:
                for ev in pipe.stream(question, on_progress=reading):
                    if isinstance(ev, SourcesEvent):
                        for w in ev.warnings:
                            console.print(f"[yellow]warning:[/] {w}")
                    elif isinstance(ev, TextEvent):
                        reading.close()
                        live.text(ev.text)
                    elif isinstance(ev, CitationEvent):
                        live.cite(ev.citation)
                    elif isinstance(ev, DoneEvent):
                        answer = ev.answer
            finally:  # Ctrl-C included: the terminal is left clean
                reading.close()
                live.close()
        _print_sources(answer)
        _print_stats(answer)

    _run(body)


class _LiveAnswer:
    """Streams answer text to the terminal; on a terminal, copied spans turn highlighted as they close."""

    def __init__(self, out):
        self.out = out
        self.buf = ""
        self.cites = []
        self.live = None
        self.started = False

    def _start(self) -> None:
        """At the first text (not before: a prefill progress bar may hold the screen until then)."""
        self.started = True
        if self.out.is_terminal:
            from rich.live import Live

            self.live = Live(self._render(), console=self.out, refresh_per_second=12, transient=False)
            self.live.start()

    def _render(self):
        from rich.text import Text

        t = Text(self.buf)
        for c in self.cites:
            t.stylize("bold green", c.answer_start, c.answer_end)
        return t

    def text(self, s: str) -> None:
        if not self.started:
            self._start()
        self.buf += s
        if self.live:
            self.live.update(self._render())
        else:
            self.out.file.write(s)
            self.out.file.flush()

    def cite(self, c) -> None:
        self.cites.append(c)
        if self.live:
            self.live.update(self._render())

    def close(self) -> None:
        if self.live:
            self.live.update(self._render())
            self.live.stop()
        else:
            self.out.file.write("\n")


def _print_answer(answer) -> None:
    from rich.console import Console
    from rich.text import Text

    t = Text(answer.text)
    for c in answer.citations:
        t.stylize("bold green", c.answer_start, c.answer_end)
    Console(highlight=False, soft_wrap=True).print(t)


def _print_sources(answer) -> None:
    from rich.console import Console

    out = Console(highlight=False, soft_wrap=True)
    out.print()
    out.print("[bold]Sources[/]")
    cited = {}
    for c in answer.citations:
        cited.setdefault(c.source, []).append(c)
    for s in answer.sources:
        where = s.path + (f"#{s.key}" if s.key else "")
        span = f"lines {s.lines[0]}–{s.lines[1]}" if s.lines else f"chars {s.start}–{s.end}"
        n = len(cited.get(s.number, []))
        quoted = f"[green]{n} quote{'s' if n != 1 else ''}[/]" if n else "[dim]not quoted[/]"
        out.print(f"  [{s.number}] [cyan]{where}[/] {span} [dim](score {s.score:.4f})[/] {quoted}")
    for c in answer.citations:
        q = " ".join(c.quote.split())
        out.print(f"  [dim]└ [{c.source}] chars {c.start}–{c.end}: “{q[:100]}{'…' if len(q) > 100 else ''}”[/]")


def _print_stats(answer) -> None:
    s = answer.stats
    speed = f" · speed-up ≈ {s.speedup_estimate:.2f}× vs plain decoding" if s.speedup_estimate else ""
    console.print(
        f"[dim]retrieval {s.retrieval_ms:.0f} ms · prompt {s.prompt_tokens} tokens, prefill {s.prefill_ms:.0f} ms · "
        f"{s.new_tokens} tokens in {s.decode_ms / 1000:.1f} s ({s.decode_tokens_per_s:.1f} tok/s, "
        f"{s.mean_accepted:.2f} tokens/step, drafting {s.drafting}){speed}"
        + (f" · {s.backend}/{s.dtype}" if s.backend else "") + "[/]"
    )


@app.command()
def serve(
    index_path: Path = typer.Option(..., "--index", help="the index to answer over"),
    spec: Optional[Path] = typer.Option(None, "--pipeline", help="pipeline YAML (its serve: section sets the limits)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind; anything but loopback needs --api-key"),
    port: int = typer.Option(8000, "--port"),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="RAGSPEC_API_KEY",
                                          help="require Authorization: Bearer KEY on /v1 endpoints"),
    executor: str = typer.Option("local", "--executor", help="local | ray (replicas behind Ray Serve's proxy)"),
    replicas: int = typer.Option(1, "--replicas", help="with --executor ray: server replicas, each with its "
                                 "own model"),
    address: Optional[str] = typer.Option(None, "--address", help="with --executor ray: the cluster "
                                          "('auto', 'ray://HOST:10001'); default: start a local Ray"),
):
    """Serve an OpenAI-compatible API (/v1/chat/completions, /v1/ask, /v1/search, …) and a web page at /."""

    def body():
        _quiet_libraries()
        try:
            import uvicorn

            from ragspec.serve.app import build_server, check_bind, create_app
        except ImportError as exc:
            raise RagspecError(f"ragspec serve needs the serve extra: pip install 'ragspec[serve]' ({exc})") from None
        from ragspec.spec import load_spec

        check_bind(host, api_key)
        if executor not in ("local", "ray"):
            raise RagspecError(f"--executor must be local or ray (got '{executor}')")
        if executor == "local" and (replicas != 1 or address is not None):
            raise RagspecError("--replicas and --address go with --executor ray")
        if executor == "ray":
            _serve_on_ray(index_path, load_spec(spec), replicas, host, port, api_key, address)
            return
        with console.status("loading the index and the model…"):
            server = build_server(str(index_path), load_spec(spec), api_key=api_key)
        shown = f"[{host}]" if ":" in host else host
        console.print(f"ragspec serving {index_path} with {server.model_name} on http://{shown}:{port}/"
                      + (" (API key required)" if api_key else ""))
        uvicorn.run(create_app(server), host=host, port=port, log_level="warning")

    _run(body)


def _serve_on_ray(index_path, spec, replicas, host, port, api_key, address):
    from ragspec.cluster import require_ray

    require_ray()
    from ragspec.cluster import serving

    if replicas < 1:
        raise RagspecError(f"--replicas must be at least 1 (got {replicas})")
    from ragspec.index.reader import Index

    Index(index_path).close()  # a bad path fails here, in one line, before any replica loads a model
    with console.status(f"starting {replicas} Ray Serve replica(s), each loading the index and the model…"):
        url = serving.start(index_path, spec, replicas=replicas, host=host, port=port, api_key=api_key,
                            address=address)
    console.print(f"ragspec serving {index_path} with {spec.generator.model} on {url}/ ({replicas} Ray Serve "
                  "replicas" + (", API key required)" if api_key else ")") + "; Ctrl-C stops")
    import time

    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serving.stop()


@app.command()
def models(
    prepare: Optional[str] = typer.Option(None, "--prepare", help="convert an embedded generator now"),
    verify: bool = typer.Option(False, "--verify", help="re-hash every cached model file"),
    calibrate: bool = typer.Option(False, "--calibrate", help="measure (or show) which backend and dtype run "
                                   "a generator fastest on this machine: what generator.backend auto takes"),
    model: Optional[str] = typer.Option(None, "--model", help="the generator to calibrate (default: the default)"),
    force: bool = typer.Option(False, "--force", help="with --calibrate: measure again, even if cached"),
):
    """List the model registry: embedded offline models and where their weights are."""

    def body():
        from rich.console import Console

        from ragspec.models.gguf_cache import cache_dir, ensure_converted, is_valid
        from ragspec.models.registry import (DEFAULT_GENERATOR, EMBEDDED, ONLINE_EMBEDDER, ONLINE_RERANKER, lookup,
                                             part_paths)

        out = Console(highlight=False, soft_wrap=True)
        if calibrate:
            _quiet_libraries()
            _print_calibration(out, model or DEFAULT_GENERATOR, force)
            return
        if model or force:
            raise RagspecError("--model and --force go with --calibrate")
        if prepare:
            m = lookup(prepare, "generator")
            if m is None:
                raise RagspecError(f"'{prepare}' is not an embedded generator ({', '.join(EMBEDDED)})")
            out.print(f"{m.name}: {ensure_converted(m)}")
            return
        for m in EMBEDDED.values():
            try:
                part_paths(m)
                installed = "[green]installed[/]"
            except RagspecError:
                installed = f"[red]missing[/] ({m.pip_command})"
            cached = ""
            if m.fmt == "gguf":
                ok = is_valid(cache_dir(m), m, full=verify)
                cached = " converted" + (" ✓" if ok else " (not yet)") if ok or not verify else " [red]cache damaged[/]"
            out.print(f"{m.name:30} {m.kind:9} {installed}{cached}  [dim]{m.hub_id}; {m.note}[/]")
        out.print(f"[dim]online defaults (need a reachable hub): embedder {ONLINE_EMBEDDER}, "
                  f"reranker {ONLINE_RERANKER}[/]")

    _run(body)


SHAPES = ((1100, 32), (1100, 128), (1100, 256))  # asks `models --calibrate` predicts: 5 sources, 3 answer lengths


def _print_calibration(out, model: str, force: bool) -> None:
    """`ragspec models --calibrate`: the CPU, its matmul ceilings, each candidate's measurements and what
    `generator.backend: auto` takes for a typical ask."""
    from rich.table import Table

    from ragspec.models import machine
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
    for c in ["prefill tok/s", *cols, "decode ms/token"] + [f"{p} + {a} s" for p, a in SHAPES] + ["busy"]:
        t.add_column(c, justify="right")
    notes = []
    for row in table["candidates"]:
        name = f"{row['backend']}/{row['dtype']}"
        if "prefill_tps" not in row:
            notes.append(f"{name}: {row.get('skipped') or 'failed: ' + row.get('error', '?')}")
            continue
        ms = dict(zip(sizes, row["ms"]))
        share = row.get("cpu_share")
        t.add_row(name, f"{row['prefill_tps']:.0f}", *[f"{ms[n]:.0f}" for n in (1, 8, 16) if n in ms],
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
    out.print("[dim]predicted: prompt / prefill tok/s + answer × decode ms/token, drafting accepting "
              f"{machine.ACCEPT:.0%} of draft tokens in a chain; busy: the measurement got under "
              f"{machine.BUSY:.0%} of its cores twice (other jobs ran), re-run with --force when idle[/]")
    out.print(f"[dim]cache: {machine.table_path(model)}[/]")


def main():  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
