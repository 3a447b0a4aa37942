"""What `ragspec ask --server` saves a command-line user: each question asked by a fresh `ragspec ask` process
that loads the index and the model itself, and by one that sends it to a running `ragspec serve` (started here
on a free loopback port, over the same index and pipeline), interleaved, so each ratio comes from one run.

The 12 quickstart questions, then a rephrasing of each (the server keeps every prompt's KV in its tree of earlier
prompts, so a later question reuses what it shares with the ones before). Prints per phase the median wall time
of the process (start to exit, as a user waits for it), the median time to first token inside the ask, the
prompt tokens the server reused, and how many answers are the same both ways (all must be: the server's reuse is
exact, and both decode greedily).
Usage: python examples/cli_server_stats.py INDEX [--pipeline FILE] [--max-new-tokens 48] [--json OUT]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from prompt_reuse_stats import REPHRASED  # examples/ is on the path when run as a script
from source_stats import QUESTIONS

from ragspec.cpu_flags import read_cpuinfo

RAGSPEC = [sys.executable, "-m", "ragspec.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(index, pipeline, port, timeout_s=900):
    """`ragspec serve` with the pipeline, told to report the prompt tokens it reuses (`serve.report_reuse`: off
    by default, since a client could learn from it how much of another client's prompt matched its own)."""
    import tempfile

    from ragspec.spec import load_spec

    data = load_spec(pipeline).model_dump()
    data["serve"]["report_reuse"] = True
    spec = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)  # JSON is YAML
    with spec:
        json.dump(data, spec)
    cmd = RAGSPEC + ["serve", "--index", index, "--port", str(port), "--pipeline", spec.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ragspec serve stopped: {proc.stderr.read()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/healthz", timeout=2).read()
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"ragspec serve did not answer within {timeout_s} s")


def ask(question, args) -> tuple[float, dict]:
    """(wall seconds of the whole process, the Answer JSON)."""
    t = time.perf_counter()
    out = subprocess.run(RAGSPEC + ["ask", question, "--json", "--max-new-tokens", str(args[0])] + args[1:],
                         capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"ragspec ask failed: {out.stderr[-2000:]}")
    return wall, json.loads(out.stdout)


def measure(index, pipeline=None, max_new=48):
    port = free_port()
    server, url = start_server(index, pipeline, port)
    local_args = [str(max_new), "--index", index] + (["--pipeline", pipeline] if pipeline else [])
    remote_args = [str(max_new), "--server", url]
    phases = {}
    try:
        ask(QUESTIONS[0], remote_args)  # warm the server: kernels, embedder, first prompt (not counted)
        for name, questions in (("questions", QUESTIONS[1:]), ("rephrasings", REPHRASED)):
            rows = []
            for q in questions:
                wall_local, a_local = ask(q, local_args)
                wall_remote, a_remote = ask(q, remote_args)
                rows.append({"question": q, "wall_local_s": wall_local, "wall_server_s": wall_remote,
                             "ttft_local_ms": a_local["stats"]["ttft_ms"],
                             "ttft_server_ms": a_remote["stats"]["ttft_ms"],
                             "prompt_tokens": a_remote["stats"]["prompt_tokens"],
                             "reused": a_remote["stats"]["prefix_reused_tokens"],
                             "same": a_local["text"] == a_remote["text"]})
                print(f"{name} {len(rows):2d}: {wall_local:5.2f} s here, {wall_remote:5.2f} s via the server "
                      f"({rows[-1]['reused']}/{rows[-1]['prompt_tokens']} reused) same={rows[-1]['same']}",
                      flush=True)
            phases[name] = rows
        health = json.loads(urllib.request.urlopen(url + "/healthz").read())
    finally:
        server.terminate()
        server.wait(timeout=60)
    return phases, health


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("index")
    ap.add_argument("--pipeline")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    phases, health = measure(a.index, a.pipeline, a.max_new_tokens)
    cpu, flags = read_cpuinfo()
    flags = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")) or f in ("f16c", "sse4_2"))
    print(f"CPU: {cpu}; flags: {' '.join(flags)}; the server's tree held {health['prompt_cache_mb']} MB")
    med = statistics.median
    summary = {}
    for name, rows in phases.items():
        s = {"asks": len(rows), "wall_local_s": med(r["wall_local_s"] for r in rows),
             "wall_server_s": med(r["wall_server_s"] for r in rows),
             "ttft_local_ms": med(r["ttft_local_ms"] for r in rows),
             "ttft_server_ms": med(r["ttft_server_ms"] for r in rows),
             "reused": med(r["reused"] for r in rows), "prompt_tokens": med(r["prompt_tokens"] for r in rows),
             "same": sum(r["same"] for r in rows)}
        summary[name] = s
        print(f"{name}: median wall {s['wall_local_s']:.2f} s here vs {s['wall_server_s']:.2f} s via the server "
              f"({s['wall_server_s'] / s['wall_local_s']:.2f}x); first token {s['ttft_local_ms']:.0f} vs "
              f"{s['ttft_server_ms']:.0f} ms; reused {s['reused']:.0f} of {s['prompt_tokens']:.0f} prompt tokens; "
              f"answers the same {s['same']} of {s['asks']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": {"model": cpu, "flags": flags}, "summary": summary, "phases": phases,
                       "health": health}, f, indent=2)


if __name__ == "__main__":
    main()
