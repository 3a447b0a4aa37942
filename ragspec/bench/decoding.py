"""`ragspec bench`: vanilla HF greedy, HF prompt lookup and ragspec's drafters on Spec-Bench prompts.
With the llama.cpp backend, vanilla is llama.cpp's own greedy decoding and the peer row `llama-pld` is
llama-cpp-python's `LlamaPromptLookupDecoding`.

Methods run interleaved per prompt after a warm-up, in one process, on the same chat-templated prompt.
Every output is compared with vanilla greedy token by token; a divergence is reported with its position and
the target's top-2 logit margin there (< 1e-4: a numerical tie; > 1e-3: a bug). On llama.cpp a margin under
the gap between that row decoded alone and decoded in a two-row batch (llama.cpp's kernels differ there, see
docs/decoding.md) is its own verdict, `kernel`: no tree can reproduce one-token decodes at that point.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from ragspec.cpu_flags import read_cpuinfo
from ragspec.decoding.backends import calibrate, describe, is_llama
from ragspec.decoding.backends.transformers import generate_kwargs
from ragspec.decoding.budget import AdaptiveBudget
from ragspec.decoding.drafters import METHODS, make_drafter
from ragspec.decoding.drafters.base import DraftState
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.errors import RagspecError
from ragspec.machine.table import machine_info
from ragspec.runtime.model_runtime import runtime_of
from ragspec.runtime.prompt_mode import prompt_copy

HF_METHODS = ("vanilla", "hf-pld")
LLAMA_METHODS = ("vanilla", "llama-pld")
LLAMA = "llama"  # in a transformers run: plain llama.cpp greedy on the same GGUF, the verifier a user would pick instead
PEERS = HF_METHODS + LLAMA_METHODS + (LLAMA,)  # rows that do not run through ragspec's loop
CEILING = "oracle"  # knows vanilla's output: the best any context drafter can do here (drafters/oracle.py)
STEP_PARTS = ("draft", "inputs", "forward", "accept", "trim")


def cpu_info() -> dict:
    """The CPU a figure came from: model name, threads and the SIMD flags that decide which kernels run."""
    model, flags = read_cpuinfo()
    keep = [x for x in flags if x.startswith(("avx", "amx", "fma", "f16c")) or x in ("sse4_2",)]
    return {"model": model, "threads": torch.get_num_threads(), "flags": sorted(keep)}


def bench_machine() -> dict:
    """The bench JSON's one "machine" block: the CPU (model, threads, cores, every SIMD flag of `cpu_info`) and
    its measured matmul ceilings (`models.machine.machine_info`)."""
    return machine_info() | {"flags": cpu_info()["flags"]}


def model_dtype(model) -> str:
    """The weights' format a bench ran: gguf (ragspec's kernels on the GGUF's blocks, or llama.cpp itself), int8,
    or the torch dtype."""
    rt = runtime_of(model)
    if is_llama(model) or (rt is not None and rt.gguf):
        return "gguf"
    if rt is not None and rt.int8 is not None:
        return "int8"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def llama_build(model) -> dict:
    """Which llama.cpp ran: llama-cpp-python's version, ggml's system line (its SIMD and AMX kernels), whether
    the repacked weight buffers were on, and its threads (the same as ragspec's in a bench)."""
    import llama_cpp

    from ragspec.runtime.llama_cpp_model import model_params

    lc = llama_cpp.llama_cpp
    return {"version": llama_cpp.__version__, "system_info": lc.llama_print_system_info().decode().strip(),
            "extra_buffers": bool(model_params(lc).use_extra_bufts), "threads": model.n_threads}


def load_prompts(path: Path, category: str, limit: int | None, offset: int = 0) -> list[dict]:
    """Prompts of one category, of several (`a,b,c`: in that order, so a long `all` run can be split across
    processes and its parts merged), or of every category (`all`, file order); `offset` and `limit` apply per
    category (skip the first `offset` of each: a held-out fold; then at most `limit` of each)."""
    groups: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                groups.setdefault(obj.get("category"), []).append(obj)
    wanted = list(groups) if category == "all" else [c.strip() for c in category.split(",") if c.strip()]
    missing = [c for c in wanted if c not in groups]
    if missing and len(wanted) > 1:
        raise RagspecError(f"no category {', '.join(repr(c) for c in missing)} in {path} "
                           f"(it has: {', '.join(map(str, groups))})")
    rows = []
    for cat in wanted:
        chosen = groups.get(cat, [])[offset:]
        rows += chosen[:limit] if limit else chosen
    if not rows:
        raise RagspecError(f"no prompts of category '{category}' in {path}" + (f" after the first {offset}" if offset else ""))
    return rows


def by_category(rows: list[dict]) -> dict[str, list[dict]]:
    """Prompts grouped by category, in the order the categories first appear."""
    out: dict[str, list[dict]] = {}
    for row in rows:
        out.setdefault(row.get("category") or "?", []).append(row)
    return out


def run_categories(model, tokenizer, rows: list[dict], methods: list[str], max_new_tokens: int = 128,
                   budget: str | int = "auto", progress=None, model_name: str = "", on_result=None,
                   label: str = "all") -> dict:
    """`--category all` (or `a,b,c`): `run_bench` on each category in turn in one process (the model loads once),
    one result per category and a category × method table; `on_result(result_so_far)` after every prompt."""
    out = {"model": model_name, "category": label, "max_new_tokens": max_new_tokens, "complete": False,
           "categories": {}}

    def keep(cat: str, result: dict) -> None:
        out["categories"][cat] = result
        out["table"] = category_table(out)
        if on_result:
            on_result(out)

    for cat, prompts in by_category(rows).items():
        keep(cat, run_bench(model, tokenizer, prompts, methods, max_new_tokens, budget, progress=progress,
                            model_name=model_name, category=cat, on_prompt=lambda r, c=cat: keep(c, r)))
    out["complete"] = True
    if on_result:
        on_result(out)
    return out


def merge_categories(results: list[dict]) -> dict:
    """One `all`-style result from the JSONs of runs that each covered some categories (`--category a,b`, one
    category, or `all`), so a run too long for one sitting can be done in parts. The runs must agree on the
    model and `max_new_tokens`; a category measured twice is an error (which one to keep is not ours to say).
    "complete" is true when every merged category ran all its prompts."""
    out = {"model": None, "category": "merged", "max_new_tokens": None, "complete": True, "categories": {},
           "parts": []}
    for r in results:
        cats = r["categories"] if "categories" in r else {r["category"]: r}
        for key in ("model", "max_new_tokens"):
            if out[key] is not None and r.get(key) != out[key]:
                raise RagspecError(f"cannot merge runs with different {key}: {out[key]!r} and {r.get(key)!r}")
            out[key] = r.get(key)
        for cat, one in cats.items():
            if cat in out["categories"]:
                raise RagspecError(f"category '{cat}' is in more than one of the merged runs")
            out["categories"][cat] = one
        # a part stopped between categories is whole for the categories it finished: each says so itself
        out["complete"] = out["complete"] and all(one.get("complete") for one in cats.values())
        out["parts"].append({"category": r.get("category"), "categories": list(cats), "complete": r.get("complete")})
    out["table"] = category_table(out)
    return out


def category_table(result: dict) -> dict:
    """{category: {method: {"speedup", "mean_accepted", "of_ceiling", "identical", "prompts"}}} of an `all` run."""
    table = {}
    for cat, r in result["categories"].items():
        table[cat] = {m: {"speedup": v["speedup"], "mean_accepted": v["mean_accepted"],
                          "of_ceiling": v.get("of_ceiling"), "identical": v["identical"], "prompts": r["prompts"],
                          "vs_llama": v.get("vs_llama")}
                      for m, v in r["methods"].items()}
    return table


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


class _FirstToken:
    """An HF streamer that notes when `generate` hands out its first new token(s): that method's own prefill
    (its first `put` is the prompt itself)."""

    def __init__(self, start: float):
        self.start, self.puts, self.first_ms, self.first_n = start, 0, None, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_ms, self.first_n = (time.perf_counter() - self.start) * 1000, int(value.numel())

    def end(self) -> None:
        pass


def hf_generate(model, prompt: list[int], max_new: int, eos: list[int], lookup: int = 0):
    """(tokens, total ms, ms to the first token, tokens given with it) of HF `generate`, greedy."""
    # plain greedy prefills in the chunks ragspec's backend uses (same kernels, same numerics); HF's assisted
    # decoding has no chunked prefill
    ids = torch.tensor([prompt], device=model.device)
    t = time.perf_counter()
    first = _FirstToken(t)
    kw = {"prompt_lookup_num_tokens": lookup} if lookup else generate_kwargs(model, prompt)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             eos_token_id=eos, pad_token_id=eos[0], streamer=first, **kw)
    total = (time.perf_counter() - t) * 1000
    return out[0, len(prompt):].tolist(), total, total if first.first_ms is None else first.first_ms, first.first_n or 1


def llama_generate(model, prompt: list[int], max_new: int, eos: list[int], lookup: int = 0):
    """(tokens, total ms, ms to the first token, 1) of llama.cpp's greedy decoding (`LlamaCppModel.greedy`), or
    with `lookup`, of llama-cpp-python's high-level `Llama` with `LlamaPromptLookupDecoding` drafting `lookup`
    tokens (greedy: top_k=1). The first token is timed as llama.cpp hands it out: its own prefill."""
    if not lookup:
        t = time.perf_counter()
        first = []
        toks = model.greedy(prompt, max_new, set(eos), on_first=lambda: first.append(time.perf_counter()))
        end = time.perf_counter()
        return toks, (end - t) * 1000, ((first[0] if first else end) - t) * 1000, 1
    peer = getattr(model, "_pld_peer", None)
    if peer is None:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ragspec.runtime.llama_cpp_model import model_params

        # logits_all: with a draft model llama-cpp-python 0.3.36 keeps every row's logits but sizes its buffer by
        # this flag (n_batch rows otherwise: a prompt over one batch overflows it)
        # its Llama class reads llama.cpp's defaults itself: give it ours (no AMX weight buffer, model_params)
        low = llama_cpp.llama_cpp
        defaults = low.llama_model_default_params
        low.llama_model_default_params = lambda: model_params(SimpleNamespace(
            llama_model_default_params=defaults, llama_print_system_info=low.llama_print_system_info))
        try:
            peer = model._pld_peer = Llama(str(model.path), n_ctx=model.n_ctx, n_batch=model.n_batch, logits_all=True,
                                           n_threads=model.n_threads, n_threads_batch=model.n_threads, verbose=False,
                                           draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup))
        finally:
            low.llama_model_default_params = defaults
    out = []
    t = time.perf_counter()
    first = None
    for tok in peer.generate(prompt, top_k=1, temp=0.0, reset=True):
        first = first or time.perf_counter()
        out.append(int(tok))
        if tok in eos or len(out) >= max_new:
            break
    end = time.perf_counter()
    return out, (end - t) * 1000, ((first or end) - t) * 1000, 1


def top2_margin(model, prompt: list[int], prefix: list[int]) -> float:
    if is_llama(model):
        import numpy as np

        model.clear()
        model.feed(prompt + prefix, 0, last_logits=True)
        row = np.sort(model.row((len(prompt + prefix) - 1) % model.n_batch))
        return float(row[-1] - row[-2])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + prefix], device=model.device), logits_to_keep=1).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def llama_row_gap(model, prompt: list[int], prefix: list[int]) -> float:
    """The largest logit difference, at the row that predicts the token after `prompt + prefix`, between that
    row decoded alone (llama.cpp's greedy) and decoded as the first of two rows (a verifier step): what
    llama.cpp's own kernels leave apart there. 0 at the first output token (both read it from the prefill)."""
    import numpy as np

    if not prefix:
        return 0.0
    ctx = prompt + prefix
    pos = len(ctx) - 1
    model.clear()
    model.feed(ctx[:-1], 0)
    model.decode([(ctx[-1], pos, [0], True)])
    one = model.row(0).copy()
    model.lc.llama_memory_seq_rm(model.mem, 0, pos, -1)
    model.decode([(ctx[-1], pos, [0], True), (ctx[-1], pos + 1, [0], False)])
    two = model.row(0).copy()
    model.clear()
    return float(np.abs(one - two).max())


def verdict(margin: float, row_gap: float | None = None) -> str:
    """`tie` under 1e-4; `kernel` when the margin is within llama.cpp's one-row/two-row gap there; `bug` over 1e-3."""
    if margin < 1e-4:
        return "tie"
    if row_gap is not None and margin <= row_gap:
        return "kernel"
    return "bug" if margin > 1e-3 else "unclear"


def drafter_memory_mb(method: str, model, tokenizer=None, tokens: int = 4096) -> float:
    """Peak Python heap of preparing a drafter on a `tokens`-long context and drafting 128 steps."""
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, min(model.config.vocab_size, 32000), (tokens,), generator=g).tolist()
    ctx = ctx[: tokens // 2] + ctx[: tokens // 2]  # repeated text, so drafts are found
    tracemalloc.start()
    drafter = make_drafter(method, model, tokenizer)
    state = DraftState(tokens=list(ctx), prompt_len=len(ctx))
    tracemalloc.stop()
    table = getattr(drafter, "table", None)
    if table is not None:  # ngrammys: rows of the right shape, not minutes of model calls on random tokens
        table.path = None
        table.compute = lambda toks, k, w: {t: [[(t + i + j) % 1000 for j in range(w)] for i in range(k)]
                                            for t in toks}
    if drafter.hidden_layer is not None:
        state.hidden = torch.zeros((len(ctx) + 128, model.config.hidden_size))  # the verifier's buffer
    if getattr(drafter, "attention_heads", None):
        state.attention = torch.rand(len(ctx) + 128)  # the verifier's attention row
    tracemalloc.start()
    drafter.prepare(state)
    for i in range(128):
        drafter.propose(state, 64)
        state.tokens.append(ctx[i])
        drafter.update(state, [ctx[i]])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # tracemalloc sees Python objects (the drafter's index and trees), not torch buffers: the hidden states
    # PLD+ reads are the verifier's, kept for the forward anyway
    return round(peak / 1e6, 2)


def run_bench(model, tokenizer, prompts: list[dict], methods: list[str], max_new_tokens: int = 128,
              budget: str | int = "auto", progress=None, model_name: str = "", category: str = "",
              on_prompt=None) -> dict:
    """Run every method on every prompt, interleaved; `on_prompt(result_so_far)` after each prompt lets a long
    run keep its figures if it is stopped ("complete": false until the last prompt)."""
    peers = LLAMA_METHODS if is_llama(model) else HF_METHODS + (LLAMA,)
    unknown = [m for m in methods if m not in peers and m not in METHODS and m != CEILING]
    if unknown:
        raise RagspecError(f"unknown bench method(s) for this backend: {', '.join(unknown)} (peers: {', '.join(peers)})")
    if "vanilla" not in methods:
        methods = ["vanilla"] + methods
    eos = sorted(SpeculativeGenerator(model, tokenizer).eos)
    if LLAMA in methods:
        from ragspec.models.generator import load_llama_generator

        model._ragspec_llama_peer = load_llama_generator(model_name)[0]
    cost = calibrate(model) if budget == "auto" else None
    budgets = {m: (AdaptiveBudget(cost) if cost else int(budget)) for m in methods if m not in PEERS}
    drafters = {m: make_drafter(m, model, tokenizer) for m in methods if m not in PEERS}
    if CEILING in drafters:  # the oracle sizes its own chain (it knows every token will be accepted)
        drafters[CEILING].cost = cost
        budgets[CEILING] = 256
    # warm-up: every method once on a short run
    warm = chat_ids(tokenizer, prompts[0]["turns"][0])
    for m in methods:
        _run_one(m, model, tokenizer, warm, 8, eos, drafters, budgets)
    memory = {m: drafter_memory_mb(m, model, tokenizer) for m in methods
              if m not in PEERS and m not in ("none", CEILING)}
    acc = defaultdict(lambda: defaultdict(float))
    hist = defaultdict(list)
    divergences = defaultdict(list)
    identical = defaultdict(int)
    outputs: dict[str, list[int]] = {}  # vanilla's tokens per prompt: greedy's reference, for bench.replay
    per_prompt: list[dict] = []  # each prompt's time and tokens per method: a noisy prompt can be seen
    head = {"model": model_name, "category": category, "max_new_tokens": max_new_tokens,
            "budget": budget if isinstance(budget, int) else "auto", "cost_model": cost.as_dict() if cost else None,
            "machine": bench_machine(), "device": str(getattr(model, "device", "cpu")),
            "source_budget": None,  # Spec-Bench prompts are sent whole (no prompt.source_tokens); see per_prompt
            "backend": describe(model), "dtype": model_dtype(model), "prompt_copy": prompt_copy(model),
            "reference": "vanilla"}
    peer = model if is_llama(model) else getattr(model, "_ragspec_llama_peer", None)
    if peer is not None:
        head["llama_cpp"] = llama_build(peer)

    def summary(done: int) -> dict:
        return {**_summarize(acc, hist, divergences, identical, memory, methods, done, len(prompts), head),
                "per_prompt": list(per_prompt), "vanilla_outputs": dict(outputs)}

    for n, row in enumerate(prompts):
        prompt = chat_ids(tokenizer, row["turns"][0])
        ref = None
        times = {"prompt": row.get("question_id", n), "prompt_tokens": len(prompt)}
        for m in methods:
            if m == CEILING:
                drafters[m].reference = list(ref)
            own = _llama_of(m, model)
            if own is not None:
                own.perf(reset=True)
            toks, total_ms, first_ms, first_n, stats = _run_one(m, model, tokenizer, prompt, max_new_tokens, eos,
                                                                drafters, budgets)
            # each method's own prefill (its time to its first token) and its decode after it
            times[m] = {"ms": round(total_ms, 1), "prefill_ms": round(first_ms, 1), "tokens": len(toks),
                        "steps": stats["steps"] if stats else None}
            if own is not None:  # llama.cpp's own timers of the same run, beside the bench's
                times[m]["llama_cpp_timers"] = own.perf()
            if m == "vanilla":
                ref = toks
                outputs[str(row.get("question_id", n))] = list(toks)
            a = acc[m]
            a["tokens"] += len(toks)
            a["total_ms"] += total_ms
            a["prefill_ms"] += first_ms
            a["prefill_tokens"] += len(prompt)
            a["decode_ms"] += max(total_ms - first_ms, 1e-6)
            a["decode_tokens"] += max(len(toks) - first_n, 0)
            if stats:
                a["steps"] += stats["steps"]
                a["draft_ms"] += stats["draft_ms"]
                a["verify_ms"] += stats["verify_ms"]
                a["tree_nodes"] += stats["tree_nodes"]
                a["step_draft"] += stats["draft_ms"]
                for part, ms in stats["step_ms"].items():
                    a["step_" + part] += ms
                hist[m].extend(stats["accepted_lengths"])
            if m == "vanilla":  # the reference: compared with itself it would only pad the count
                continue
            if m == LLAMA:  # another verifier of the same GGUF: its greedy is its own, not compared
                continue
            if toks == ref:
                identical[m] += 1
            else:
                pos = next((i for i, (x, y) in enumerate(zip(toks, ref)) if x != y), min(len(toks), len(ref)))
                margin = top2_margin(model, prompt, ref[:pos])
                gap = llama_row_gap(model, prompt, ref[:pos]) if is_llama(model) else None
                divergences[m].append({"prompt": row.get("question_id", n), "position": pos,
                                       "top2_margin": round(margin, 6),
                                       **({"row_gap": round(gap, 6)} if gap is not None else {}),
                                       "verdict": verdict(margin, gap)})
        per_prompt.append(times)
        if on_prompt:
            on_prompt(summary(n + 1))
        if progress:
            progress()
    return summary(len(prompts))


def _summarize(acc, hist, divergences, identical, memory, methods, done, total, head) -> dict:
    rates = {m: _rates(acc[m]) for m in methods}
    van_tps = rates["vanilla"]["end_to_end"]
    llama = rates.get(LLAMA) if LLAMA in methods else None
    result = {**head, "prompts": done, "complete": done == total, "methods": {}}
    for m in methods:
        a = acc[m]
        tps = rates[m]["end_to_end"]
        steps = a["steps"]
        result["methods"][m] = {
            "tokens_per_s": round(tps, 3),
            "prefill_ms": round(a["prefill_ms"] / done, 1),  # mean time to the first token
            "prefill_tokens_per_s": round(rates[m]["prefill"], 1),
            "decode_tokens_per_s": round(rates[m]["decode"], 3),
            "speedup": round(tps / van_tps, 3),
            # the same three rates as ratios to plain llama.cpp's: what the prompt read and the decoding each add
            "vs_llama": {k: round(v / llama[k], 3) if llama[k] else None for k, v in rates[m].items()}
                        if llama else None,
            "mean_accepted": round(a["tokens"] / steps, 3) if steps else None,
            "draft_ms_per_step": round(a["draft_ms"] / steps, 3) if steps else None,
            "verify_ms_per_step": round(a["verify_ms"] / steps, 3) if steps else None,
            "draft_share": round(a["draft_ms"] / (a["draft_ms"] + a["verify_ms"]), 4) if steps else None,
            "tree_nodes_per_step": round(a["tree_nodes"] / steps, 2) if steps else None,
            "identical": None if m in (LLAMA, "vanilla") else identical[m],
            "divergences": divergences[m],
            "accepted_histogram": _histogram(hist[m]) if hist[m] else None,
            "drafter_memory_mb_4k": memory.get(m),
            # per step, ms: drafting, model inputs (ids, positions, mask), forward, acceptance, cache trim
            "step_ms": {p: round(a["step_" + p] / steps, 3) for p in STEP_PARTS} if steps else None,
        }
    ceiling = result["methods"].get(CEILING)
    if ceiling:
        result["ceiling"] = {k: ceiling[k] for k in ("speedup", "mean_accepted", "decode_tokens_per_s")}
        for r in result["methods"].values():
            r["of_ceiling"] = round(r["speedup"] / ceiling["speedup"], 3) if ceiling["speedup"] else None
    return result


def _rates(a: dict) -> dict:
    """Tokens per second end to end, of prompt read (prompt tokens over time to the first token) and of decode
    (tokens after the first over the time after it)."""
    per_s = lambda n, ms: n / (ms / 1000) if ms > 0 else 0.0  # noqa: E731
    return {"end_to_end": per_s(a["tokens"], a["total_ms"]), "prefill": per_s(a["prefill_tokens"], a["prefill_ms"]),
            "decode": per_s(a["decode_tokens"], a["decode_ms"])}


def _llama_of(m: str, model):
    """The llama.cpp model a plain llama.cpp greedy row runs on (`llama`, or vanilla on the llama.cpp backend)."""
    if m == LLAMA:
        return model._ragspec_llama_peer
    return model if m == "vanilla" and is_llama(model) else None


def _run_one(m, model, tokenizer, prompt, max_new, eos, drafters, budgets):
    """(tokens, total ms, ms to the first token, tokens given with it, ragspec's step stats or None)."""
    if m in LLAMA_METHODS and is_llama(model):
        return *llama_generate(model, prompt, max_new, eos, lookup=10 if m == "llama-pld" else 0), None
    if m == LLAMA:
        return *llama_generate(model._ragspec_llama_peer, prompt, max_new, eos), None
    if m in HF_METHODS:
        return *hf_generate(model, prompt, max_new, eos, lookup=10 if m == "hf-pld" else 0), None
    gen = SpeculativeGenerator(model, tokenizer, drafter=drafters[m], max_new_tokens=max_new, eos_token_ids=eos,
                               budget=budgets[m])
    t = time.perf_counter()
    for _ in gen.stream(prompt):
        pass
    ms = (time.perf_counter() - t) * 1000
    stats = gen.stats.as_dict()
    # greedy: the first token is known when the prefill ends (the loop streams it before the first step)
    return gen.tokens, ms, min(stats["prefill_ms"], ms), 1, stats


def _histogram(lengths: list[int]) -> dict:
    h: dict[int, int] = defaultdict(int)
    for x in lengths:
        h[x] += 1
    return {str(k): h[k] for k in sorted(h)}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = [m for m, r in result["methods"].items() if r["accepted_histogram"]]
    fig, axes = plt.subplots(1, max(1, len(ms)), figsize=(4 * max(1, len(ms)), 3.2), squeeze=False)
    for ax, m in zip(axes[0], ms):
        h = result["methods"][m]["accepted_histogram"]
        xs = [int(k) for k in h]
        ax.bar(xs, [h[str(x)] for x in xs])
        r = result["methods"][m]
        of = f", {r['of_ceiling']:.0%} of ceiling" if r.get("of_ceiling") is not None and m != CEILING else ""
        ax.set_title(f"{m}: {r['speedup']}×{of}, {r['mean_accepted']} tok/step", fontsize=9)
        ax.set_xlabel("tokens per step")
    axes[0][0].set_ylabel("steps")
    fig.suptitle(f"{result['model']} — {result['category']} ({result['prompts']} prompts)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
