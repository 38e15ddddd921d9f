"""Everything that touches tensors: models, weight loading, KV cache, attention, sampling."""
