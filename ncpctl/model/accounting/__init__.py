"""Exact counts: FLOPs (forward, backward), memory, parameters."""
