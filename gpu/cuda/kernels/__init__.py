"""Triton kernels, each beside the small Python wrapper that checks its inputs before launch.

They run compiled on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (how the tests run them).
"""
