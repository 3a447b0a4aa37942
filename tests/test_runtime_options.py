"""The runtime's options come from the spec (`generator.runtime`), an environment variable overrides one, and
`runtime/options.py` is the one place that reads those variables (the C++ kernels included: their AMX switch is
set by `runtime.prepare`). A pipeline's model is loaded and prepared under its spec's options and keeps them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ragspec.errors import RagspecError
from ragspec.models.registry import installed
from ragspec.runtime.options import RuntimeOptions, current_options, options_in_effect, runtime_options
from ragspec.spec import load_spec

SMOL = "smollm2-135m-instruct"
VARIABLES = ("RAGSPEC_GGUF_PROMPT", "RAGSPEC_GGUF_Q8K", "RAGSPEC_GGUF_AMX", "RAGSPEC_INT8_KERNEL",
             "RAGSPEC_STEP_FORWARD", "RAGSPEC_PACKED_LINEAR", "RAGSPEC_EXACT_ATTENTION", "RAGSPEC_STATIC_VERIFIER",
             "RAGSPEC_CUDA_GRAPHS")


@pytest.fixture
def clean_env(monkeypatch):
    for var in VARIABLES:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_spec_values_become_options_and_a_set_variable_wins(clean_env):
    spec = load_spec({"generator": {"runtime": {"prompt_copy": "off", "q8k": "on", "amx": False,
                                                "int8_kernel": "fp32", "static_verifier": "on"}}})
    opts = runtime_options(spec.generator.runtime.model_dump())
    assert opts == RuntimeOptions(prompt_copy="0", q8k=True, amx=False, int8_kernel="fp32", static_verifier="on")
    assert runtime_options(load_spec({}).generator.runtime.model_dump()) == RuntimeOptions() == runtime_options()
    clean_env.setenv("RAGSPEC_GGUF_PROMPT", "INT8")
    clean_env.setenv("RAGSPEC_GGUF_AMX", "1")
    clean_env.setenv("RAGSPEC_STEP_FORWARD", "0")
    over = runtime_options(spec.generator.runtime.model_dump())
    assert (over.prompt_copy, over.amx, over.step_forward, over.q8k) == ("int8", True, False, True)
    assert over.key() != opts.key()


def test_options_in_effect_are_what_the_runtime_reads_meanwhile(clean_env):
    mine = RuntimeOptions(step_forward=False, prompt_copy="0")
    with options_in_effect(mine):
        assert current_options() is mine
    assert current_options() == RuntimeOptions()


def test_a_bad_spec_value_is_one_clear_line():
    with pytest.raises(RagspecError, match="prompt_copy"):
        load_spec({"generator": {"runtime": {"prompt_copy": "int4"}}})
    with pytest.raises(RagspecError, match="runtime"):
        load_spec({"generator": {"runtime": {"no_such_option": True}}})


def test_only_the_options_module_reads_the_runtime_variables():
    root = Path(__file__).resolve().parents[1] / "ragspec"
    names = "|".join(VARIABLES)
    read = re.compile(rf"""(environ\.get\(|environ\[|getenv\()\s*["']({names})["']""")
    readers = [str(p.relative_to(root)) for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h")
               and read.search(p.read_text())]
    assert readers == []  # options.py reads them by name from its own table
    table = (root / "runtime" / "options.py").read_text()
    assert all(f'"{var}"' in table for var in VARIABLES) and "os.environ.get(var)" in table


@pytest.mark.skipif(not installed(SMOL), reason="SmolLM2's weight package is not installed")
def test_a_pipelines_model_is_prepared_under_its_specs_options(clean_env):
    from ragspec.models.generator import shared_generator
    from ragspec.pipeline import Pipeline
    from ragspec.runtime.int8_linear import int8_kernel
    from ragspec.runtime.model_runtime import runtime_of

    copy = "int8" if int8_kernel() == "int_mm" else None  # without int8 units prompts keep the integer kernel

    def loaded(runtime: dict):
        pipe = Pipeline({"generator": {"model": SMOL, "dtype": "gguf", "backend": "transformers",
                                       "runtime": runtime}, "drafting": {"budget": 8}})
        return pipe, runtime_of(pipe.load().model)

    pipe, rt = loaded({"prompt_copy": "int8", "step_forward": False})
    assert rt.options == pipe.runtime_options and rt.prompt_copy == copy and not rt.step_forward
    _, plain = loaded({})
    assert plain.prompt_copy is None and plain.step_forward  # another model: the shared ones are keyed by options
    assert shared_generator(SMOL, "cpu", "gguf", options=pipe.runtime_options)[0] is pipe.model
    clean_env.setenv("RAGSPEC_GGUF_PROMPT", "0")  # the variable overrides the spec
    _, over = loaded({"prompt_copy": "int8", "step_forward": False})
    assert over.prompt_copy is None and not over.step_forward
