"""A bounded load test of `ragspec serve`, on loopback only.

    python examples/serve_load.py --index indexes/NAME [--pipeline FILE] [--clients 16] [--requests 64] \
        [--max-tokens 32] [--question Q ...] [--json out.json]
    python examples/serve_load.py --url http://127.0.0.1:8000 --model NAME [--api-key KEY] ...

With --index it starts the server itself on a free 127.0.0.1 port (its queue sized for the clients). Each
distinct question is first asked alone; then `--requests` streamed chat completions (at most 64) run from
`--clients` threads (at most 16), and every answer must equal the one asked alone. Reports errors, p50/p95
latency and time to first token, and throughput (requests/s, tokens/s).
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
    ttft, parts, usage = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                                max_tokens=max_tokens, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            if ttft is None:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return {"text": "".join(parts), "latency_s": time.perf_counter() - t0, "ttft_s": ttft or 0.0,
            "tokens": usage.completion_tokens if usage else 0}


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
    args = ap.parse_args(argv)
    if not args.index and not args.url:
        ap.error("give --index or --url")
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
        report = run_load(url, model, args.question or DEFAULT_QUESTIONS, clients=args.clients,
                          requests=args.requests, max_tokens=args.max_tokens, api_key=args.api_key)
    finally:
        if live is not None:
            live.stop()
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report["errors"] == 0 and report["identical"] == report["completed"] == report["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
