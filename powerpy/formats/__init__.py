"""File formats: GGUF/PWRI reader and writer, ggml block quantization, .gpuidx and activation
statistics files, and the constants they share. Lowest layer: of powerpy it imports only the
stdlib-only helpers of ``powerpy._fs``."""
