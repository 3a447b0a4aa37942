"""One entry from loaded weights to a model ready for the backends: `prepare(model, device, dtype, options)`.

Why here: the runtime decides how a model runs on this machine (linears packed for oneDNN, int8, or on the GGUF's
blocks with their fused MLPs and norms; exact attention; the step loop), and records it once in the model's
`ModelRuntime`. The loaders (`models/generator.py`) only read weights: from a float folder, or, for dtype gguf,
a model built from the GGUF alone (`models/gguf_model.py`, which puts its linears on the blocks as it builds).
"""

from __future__ import annotations

import logging

from ragspec.runtime.model_runtime import ModelRuntime, attach
from ragspec.runtime.options import RuntimeOptions, current_options

log = logging.getLogger(__name__)

QUANTIZED = ("int8", "gguf", "bfloat16", "float16")  # dtypes whose rounding needs exact attention (see there)


def prepare(model, device: str, dtype: str, options: RuntimeOptions | None = None) -> ModelRuntime:
    """Make a loaded model (eval mode, on `device`) run as `dtype` says on this machine; returns its runtime."""
    options = options or current_options()
    rt = attach(model, options)
    if device == "cpu" and dtype == "bfloat16":
        from ragspec.cpu_flags import native_bf16

        if not native_bf16():
            log.warning("generator dtype bfloat16: this CPU has no native bf16 (AVX512_BF16/AMX), so it runs "
                        "emulated, slower than float32")
    if dtype == "int8":
        from ragspec.runtime.int8_linear import quantize_linears

        quantize_linears(model)  # every linear but lm_head, which pack_linears packs in float32
    if dtype == "gguf":
        from ragspec.runtime.fused_layers import fuse_layers
        from ragspec.runtime.gguf_kernel import load_kernels
        from ragspec.runtime.gguf_linear import kernels_key

        load_kernels().amx(1 if options.amx else 0)  # the kernels' AMX switch (one per process)
        fuse_layers(model)  # MLPs and RMSNorms: one kernel call each
        rt.kernels = kernels_key(model)  # in the t(n) cost key, as the linears now run
    from ragspec.runtime.cpu_linear import pack_linears

    pack_linears(model)  # CPU only; a no-op elsewhere
    if device == "cpu" and dtype in QUANTIZED and options.exact_attention:
        from ragspec.runtime.exact_attention import use_exact_attention

        # rounding amplifies attention's batch-dependent ulps (see the module); gguf with its bf16 prompt copy
        # (opt-in) reads long prompt chunks with PyTorch's attention, as it reads them with that copy
        use_exact_attention(model, prompt_rows=_gguf_prompt_rows() if dtype == "gguf" else None,
                            native=dtype == "gguf")
        if dtype == "gguf":
            from ragspec.runtime.step_forward import install

            if install(model):  # draft steps in one loop over the layers' kernels: the same bits, less around them
                rt.kernels += "-step"
    elif device == "cpu":
        from ragspec.runtime.tree_attention import use_tree_attention

        use_tree_attention(model)  # tree steps read grouped key/value heads in place: see the module
    from ragspec.runtime.cache_only import install as install_cache_only

    install_cache_only(model)  # prompt chunks read for the cache skip the last layer's o_proj and MLP
    return rt


def after_measuring(model) -> None:
    """What a load leaves for after a new machine's one-time t(n) measurement: the int8 prompt copies, made now
    (that measurement runs steps alone, and its 256-row logits would otherwise sit beside the copies: the 0.5B's
    first ask peaked 0.1 GB higher), and the heap the load freed (packing, the metadata) given back."""
    from ragspec.memory import release_freed
    from ragspec.runtime.model_runtime import runtime_of

    rt = runtime_of(model)
    if rt is not None and rt.prompt_copy is not None:
        from ragspec.runtime.gguf_linear import make_prompt_copies

        make_prompt_copies(model)
    release_freed()


def _gguf_prompt_rows() -> int | None:
    """With the opt-in bf16 prompt copy, forwards of more rows than it takes run PyTorch's attention."""
    from ragspec.runtime.gguf_linear import PROMPT_ROWS, prompt_copy_available

    return PROMPT_ROWS if prompt_copy_available() else None
