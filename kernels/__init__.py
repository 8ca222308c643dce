"""Fused LM-head ops over the vocabulary: per-token log-probability, entropy and exact KL, without
materialising (tokens, vocab) logits. Triton kernels on CUDA, a chunked plain-torch path elsewhere;
each op sits beside its naive reference. Benchmark: python -m kernels [--device cuda]; what the compiler
makes of the kernels for an H100, without one: python -m kernels --target sm_90 (aot.py)"""

from kernels.kl import linear_kl, linear_kl_reference
from kernels.logprob_entropy import linear_logprob_entropy, linear_logprob_entropy_reference
from kernels.utils import TileConfig

__all__ = [
    "linear_logprob_entropy",
    "linear_logprob_entropy_reference",
    "linear_kl",
    "linear_kl_reference",
    "TileConfig",
]
