"""Question → retrieved sources → prompt → draft-and-verify answer with citations of copied spans."""

from ragspec.pipeline.answer import Answer, AnswerStats, CitationEvent, DoneEvent, SourcesEvent, TextEvent
from ragspec.pipeline.attribution import Citation, CopyMatcher
from ragspec.pipeline.declined import DECLINED, is_declined
from ragspec.pipeline.pipeline import Pipeline
from ragspec.pipeline.prompt import BuiltPrompt, PromptBuilder, SourceText

__all__ = [
           "DECLINED",
           "Answer",
           "AnswerStats",
           "BuiltPrompt",
           "Citation",
           "CitationEvent",
           "CopyMatcher",
           "DoneEvent",
           "Pipeline",
           "PromptBuilder",
           "SourceText",
           "SourcesEvent",
           "TextEvent",
           "is_declined",
]
