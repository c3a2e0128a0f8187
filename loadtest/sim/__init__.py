"""Internals of the simulated vLLM replica; the public API is ``loadtest.replica``."""
