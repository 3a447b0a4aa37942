"""Evaluation: retrieval metrics now; attribution and decoding later."""
