"""The tower stage (MODEL.md §5-§6, API.md §3.5): backbone hidden rows in, frames out.

    sampling.py   the batched sampler, its counter-based noise, RAS and the repetition penalty
    model.py      the codebook-MTP decoder: trunk, residual layers, fusion, heads, KV pool
    kernels.py    GPU fast paths: Triton decode attention (split-K over the pool) and fused draw
    graphs.py     CUDA graphs of the decode step: batch buckets, one staging buffer, one copy back
    naive.py      float64 from-scratch reference of one timeline (for tests)
    weights.py    strict loader (semantic head rows from the LM head) and random weights
    engine.py     session slots and one batched call per Step message
    server.py     the gRPC Tower service; __main__.py its entry point
"""
