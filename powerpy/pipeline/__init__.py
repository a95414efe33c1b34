"""The sparsification pipeline: corpus, profile, predictor training, convert, perplexity."""
