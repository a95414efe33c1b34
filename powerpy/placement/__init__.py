"""Hybrid placement (spec §8-§10): VRAM budget arithmetic, GPU-index generation and reuse, the
placement as plain data, and the runtime that applies it to a model."""
