"""A bounded load test of `ragspec serve`, on loopback only.

    python examples/serve_load.py --index indexes/NAME [--pipeline FILE] [--clients 16] [--requests 64] \
        [--max-tokens 32] [--question Q ...] [--json out.json]
    python examples/serve_load.py --url http://127.0.0.1:8000 --model NAME [--api-key KEY] ...
    python examples/serve_load.py --index indexes/pydoc-topics --sweep 1,2,4,8,16 --max-tokens 64 \
        [--pipeline pipelines/fast.yaml] --json sweep.json --plot sweep.png

With --index it starts the server itself on a free 127.0.0.1 port (its queue sized for the clients). Each
distinct question is first asked alone; then `--requests` streamed chat completions (at most 64) run from
`--clients` threads (at most 16), and every answer must equal the one asked alone. Reports errors, p50/p95
latency and time to first token, and throughput (requests/s, tokens/s).

--sweep (with --index): distinct questions (default: the quickstart's 12 and rephrasings) asked one after
another, then for each client count c the first c asked all at once (the clients in a child process, off the
server's cores' interpreter); before each phase the server forgets
what earlier asks left (the tree of earlier prompts, the answer memory), so no phase reads another's prompts.
Per c: aggregate tokens/s at once and one after another (their ratio), p50/p95 latency and first token against
the same questions asked alone, and how many answers equal the lone ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

MAX_CLIENTS, MAX_REQUESTS = 16, 64
DEFAULT_QUESTIONS = [
    "Which mode opens a file for appending?",
    "Where does the Danube rise and where does it end?",
    "How long should the dough be kneaded?",
    "What do barges carry on the Rhine?",
]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return 0.0
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ask(client, model: str, question: str, max_tokens: int) -> dict:
    """One streamed chat completion: text, latency, time to first token, completion tokens."""
    t0 = time.perf_counter()
    ttft, parts, usage, stats = None, [], None, {}
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
        stats = ((chunk.model_extra or {}).get("ragspec") or {}).get("stats") or stats
    return {"text": "".join(parts), "latency_s": time.perf_counter() - t0, "ttft_s": ttft or 0.0,
            "tokens": usage.completion_tokens if usage else 0, "prefill_s": stats.get("prefill_ms", 0) / 1000,
            "decode_s": stats.get("decode_ms", 0) / 1000}


def run_load(url: str, model: str, questions: list[str], *, clients: int = 16, requests: int = 64,
             max_tokens: int = 32, api_key: str | None = None, reference: dict | None = None) -> dict:
    """`reference` (question → answer, e.g. another server's `answers`) replaces asking each question alone."""
    from openai import OpenAI

    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"the load test runs on loopback only, not {host}")
    clients, requests = min(clients, MAX_CLIENTS), min(requests, MAX_REQUESTS)
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=600)
    alone = dict(reference) if reference else {q: ask(client, model, q, max_tokens)["text"] for q in questions}

    jobs = [questions[i % len(questions)] for i in range(requests)]
    lock = threading.Lock()
    results: list[dict] = []
    errors: list[str] = []

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                q = jobs.pop(0)
            try:
                r = ask(client, model, q, max_tokens)
                r["identical"] = r["text"] == alone[q]
                with lock:
                    results.append(r)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "clients": clients, "requests": requests, "completed": len(results), "errors": len(errors),
        "error_samples": errors[:3], "identical": sum(r["identical"] for r in results),
        "latency_p50_s": round(percentile(lat, 0.5), 3), "latency_p95_s": round(percentile(lat, 0.95), 3),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3), "ttft_p95_s": round(percentile(ttft, 0.95), 3),
        "wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 3) if wall else 0.0,
        "tokens_per_s": round(tokens / wall, 2) if wall else 0.0, "completion_tokens": tokens,
        "mean_latency_s": round(statistics.mean(lat), 3) if lat else 0.0, "max_tokens": max_tokens,
        "answers": alone,
    }


def at_once(client, model: str, questions: list[str], max_tokens: int) -> tuple[list[dict], float]:
    """Every question asked at the same moment, one thread each: the results in order and the wall time."""
    results: list = [None] * len(questions)
    go = threading.Barrier(len(questions))

    def one(i):
        go.wait()
        try:
            results[i] = ask(client, model, questions[i], max_tokens)
        except Exception as exc:  # noqa: BLE001 - counted and reported
            results[i] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0


def client_phase(url: str, model: str, questions: list[str], max_tokens: int, mode: str,
                 api_key: str | None = None) -> tuple[list[dict], float]:
    """The questions asked one after another (`mode` "alone") or all at once: (results in order, wall time)."""
    from openai import OpenAI

    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0, timeout=900)
    if mode == "at-once":
        return at_once(client, model, questions, max_tokens)
    t0, out = time.perf_counter(), []
    for q in questions:
        out.append(ask(client, model, q, max_tokens))
        print(f"  alone: {out[-1]['latency_s']:.2f} s, first token {out[-1]['ttft_s']:.2f} s", file=sys.stderr)
    return out, time.perf_counter() - t0


def child_phase(url: str, model: str, questions: list[str], max_tokens: int, mode: str,
                api_key: str | None = None) -> tuple[list[dict], float]:
    """`client_phase` in a child process: on a 2-core machine the clients' threads (HTTP, SSE parsing) would
    otherwise share the server's interpreter lock and cores."""
    import subprocess

    cmd = [sys.executable, __file__, "--url", url, "--model", model, "--max-tokens", str(max_tokens),
           "--client-phase", mode, "--questions-json", json.dumps(questions)]
    if api_key:
        cmd += ["--api-key", api_key]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, check=True, text=True)
    got = json.loads(done.stdout)
    return got["results"], got["wall_s"]


def run_sweep(url: str, model: str, questions: list[str], levels: list[int], max_tokens: int, forget,
              api_key: str | None = None, phase=client_phase) -> dict:
    """Distinct questions one after another, then the first c at once for each c in `levels` (see the module).
    `phase`: how the clients run (`client_phase` here, `child_phase` in another process)."""
    n = min(max(levels), len(questions))
    phase(url, model, ["What is a variable?"], 8, "alone", api_key)  # a first ask's one-time costs paid apart
    forget()
    lone, _ = phase(url, model, questions[:n], max_tokens, "alone", api_key)
    rows = []
    for c in levels:
        c = min(c, n)
        forget()
        got, wall = phase(url, model, questions[:c], max_tokens, "at-once", api_key)
        ok = [r for r in got if "error" not in r]
        seq_s = sum(r["latency_s"] for r in lone[:c])
        seq_tokens = sum(r["tokens"] for r in lone[:c])
        tokens = sum(r["tokens"] for r in ok)
        row = {
            "clients": c, "errors": c - len(ok),
            "identical": sum(r["text"] == lone[i]["text"] for i, r in enumerate(got) if "error" not in r),
            "wall_s": round(wall, 3), "tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
            "one_after_another_s": round(seq_s, 3), "one_after_another_tokens_per_s": round(seq_tokens / seq_s, 2),
            "throughput_ratio": round((tokens / wall) / (seq_tokens / seq_s), 3),
            "latency_p50_s": round(percentile([r["latency_s"] for r in ok], 0.5), 3),
            "latency_p95_s": round(percentile([r["latency_s"] for r in ok], 0.95), 3),
            "ttft_p50_s": round(percentile([r["ttft_s"] for r in ok], 0.5), 3),
            "ttft_p95_s": round(percentile([r["ttft_s"] for r in ok], 0.95), 3),
            "alone_ttft_p50_s": round(percentile([r["ttft_s"] for r in lone[:c]], 0.5), 3),
            "alone_latency_p50_s": round(percentile([r["latency_s"] for r in lone[:c]], 0.5), 3),
        }
        row["ttft_ratio"] = round(row["ttft_p50_s"] / row["alone_ttft_p50_s"], 3) if row["alone_ttft_p50_s"] else None
        # a prompt is read at the CPU's arithmetic ceiling whatever else runs, so even with every step hidden the
        # c questions take at least their prompts' reading: the ratio's ceiling here
        prefill_s = sum(r["prefill_s"] for r in lone[:c])
        row["alone_prefill_s"], row["alone_decode_s"] = round(prefill_s, 3), round(sum(r["decode_s"] for r in
                                                                                         lone[:c]), 3)
        row["throughput_ratio_ceiling"] = round(seq_s / prefill_s, 3) if prefill_s else None
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return {"max_tokens": max_tokens, "questions": questions[:n], "levels": rows,
            "alone": [{k: r[k] for k in ("latency_s", "ttft_s", "tokens", "prefill_s", "decode_s")} for r in lone]}


def plot_sweep(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["levels"]
    c = [r["clients"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(c, [r["tokens_per_s"] for r in rows], "o-", label="at once")
    a.plot(c, [r["one_after_another_tokens_per_s"] for r in rows], "s--", label="one after another")
    a.set_xlabel("clients")
    a.set_ylabel("answer tokens/s (all clients)")
    a.set_xscale("log", base=2)
    a.set_ylim(bottom=0)
    a.legend()
    for key, style, label in (("ttft_p50_s", "o-", "first token p50"), ("ttft_p95_s", "o:", "first token p95"),
                              ("latency_p50_s", "s-", "latency p50"), ("latency_p95_s", "s:", "latency p95")):
        b.plot(c, [r[key] for r in rows], style, label=label)
    b.set_xlabel("clients")
    b.set_ylabel("seconds")
    b.set_xscale("log", base=2)
    for ax in (a, b):
        ax.set_xticks(c, [str(x) for x in c])
    b.legend(fontsize=8)
    fig.suptitle(report.get("title", ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", help="start a server over this index (else --url)")
    ap.add_argument("--pipeline", help="pipeline YAML for the started server")
    ap.add_argument("--url", help="a running server on loopback")
    ap.add_argument("--model", help="model name (default: the server's)")
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=MAX_CLIENTS)
    ap.add_argument("--requests", type=int, default=MAX_REQUESTS)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--question", action="append", help="repeatable (default: four questions about the test corpus)")
    ap.add_argument("--json", help="write the report here too")
    ap.add_argument("--sweep", help="client counts, e.g. 1,2,4,8,16 (with --index; see the module)")
    ap.add_argument("--plot", help="--sweep: write its figure here (.png)")
    ap.add_argument("--client-phase", choices=["alone", "at-once"], help=argparse.SUPPRESS)  # child_phase's
    ap.add_argument("--questions-json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_phase:
        results, wall = client_phase(args.url, args.model, json.loads(args.questions_json), args.max_tokens,
                                     args.client_phase, args.api_key)
        print(json.dumps({"results": results, "wall_s": wall}))
        return 0
    if not args.index and not args.url:
        ap.error("give --index or --url")
    if args.sweep and not args.index:
        ap.error("--sweep starts its own server: give --index")
    live = None
    url = args.url
    model = args.model
    if args.index:
        from ragspec.serve.app import BackgroundServer, build_server, create_app
        from ragspec.spec import load_spec

        spec = load_spec(args.pipeline).model_dump()
        spec["serve"]["queue_size"] = max(spec["serve"]["queue_size"], min(args.clients, MAX_CLIENTS))
        server = build_server(args.index, load_spec(spec), api_key=args.api_key)
        live = BackgroundServer(create_app(server))
        url, model = live.url, model or server.model_name
    if model is None:
        import httpx

        model = httpx.get(url.rstrip("/") + "/healthz").json()["model"]
    try:
        if args.sweep:
            # the quickstart's questions and rephrasings (examples/ is on the path when run as a script)
            from prompt_reuse_stats import REPHRASED
            from source_stats import QUESTIONS

            from ragspec.cpu_flags import read_cpuinfo

            levels = [int(x) for x in args.sweep.split(",")]
            report = run_sweep(url, model, args.question or QUESTIONS + REPHRASED, levels, args.max_tokens,
                               server.pipe.forget, args.api_key, phase=child_phase)
            cpu, every = read_cpuinfo()
            flags = sorted(set(every) & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8"})
            report.update(model=model, pipeline=args.pipeline or "default", cpu=cpu, cpu_flags=flags,
                          date=time.strftime("%Y-%m-%d"), command="python examples/serve_load.py "
                          + " ".join(sys.argv[1:] if argv is None else argv))
            report["title"] = f"{model}, {report['date']}, {' '.join(flags)}"
        else:
            report = run_load(url, model, args.question or DEFAULT_QUESTIONS, clients=args.clients,
                              requests=args.requests, max_tokens=args.max_tokens, api_key=args.api_key)
    finally:
        if live is not None:
            live.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.sweep:
        if args.plot:
            plot_sweep(report, args.plot)
        return 0 if all(r["errors"] == 0 and r["identical"] == r["clients"] for r in report["levels"]) else 1
    return 0 if report["errors"] == 0 and report["identical"] == report["completed"] == report["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
