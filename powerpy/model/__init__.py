"""The LLaMA-family model: weights and matrices, native kernels, the predictor-gated sparse FFN,
the KV cache and the forward pass."""
