"""Everything that touches tensors: models, weight loading, KV cache, attention, sampling."""

import os

# On CPU weir's own kernels run a step's heavy work on their own thread pool
# (gpu/cpu/csrc/pool.h); torch's OpenMP team runs only the few small torch ops left around it,
# and by default its threads spin for a while after each, taking the core the pool's workers
# need next (6-layer Llama, 64 rows on 2 cores: a decode step 25-27 ms spinning, 21-23.5 ms
# passive). libgomp reads this when torch loads it, so it is set before gpu/ imports torch; an
# explicit setting wins, and the oneDNN path (WEIR_CPU_MATMUL=onednn) keeps libgomp's default.
# Child processes inherit it: OMP_WAIT_POLICY_SET says it was weir's doing (benchmarks/ take it
# out again for the peers they start).
OMP_WAIT_POLICY_SET = False
if os.environ.get("WEIR_CPU_MATMUL", "weir") != "onednn" and "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    OMP_WAIT_POLICY_SET = True
