"""cdlm-serve: an OpenAI-compatible server for CDLM block-wise diffusion decoding and Attention
Matching KV compaction. One package, its subsystems inside: `server` (HTTP, schemas, metrics),
`engine` (scheduling, decoding, compaction, sessions), `models` (native models, loading,
kernels), `train` (CDLM post-training) and `bench` (benchmarks)."""
