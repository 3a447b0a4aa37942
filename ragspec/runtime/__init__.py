"""The CPU runtime: what turns a GGUF into a model that steps fast and bit-exactly.

The GGUF read in place (`gguf_file`), its blocks packed for the kernels (`gguf_formats`, `gguf_blocks`), the
linears on them (`gguf_linear`, `int8_linear`, `cpu_linear`, `fused_layers`), attention (`exact_attention`,
`tree_attention`, `prompt_mode`), the step loop and its KV layers (`step_forward`, `growing_cache`), the C++
kernels and their build (`gguf_kernel` and the `.cpp` files beside it), and llama.cpp's model (`llama_cpp_model`).
Below the decoding layer: nothing here imports `decoding/`, `models/` or anything above them.
"""
