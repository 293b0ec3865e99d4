"""The HTTP server (`cdlm-serve`): app, routes, schemas, metrics.

One setting of the process goes here because it must come before torch is imported: MKL, which
torch links in statically for its float32 GEMMs on CPU, keeps each GEMM's packing buffers in its
own memory manager and never gives them back (heaptrack on a float32 server after 3 minutes of
the soak's mix: 23 MB held in `mm_internal_malloc`, most of it `sgemm_getbufs`; issue 59).
MKL reads MKL_DISABLE_FAST_MM when torch loads it, and then frees each buffer as it is done; the
heap trimmer gives the pages back. An empty value keeps MKL's cache (`MKL_DISABLE_FAST_MM=`).
"""

import os

os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
