"""Pipeline specs (`pipelines/*.yaml`): pydantic-validated; an unknown key is an error naming that key.

Sections: index (how to build), retriever (what to search), prompt, generator, drafting, attribution, serve.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import Field, ValidationError

from ragspec.errors import RagspecError
from ragspec.settings import (
    AttributionSettings,
    DraftingSettings,
    GeneratorSettings,
    IndexSettings,
    PromptSettings,
    RetrieverSettings,
    ServeSettings,
    Strict,
)


class PipelineSpec(Strict):
    name: str = Field("default", description="a label for logs and stats")
    index: IndexSettings = Field(default_factory=IndexSettings)
    retriever: RetrieverSettings = Field(default_factory=RetrieverSettings)
    prompt: PromptSettings = Field(default_factory=PromptSettings)
    generator: GeneratorSettings = Field(default_factory=GeneratorSettings)
    drafting: DraftingSettings = Field(default_factory=DraftingSettings)
    attribution: AttributionSettings = Field(default_factory=AttributionSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)


def describe_error(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
    if err["type"] == "extra_forbidden":
        return f"{source}: unknown key '{loc}'"
    return f"{source}: {loc}: {err['msg']}"


def load_spec(source: str | Path | dict | PipelineSpec | None = None) -> PipelineSpec:
    """A spec from a YAML path, or a dict (None: all defaults); errors name the offending key."""
    if isinstance(source, PipelineSpec):
        return source
    if source is None:
        return PipelineSpec()
    if isinstance(source, dict):
        data, label = source, "pipeline spec"
    else:
        path = Path(source)
        label = str(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except FileNotFoundError:
            raise RagspecError(f"pipeline spec {path} does not exist") from None
        except yaml.YAMLError as exc:
            raise RagspecError(f"{path} is not valid YAML ({str(exc).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise RagspecError(f"{path}: the top level must be a mapping of sections (index, retriever, prompt, generator, …)")
    try:
        return PipelineSpec.model_validate(data)
    except ValidationError as exc:
        raise RagspecError(describe_error(exc, label)) from None
