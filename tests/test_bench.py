"""`ragspec bench` runs end to end on SmolLM2 and writes the documented JSON (speed is not asserted)."""

import json

import pytest

from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.errors import RagspecError


def test_bench_json_schema(tmp_path):
    prompts = tmp_path / "q.jsonl"
    text = ("Summarize: The Danube flows through ten countries. It rises in the Black Forest and ends in the "
            "Black Sea. The Danube flows through ten countries, more than any other river.")
    prompts.write_text(json.dumps({"question_id": 1, "category": "summarization", "turns": [text]}) + "\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--category", "summarization", "--model",
                                 "smollm2-135m-instruct", "--methods", "vanilla,hf-pld,pld,trie,suffix,oracle,pldplus-h",
                                 "--max-new-tokens", "12", "--budget", "16", "--json", str(out), "--plot",
                                 str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert {"model", "category", "prompts", "max_new_tokens", "methods"} <= set(res)
    assert res["complete"] is True and res["prompts"] == 1  # rewritten after every prompt; this is the last
    assert not (tmp_path / "r.json.tmp").exists()
    for name in ("vanilla", "hf-pld", "pld", "trie", "suffix", "oracle", "pldplus-h"):
        m = res["methods"][name]
        assert {"tokens_per_s", "decode_tokens_per_s", "speedup", "mean_accepted", "draft_ms_per_step",
                "verify_ms_per_step", "identical", "divergences"} <= set(m)
        assert m["identical"] == 1 and m["divergences"] == []
    assert res["methods"]["vanilla"]["speedup"] == 1.0
    # the ceiling: the oracle's figures, and every method as a share of its speed-up
    assert set(res["ceiling"]) == {"speedup", "mean_accepted", "decode_tokens_per_s"}
    assert res["ceiling"]["speedup"] == res["methods"]["oracle"]["speedup"]
    assert res["methods"]["oracle"]["of_ceiling"] == 1.0 and res["methods"]["trie"]["of_ceiling"] > 0
    split = res["methods"]["suffix"]["step_ms"]
    assert set(split) == {"draft", "inputs", "forward", "accept", "trim"} and split["forward"] > 0
    assert res["methods"]["vanilla"]["step_ms"] is None
    assert res["cpu"]["threads"] >= 1 and isinstance(res["cpu"]["flags"], list)
    machine = res["machine"]  # the CPU and the matmul ceilings it measured, once per run
    assert {"model", "flags", "threads", "cores", "matmul_gflops"} <= set(machine)
    assert machine["matmul_gflops"]["float32"] > 0 and machine["matmul_gflops"]["shape"] == [1024, 896, 4864]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_bench_all_categories_in_one_run(tmp_path):
    """`--category all`: every category of the file in one process, `--limit` per category, one table."""
    from ragspec.bench.decoding import load_prompts

    prompts = tmp_path / "q.jsonl"
    rows = [("summarization", "Summarize: The Danube flows through ten countries. The Danube flows through ten."),
            ("qa", "What is the capital of France?"),
            ("summarization", "Summarize: The Rhine rises in the Alps. The Rhine rises in the Alps and flows north."),
            ("qa", "Who wrote Hamlet?")]
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n"
                               for i, (c, t) in enumerate(rows)))
    assert [r["question_id"] for r in load_prompts(prompts, "all", 1)] == [0, 1]
    assert [r["question_id"] for r in load_prompts(prompts, "all", None, offset=1)] == [2, 3]
    # several categories, in the order given (a long `all` run split across processes)
    assert [r["question_id"] for r in load_prompts(prompts, "qa,summarization", 1)] == [1, 0]
    with pytest.raises(RagspecError, match="no category 'rag'"):
        load_prompts(prompts, "qa,rag", 1)
    out = tmp_path / "all.json"
    r = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--category", "all", "--limit", "1", "--model",
                                 "smollm2-135m-instruct", "--methods", "vanilla,suffix,oracle", "--max-new-tokens",
                                 "8", "--budget", "16", "--json", str(out)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["category"] == "all" and res["complete"] is True
    assert list(res["categories"]) == ["summarization", "qa"]
    for cat, result in res["categories"].items():
        assert result["category"] == cat and result["prompts"] == 1
        assert set(res["table"][cat]) == {"vanilla", "suffix", "oracle"}
        assert res["table"][cat]["suffix"]["identical"] == 1
        # vanilla's output is kept per prompt, the reference bench.replay needs
        (qid, toks), = result["vanilla_outputs"].items()
        assert int(qid) == next(i for i, (c, _) in enumerate(rows) if c == cat) and 0 < len(toks) <= 8
    assert "all categories" in r.output and "oracle (ceiling)" in r.output
    # a run split in parts merges into the same table
    parts = []
    for cat in ("qa", "summarization"):
        part = tmp_path / f"{cat}.json"
        part.write_text(json.dumps({**res, "category": cat, "categories": {cat: res["categories"][cat]}}))
        parts.append(str(part))
    merged = tmp_path / "merged.json"
    m = CliRunner().invoke(app, ["bench", "--merge", parts[0], "--merge", parts[1], "--json", str(merged)])
    assert m.exit_code == 0, m.output
    both = json.loads(merged.read_text())
    assert both["table"] == {c: res["table"][c] for c in ("qa", "summarization")} and both["complete"] is True
    assert "qa" in m.output and "CPU:" in m.output
    dup = CliRunner().invoke(app, ["bench", "--merge", parts[0], "--merge", parts[0]])
    assert dup.exit_code != 0 and "category 'qa' is in more than one" in dup.output
    bad = CliRunner().invoke(app, ["bench", "--prompts", str(prompts), "--category", "all", "--limit", "0"])
    assert bad.exit_code != 0 and "--limit must be at least 1" in bad.output
