"""The CPU layer: weir's own compiled kernels and what runs on them.

csrc/ holds the C++ sources (one header, weir.h, declares them); build.py compiles them once per
source, compiler and CPU into a library of torch operators (torch.ops.weir); the Python side of
each kernel sits beside it here: the packed products (gemm.py, and oneDNN's in onednn.py), the
norms and rotary embedding (norm.py), the paged attention backend (attention.py), the argmax and
grammar bitmask (sample.py) and the whole layer stack in one call (forward.py).
"""
