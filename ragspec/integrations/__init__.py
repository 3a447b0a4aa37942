"""Adapters to other frameworks (LangChain)."""
