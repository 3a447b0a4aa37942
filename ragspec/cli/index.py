"""`ragspec index`, `search` and `info`: build an index, query it, describe it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from ragspec.cli.common import index_settings, run
from ragspec.console import console, human_bytes, quiet_libraries
from ragspec.errors import RagspecError


def index(
    path: Path = typer.Argument(..., help="corpus folder (or one .jsonl/.json file)"),
    name: str | None = typer.Option(None, "--name", help="index name (default: the corpus folder's name)"),
    out: Path | None = typer.Option(None, "--out", help="index path (default: indexes/NAME)"),
    embedder: str | None = typer.Option(None, "--embedder", help="embedded name, HF id or folder"),
    index_type: str | None = typer.Option(None, "--index-type", help="auto | flat | ivfpq"),
    factory: str | None = typer.Option(None, "--factory", help="exact FAISS factory, e.g. 'IVF4096,PQ64'"),
    chunk_tokens: int | None = typer.Option(None, "--chunk-tokens", help="chunk size in tokens (256)"),
    overlap: int | None = typer.Option(None, "--overlap", help="chunk overlap in tokens (32)"),
    embed_dtype: str | None = typer.Option(None, "--embed-dtype", help="auto | float32 | bfloat16"),
    nprobe: int | None = typer.Option(None, "--nprobe", help="IVF lists probed per query (16)"),
    device: str | None = typer.Option(None, "--device", help="cpu | cuda"),
    spec: Path | None = typer.Option(None, "--pipeline", help="take index settings from a pipeline YAML"),
    kv_cache: bool = typer.Option(False, "--kv-cache", help="also fill the source cache: every chunk's KV for "
                                                        "the pipeline's generator (docs/decoding.md)"),
    executor: str = typer.Option("local", "--executor", help="local | ray (chunk and embed on a Ray cluster)"),
    address: str | None = typer.Option(None, "--address", help="with --executor ray: the cluster "
                                          "('auto', 'ray://HOST:10001'); default: start a local Ray"),
    embed_actors: int = typer.Option(1, "--embed-actors", help="with --executor ray: embedding actors"),
    gpus_per_actor: float = typer.Option(0.0, "--gpus-per-actor", help="with --executor ray: GPUs per actor "
                                         "(0: embed on CPU)"),
):
    """Build or update an index from a folder of documents."""

    def body():
        quiet_libraries()
        from ragspec.index.builder import build_index, default_name
        from ragspec.paths import default_index_root

        base = {}
        if spec is not None:
            from ragspec.spec import load_spec

            base = load_spec(spec).index.model_dump()
        settings = index_settings(**{
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
            if kv_cache:
                _fill_source_cache(target, spec, executor, address, embed_actors)
            return
        console.print(
            f"[green]indexed[/] {target}: {s.documents} documents from {s.files} files "
            f"({s.added} added, {s.changed} changed, {s.deleted} deleted, {s.skipped} skipped), {s.chunks} chunks "
            f"({s.embedded} embedded, {s.reused} reused) in {s.seconds:.1f} s"
            + (f", {s.chunks_per_s:.1f} chunks/s embedding" if s.embedded else "")
            + (f"; {s.windows_embedded} gate windows pooled ({s.windows_reused} reused), written in "
               f"{s.windows_seconds:.1f} s" if s.windows_embedded else "")
            + f"; FAISS {s.factory} ({s.index_type}); {human_bytes(s.bytes)} on disk"
        )
        if kv_cache:
            _fill_source_cache(target, spec, executor, address, embed_actors)

    run(body, busy="ragspec index")


def _fill_source_cache(target: Path, spec: Path | None, executor: str = "local", address: str | None = None,
                       actors: int = 1) -> None:
    """Every chunk's KV for the pipeline's generator, into the source cache ($RAGSPEC_HOME/kv), with a bar;
    with --executor ray, computed on Ray actors (one generator each) and written here."""
    import time

    from ragspec.console import progress
    from ragspec.pipeline import Pipeline
    from ragspec.spec import load_spec

    pipe = Pipeline(load_spec(spec) if spec else None, str(target))
    t = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("source cache", total=None)
        tick = lambda done, total: bar.update(task, completed=done, total=total)  # noqa: E731
        if executor == "ray":
            from ragspec.cluster.kv_fill import fill_on_ray
            from ragspec.index.store import Store

            if pipe.store_directory() is None:
                raise RagspecError("--kv-cache with --executor ray writes the disk store: set "
                                   "generator.source_cache_disk_mb above 0")
            store = Store(target / "store.sqlite")
            try:
                texts = store.all_chunk_texts()
            finally:
                store.close()
            made = fill_on_ray(pipe.spec.model_dump(), str(target), texts, pipe.source_store, address, actors,
                               on_progress=tick)
        else:
            with console.status("loading the model…"):
                pipe.load()
            made = pipe.fill_source_cache(on_progress=tick)
    store = pipe.source_store
    console.print(f"[green]source cache[/] {made} pieces computed in {time.perf_counter() - t:.1f} s for "
                  f"{pipe.spec.generator.model}; {human_bytes(store.disk_used)} in {store.directory}")


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


def search(
    args: list[str] = typer.Argument(..., metavar="[INDEX] QUERY", help="the query (after the index path when no --index)"),
    index_opt: Path | None = typer.Option(None, "--index", help="index path, e.g. indexes/NAME"),
    k: int = typer.Option(5, "-k", "--top", help="results to show"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON document (schema: docs/indexing.md)"),
    mode: str = typer.Option("hybrid", "--mode", help="hybrid | dense | bm25"),
    reranker: str | None = typer.Option(None, "--reranker", help="CrossEncoder name or folder"),
    where: list[str] | None = typer.Option(None, "--where", help="metadata filter, repeatable: 'path=tutorial/*', "
                                              "'year>=2020', 'type in md,rst'"),
    diversity: float | None = typer.Option(None, "--diversity", help="MMR strength, 0 (off) … 1"),
):
    """Search an index: rank, score, document path, character offsets, text."""

    def body():
        quiet_libraries()
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
            for loc in h.locations[1:]:
                out.print(f"   [dim]also {loc.kind} in[/] [cyan]{loc.path}[/]{'#' + loc.key if loc.key else ''} "
                          f"[dim][{loc.start}:{loc.end}][/]")
            snippet = " ".join(h.text.split())
            out.print("   " + (snippet[:300] + ("…" if len(snippet) > 300 else "")))
        console.print(f"[dim]{len(hits)} results in {ms:.0f} ms ({', '.join(retriever.stages)})[/]")

    run(body, busy="ragspec search")


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
        win = idx.windows
        out.print("  windows    " + (f"{len(win.vectors):,} gate windows stored (float16)" if win is not None else
                                     f"none stored: each ask pools them; ragspec index {idx.corpus_root} --out "
                                     f"{index_path} adds them"))
        out.print(f"  chunker    {m['chunker']['tokens']} tokens, overlap {m['chunker']['overlap']}")
        out.print(f"  faiss      {f['factory']} ({f['kind']}, nprobe {f['nprobe']}"
                  + (f", refine ×{f['refine_k_factor']}" if f.get("refine_k_factor") else "")
                  + (f", each vector in {1 + f['spill']} lists ({f['spill_rule']})" if f.get("spill") else "") + ")")
        out.print(f"  stages     {' → '.join(stages)}")
        if verify:
            out.print("  [green]all files match their sha256[/]")

    run(body)
