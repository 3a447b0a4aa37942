"""dtype gguf's model built from the GGUF alone: a skeleton on the meta device, filled from the file's tensors.

Why: going through a de-quantized float32 copy cost the 1.5B a 6.7 GB folder on disk and a 9.1 GB peak in memory
for weights that dtype gguf then throws away. Here no float32 weight exists at any time: each linear is a
`GGUFLinear` on the packed blocks (`gguf_blocks.py`), the token table stays in its blocks (`GGUFEmbedding`:
a row is de-quantized when it is looked up), and the norms and biases are read as they are stored (float32).
The numbers are the ones transformers' GGUF loader gives (the same `gguf` de-quantization), so every output of
the old path is unchanged.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ragspec.errors import RagspecError
from ragspec.runtime.gguf_file import GGUFSource

# GGUF names of the tensors that are not linears → the module path of a Llama / Qwen2 model in transformers
_LAYER_TENSORS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                  "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                  "attn_v.bias": "self_attn.v_proj.bias"}
_IGNORED = ("rope_freqs.weight",)  # llama.cpp's copy of the rotary frequencies: transformers makes them from config


class GGUFEmbedding(nn.Module):
    """`nn.Embedding` (inference only) on the token table's GGUF blocks, read in place from the mapped file: a
    looked-up row is de-quantized then, with the same arithmetic as a whole-table de-quantization (so the same
    float32 bits). The 1.5B's table is 0.25 GB of blocks in the file, 0.93 GB as float32."""

    def __init__(self, table):
        super().__init__()
        from gguf import GGMLQuantizationType

        self.table = table  # a gguf_blocks.Tensor: rows read from the mapped GGUF when looked up
        self.qtype = GGMLQuantizationType[table.type_name]
        self.embedding_dim, self.num_embeddings = table.shape[:2]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import dequantize

        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range for a {self.num_embeddings}-token table")
        out = dequantize(self.table.rows(flat), self.qtype).astype(np.float32, copy=False)
        return torch.from_numpy(out.reshape(*ids.shape, self.embedding_dim)).to(ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} rows de-quantized when looked up"


def build(source: GGUFSource, meta_folder, prompt_copy: bool | str | None) -> nn.Module:
    """The model of `source` in eval mode on CPU, every linear a `GGUFLinear` (with `prompt_copy` as
    `gguf_linear.quantize_from_gguf` takes it), the rest read from the GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragspec.runtime.cpu_linear import replace_module
    from ragspec.runtime.gguf_blocks import read_tensors
    from ragspec.runtime.gguf_formats import _unpermute_rows, hf_module_name
    from ragspec.runtime.gguf_linear import quantize_from_gguf

    config = AutoConfig.from_pretrained(str(meta_folder))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    arch, tensors = read_tensors(source)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, t in tensors.items():
        if hf_module_name(name) is not None or name in _IGNORED:
            continue  # a linear: its blocks come packed (quantize_from_gguf)
        if name == "token_embd.weight":
            replace_module(model, "model.embed_tokens", GGUFEmbedding(t))
            continue
        parts = name.split(".")
        if name == "output_norm.weight":
            target = "model.norm.weight"
        elif parts[0] == "blk" and ".".join(parts[2:]) in _LAYER_TENSORS:
            target = f"model.layers.{parts[1]}.{_LAYER_TENSORS['.'.join(parts[2:])]}"
        else:
            raise RagspecError(f"{source.label}: tensor '{name}' is not one a {arch} model has here")
        value = _dequantized(t)
        if arch == "llama" and name.endswith(".bias") and parts[2] in heads:  # rows in llama.cpp's rotary order
            value = value[torch.from_numpy(_unpermute_rows(value.shape[0], heads[parts[2]]))]
        _set(model, target, value, source)
    _rotary_on_cpu(model)
    quantize_from_gguf(model, source, prompt_copy=prompt_copy)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise RagspecError(f"{source.label}: the GGUF has no tensor for {', '.join(left[:4])}"
                           f"{' …' if len(left) > 4 else ''}")
    model.name_or_path = meta_folder.name.replace(".meta-", "-")  # names the weights in the source KV's key
    return model


def _dequantized(t) -> torch.Tensor:
    from gguf import GGMLQuantizationType, dequantize

    values = dequantize(np.asarray(t.data), GGMLQuantizationType[t.type_name]).astype(np.float32, copy=False)
    return torch.from_numpy(values.reshape(tuple(reversed(t.shape))).copy())


def _set(model: nn.Module, target: str, value: torch.Tensor, source: GGUFSource) -> None:
    owner, _, leaf = target.rpartition(".")
    module = model.get_submodule(owner)
    old = getattr(module, leaf, None)
    if old is None or tuple(old.shape) != tuple(value.shape):
        raise RagspecError(f"{source.label}: {target} is {tuple(value.shape)} in the GGUF, "
                           f"{None if old is None else tuple(old.shape)} in its config's model")
    module._parameters[leaf] = nn.Parameter(value, requires_grad=False)


def _rotary_on_cpu(model: nn.Module) -> None:
    """Rotary modules made again on CPU: their frequencies are buffers computed from the config, not weights."""
    from ragspec.runtime.cpu_linear import replace_module

    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq") and module.inv_freq.is_meta:
            replace_module(model, name, type(module)(config=module.config))
