"""gpu/: everything that touches tensors, on any device.

The device-neutral part is here: the model runner (a scheduled step into tensors, one forward,
the sampler), model loading and assembly, the models, the attention interface, the KV cache,
and the backend interface the models are built on (backend.py). cpu/ is weir's compiled CPU
kernels and the CPU backend over them; cuda/ the Triton kernels, their attention backend and
CUDA graphs; dist/ tensor parallelism. Importing gpu/ changes nothing in the process.
"""
