"""Hybrid placement (docs/architecture.md#hybrid-placement): VRAM budget arithmetic, GPU-index
generation and reuse, the placement as plain data, and the runtime that applies it to a model."""
