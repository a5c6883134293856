"""Scheduler: waiting queue, continuous batching, KV-slot accounting, adapter admission."""
