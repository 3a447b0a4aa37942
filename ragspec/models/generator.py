"""Load a causal LM and its tokenizer by registry name, local folder or hub id."""

from __future__ import annotations

import json
import threading
import weakref
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.models.registry import hub_error, lookup, resolve_hub_or_folder
from ragspec.runtime.options import RuntimeOptions, current_options, options_in_effect


def torch_dtype(name: str, what: str):
    """The torch dtype the weights load in for a setting's name (int8 and gguf load float32, then their linears
    are replaced); a bad name is a one-line error."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.float32,
              "gguf": torch.float32}
    if name not in dtypes:
        raise RagspecError(f"{what} dtype '{name}' is not one of {', '.join(dtypes)}")
    return dtypes[name]


def generator_source(name: str) -> str:
    """A path or hub id `from_pretrained` can load float weights from; embedded GGUF models are converted once and
    cached (float dtypes only: dtype gguf and llama.cpp never make that folder)."""
    embedded = lookup(name, "generator")
    if embedded is not None:
        from ragspec.models.gguf_cache import ensure_converted

        return str(ensure_converted(embedded))
    return resolve_hub_or_folder(name, "generator")


def tokenizer_source(name: str) -> str:
    """Where `name`'s tokenizer (and config) load from: for a GGUF (embedded, or a local .gguf) the few MB read
    from its metadata once (`gguf_cache.ensure_meta`), never a converted float folder."""

    if lookup(name, "generator") is not None or Path(name).expanduser().suffix == ".gguf":
        from ragspec.models.gguf_cache import ensure_meta
        from ragspec.models.gguf_source import gguf_source

        return str(ensure_meta(gguf_source(name)))
    return resolve_hub_or_folder(name, "generator")


def load_tokenizer(name: str):
    """`name`'s tokenizer. A GGUF's (embedded, or a local .gguf) is read from the tokenizer.json made from its
    metadata, as the generic fast tokenizer: the model's own class (Qwen2Tokenizer) would also keep Python copies of
    its 151k-token vocabulary and merges, 50 MB resident for the same ids and chat template (tested)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from ragspec.memory import release_freed

    source = tokenizer_source(name)
    gguf = lookup(name, "generator") is not None or Path(name).expanduser().suffix == ".gguf"
    tokenizer = (PreTrainedTokenizerFast if gguf else AutoTokenizer).from_pretrained(source)
    release_freed()  # the parsed JSON's buffers
    return tokenizer


def load_generator(name: str, device: str = "cpu", dtype: str = "float32", options: RuntimeOptions | None = None):
    """(model, tokenizer), the model in eval mode on `device`, made ready by `runtime.prepare` (on CPU its linears
    packed for oneDNN, quantised for dtype int8, and so on) under `options` (a spec's `generator.runtime`; None:
    the defaults and the environment's overrides). dtype gguf builds it from the GGUF alone, its linears on the
    GGUF's own blocks (`models/gguf_model.py`: no float copy on disk or in memory)."""
    with options_in_effect(options or current_options()) as opts:
        return _load_generator(name, device, dtype, opts)


def _load_generator(name: str, device: str, dtype: str, options: RuntimeOptions):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dt = torch_dtype(dtype, "generator")
    if dtype in ("int8", "gguf") and device != "cpu":
        raise RagspecError(f"generator dtype {dtype} runs on CPU only: set generator.device: cpu, or use bfloat16 "
                           "on cuda")
    if dtype == "gguf":
        model, tokenizer = _load_gguf(name)
    else:
        if Path(name).expanduser().suffix == ".gguf":
            raise RagspecError(f"generator dtype {dtype} needs float weights: a .gguf file runs with dtype gguf "
                               "(or auto), or on generator.backend: llama.cpp")
        source = generator_source(name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dt).to(device)
        except RagspecError:
            raise
        except Exception as exc:
            raise hub_error(name, "generator", exc) from exc
    model.eval()
    from ragspec.memory import release_freed
    from ragspec.runtime.prepare import prepare

    prepare(model, device, dtype, options)
    release_freed()  # what reading and packing the weights freed: not part of the model's resident size
    return model, tokenizer


def prepare_gguf(name: str) -> list:
    """What dtype gguf keeps for `name`, made now (else on the first ask): its config and tokenizer, and its blocks
    packed for the kernels (the int8 prompt copy is made from them at each load). The paths."""
    from transformers import AutoConfig

    from ragspec.models.gguf_cache import ensure_meta
    from ragspec.models.gguf_source import gguf_source
    from ragspec.runtime.gguf_blocks import blocks_path, packed_blocks
    from ragspec.runtime.gguf_file import architecture

    source = gguf_source(name)
    architecture(source)
    meta = ensure_meta(source)
    cfg = AutoConfig.from_pretrained(str(meta))
    args = (source, cfg.num_attention_heads, cfg.num_key_value_heads)
    packed_blocks(*args)
    return [meta, blocks_path(*args)]


def _load_gguf(name: str):
    """(model, tokenizer) of dtype gguf: an embedded model's parts or a local .gguf read in place, its config and
    tokenizer from the GGUF's metadata, every linear on the packed blocks (the prompt's weight copy as set, or as
    measured for the model)."""
    from ragspec.models.gguf_cache import ensure_meta
    from ragspec.models.gguf_model import build
    from ragspec.models.gguf_source import gguf_source
    from ragspec.runtime.gguf_file import architecture

    source = gguf_source(name)
    architecture(source)  # one the kernels run, or one clear line before anything is read
    if not _kept(source):
        _prepare_apart(name)
    meta = ensure_meta(source)
    tokenizer = load_tokenizer(name)
    return build(source, meta, prompt_copy(name) or False), tokenizer


def _kept(source) -> bool:
    """Whether dtype gguf's kept files for `source` (its config and tokenizer, its packed blocks) are there and
    current, as `ensure_meta` and `packed_blocks` would find them."""
    from ragspec.models.gguf_cache import meta_dir, meta_ready
    from ragspec.runtime.gguf_blocks import blocks_path

    if not meta_ready(source):
        return False
    try:
        cfg = json.loads((meta_dir(source) / "config.json").read_text())
        return blocks_path(source, cfg["num_attention_heads"], cfg["num_key_value_heads"]).is_file()
    except (OSError, ValueError, KeyError):
        return False


def _prepare_apart(name: str) -> None:
    """`prepare_gguf(name)` in a child process. Why: reading the metadata and packing the blocks leave ~0.1 GB of
    freed Python objects and buffers that the process keeps (the 0.5B's first ask peaked 0.08 GB above a warm
    one); a child's pages go back to the system when it exits, so the first ask holds what a warm one does. Its
    progress lines go to stderr as before; where it fails, the caller does the work in-process, so an error
    reads as it would there."""
    import subprocess
    import sys

    target = str(Path(name).expanduser().resolve()) if Path(name).expanduser().suffix == ".gguf" else name
    code = "import sys; from ragspec.models.generator import prepare_gguf; prepare_gguf(sys.argv[1])"
    try:
        subprocess.run([sys.executable, "-c", code, target], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       check=False)
    except OSError:
        pass


def generator_gguf(name: str):
    """A GGUF as one file: an embedded model's (assembled once, for llama.cpp and the tests), or a local .gguf."""
    embedded = lookup(name, "generator")
    if embedded is not None:
        from ragspec.models.gguf_cache import gguf_path

        return gguf_path(embedded)
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise RagspecError(f"generator dtype gguf needs an embedded model or a local .gguf file, not '{name}'")


def prompt_copy(name: str) -> str | None:
    """The weight copy dtype gguf reads `name`'s prompts with here: RAGSPEC_GGUF_PROMPT's, or unset, the model's
    measured setting (registry `prompt_copy`: the Qwen models' int8), where the CPU runs it."""
    from ragspec.runtime.gguf_linear import prompt_copy_kind

    embedded = lookup(name, "generator")
    return prompt_copy_kind(default=embedded.extra.get("prompt_copy") if embedded is not None else None)


def prompt_copy_key(name: str) -> str:
    """For calibration keys: the prompt copy as the options in effect set it, or unset, the model's own copy
    ("int8") or "0" (the keys of models without one stay as they were)."""
    return current_options().prompt_copy or prompt_copy(name) or "0"


def load_llama_generator(name: str, n_ctx: int = 4096):
    """(LlamaCppModel, tokenizer) for the llama.cpp backend: an embedded model's GGUF (its parts assembled once:
    llama.cpp opens one file), or a local .gguf file; the tokenizer read from the GGUF's metadata once."""
    from ragspec.runtime.llama_cpp_model import LlamaCppModel

    embedded = lookup(name, "generator")
    if embedded is not None:
        from ragspec.models.gguf_cache import gguf_path

        tokenizer = load_tokenizer(name)
        return LlamaCppModel(gguf_path(embedded), n_ctx=n_ctx, name=embedded.name), tokenizer
    path = Path(name).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise RagspecError(f"generator.backend llama.cpp needs an embedded model or a local .gguf file, not '{name}'")
    tokenizer = load_tokenizer(name)
    return LlamaCppModel(path, n_ctx=n_ctx), tokenizer


_shared: dict[tuple[str, str, str, str], tuple] = {}
_shared_lock = threading.Lock()
_model_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_generator(name: str, device: str = "cpu", dtype: str = "float32", backend: str = "transformers",
                     options: RuntimeOptions | None = None):
    """`load_generator` (or `load_llama_generator`), once per process for each (name, device, dtype, backend,
    runtime options): pipelines and LangChain objects that name the same model share one copy of its weights."""
    options = options or current_options()
    key = (name, device, dtype, options.key()) if backend == "transformers" else (name, backend, "", "")
    with _shared_lock:
        if key not in _shared:
            _shared[key] = (load_generator(name, device, dtype, options) if backend == "transformers"
                            else load_llama_generator(name))
        return _shared[key]


def model_lock(model) -> threading.Lock:
    """One lock per model object: generations (and its tokenizer) queue on it, whoever holds the model."""
    with _shared_lock:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.Lock()
        return lock
