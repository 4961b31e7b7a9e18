"""Triton kernels that fuse a GPU step's small operations: add + RMSNorm, rotary with the
paged KV write, SiLU-mul, and paged attention that reads the block table in place.

Each module holds its kernel and the torch reference the tests compare it with on CPU
(TRITON_INTERPRET=1). `specdec.models.llama` uses them where `FusedOps` says so.
"""
