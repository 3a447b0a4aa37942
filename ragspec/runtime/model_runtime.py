"""What the runtime made of a loaded model, held as one object (`model.ragspec_runtime`, shared by the modules
that get a `config`, so an attention function reaches it from the module it is given).

Why one object: the backends, the attention functions and the cost keys read how a model runs (its GGUF linears,
the prompt's weight copy, which attention kernel, whether the step loop is on); spread as attributes over the
model and its configs, no reader could tell which exist. `prepare.prepare` fills it; a model it never saw has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragspec.runtime.options import RuntimeOptions, current_options

ATTRIBUTE = "ragspec_runtime"


@dataclass
class ModelRuntime:
    options: RuntimeOptions
    gguf: dict[str, str] = field(default_factory=dict)  # linear → its GGUF type (dtype gguf)
    prompt_copy: str | None = None  # "int8": the prompt's positions read the int8 weight copy
    prompt_role: bool = False  # the backends mark forwards that read prompt positions (`prompt_mode`)
    kernels: str = ""  # the t(n) cost key's kernels part (dtype gguf)
    step_forward: bool = False  # steps run `step_forward`'s loop over the layers' kernels
    packed_linears: int = 0  # linears packed for oneDNN
    int8: str | None = None  # dtype int8: its kernel (`int_mm`, `fp32`), "" when no linear was quantised
    exact_attention: bool = False  # `exact_attention.use_exact_attention` switched the model over
    prompt_rows: int | None = None  # with exact attention: forwards of more rows run PyTorch's SDPA (bf16 copy)
    native_attention: bool = False  # float32 attention in `attention_kernel.cpp`
    prompt_attention: bool = False  # the rows of prompt forwards in `prompt_attention.cpp`


def runtime_of(obj) -> ModelRuntime | None:
    """The runtime of a model or of one of its modules, or None (a model `prepare` never saw)."""
    return vars(obj).get(ATTRIBUTE) if hasattr(obj, "__dict__") else None


def options_of(model) -> RuntimeOptions:
    """The options a model was prepared under, or those in effect for a model `prepare` never saw."""
    rt = runtime_of(model)
    return rt.options if rt is not None else current_options()


def attach(model, options: RuntimeOptions | None = None) -> ModelRuntime:
    """The model's runtime, made and attached (to the model and every module with a `config`) if it has none."""
    rt = runtime_of(model)
    if rt is None:
        rt = ModelRuntime(options or current_options())
        for m in [model, *(m for m in model.modules() if hasattr(m, "config"))]:
            vars(m)[ATTRIBUTE] = rt  # a plain attribute: nn.Module's __getattr__ is never reached
    elif options is not None:
        rt.options = options
    return rt
