"""`ragspec eval-compare`: two eval-answers runs paired record by record (ragspec/eval/compare.py)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from ragspec.cli import app
from ragspec.eval.compare import mean_se, paired


def _row(i, answerable, contains, declined=False, prompt=500, source=400, accepted=3.0):
    return {"id": i, "answerable": answerable, "answer_contains": contains if answerable else None,
            "token_f1": (0.5 if contains else 0.1) if answerable else None, "declined": declined,
            "prompt_tokens": 0 if declined else prompt, "source_tokens": 0 if declined else source,
            "new_tokens": 0 if declined else 20, "mean_accepted": accepted}


def test_mean_and_standard_error():
    m, se = mean_se([1.0, 0.0, 1.0, 0.0])
    assert m == 0.5 and math.isclose(se, math.sqrt((4 * 0.25 / 3) / 4))
    assert mean_se([2.0]) == (2.0, 0.0)


def test_pairs_match_by_id_and_answerability_and_metrics_apply_where_they_should():
    # CLAP NQ's two files reuse ids: (id, answerable) is the key
    a = [_row(1, True, True), _row(2, True, False), _row(3, True, True), _row(1, False, None, declined=True)]
    b = [_row(1, False, None, declined=False, prompt=250), _row(3, True, False, prompt=250),
         _row(2, True, True, prompt=250), _row(1, True, True, prompt=250), _row(9, True, True)]
    by = {p.metric: p for p in paired(a, b)}
    ac = by["answer contains"]
    assert ac.n == 3 and math.isclose(ac.mean_a, 2 / 3) and math.isclose(ac.mean_b, 2 / 3) and ac.diff == 0
    assert math.isclose(ac.se_diff, mean_se([0.0, 1.0, -1.0])[1])
    assert by["refusal"].n == 1 and by["refusal"].diff == -1.0
    # a declined record has no prompt: prompt tokens are compared over records answered in both runs
    assert by["prompt tokens"].n == 3 and by["prompt tokens"].diff == -250


def test_no_shared_record_is_one_line():
    with pytest.raises(Exception, match="share no record"):
        paired([_row(1, True, True)], [_row(2, True, True)])


def test_the_command_prints_the_paired_table_and_json(tmp_path):
    a = {"model": "m", "source_tokens": None, "rows": [_row(i, True, i % 2 == 0) for i in range(10)]}
    b = {"model": "m", "source_tokens": 256, "rows": [_row(i, True, i % 3 == 0, prompt=300) for i in range(10)]}
    (tmp_path / "off.json").write_text(json.dumps(a))
    (tmp_path / "256.json").write_text(json.dumps(b))
    r = CliRunner().invoke(app, ["eval-compare", str(tmp_path / "off.json"), str(tmp_path / "256.json")])
    assert r.exit_code == 0, r.output
    assert "answer contains" in r.output and "source budget 256" in r.output
    r = CliRunner().invoke(app, ["eval-compare", str(tmp_path / "off.json"), str(tmp_path / "256.json"), "--json"])
    out = json.loads(r.output)
    ac = next(m for m in out["metrics"] if m["metric"] == "answer contains")
    assert ac["n"] == 10 and math.isclose(ac["diff"], 0.4 - 0.5)
    (tmp_path / "bad.json").write_text("{not json")
    r = CliRunner().invoke(app, ["eval-compare", str(tmp_path / "bad.json"), str(tmp_path / "256.json")])
    assert r.exit_code == 2 and "not an eval-answers --json file" in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_runs_over_record_ranges_join_with_commas(tmp_path):
    for name, rows in (("a1", range(0, 5)), ("a2", range(5, 10)), ("b", range(10))):
        (tmp_path / f"{name}.json").write_text(json.dumps({"rows": [_row(i, True, i < 3) for i in rows]}))
    joined = f"{tmp_path / 'a1.json'},{tmp_path / 'a2.json'}"
    r = CliRunner().invoke(app, ["eval-compare", joined, str(tmp_path / "b.json"), "--json"])
    assert r.exit_code == 0, r.output
    assert next(m for m in json.loads(r.output)["metrics"] if m["metric"] == "answer contains")["n"] == 10
    r = CliRunner().invoke(app, ["eval-compare", f"{joined},{tmp_path / 'a1.json'}", str(tmp_path / "b.json")])
    assert r.exit_code == 2 and "in two of the files joined" in r.output
