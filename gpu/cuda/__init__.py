"""The CUDA layer: the backend a model runs on (backend.py), the Triton kernels (kernels/, with
their ahead-of-time compile check), the Triton attention backend (attention.py) and decode steps
replayed as CUDA graphs (graphs.py).
The kernels also run on CPU tensors under TRITON_INTERPRET=1, which is how the tests run them."""
