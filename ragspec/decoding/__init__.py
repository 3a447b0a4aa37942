"""Speculative decoding: drafters propose token trees, a backend (transformers or llama.cpp) verifies each tree
in one forward, the budget sizes them. It works on a loaded model; loading one is `ragspec.models`' job."""
