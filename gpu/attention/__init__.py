"""Attention backends over the paged KV cache, behind one small interface (see backend.py)."""
