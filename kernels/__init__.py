"""Fused LM-head ops over the vocabulary: per-token log-probability, entropy and exact KL, without
materialising (tokens, vocab) logits. Triton kernels on CUDA, a chunked plain-torch path elsewhere;
each op sits beside its naive reference. Benchmark: python -m kernels [--device cuda]; what the compiler
makes of the kernels for an H100, without one: python -m kernels --target sm_90 (aot.py)

KERNELS_EMULATE_CUDA=1 (set before the import; or kernels.utils.EMULATE_CUDA = True) gives CPU tensors the
casts of the CUDA paths: both backends' backward rounds dz (the gradient w.r.t. the logits) to the half
input dtype before the dh and dW GEMMs, as on CUDA, where the CPU otherwise keeps it in float32. With
TRITON_INTERPRET=1 and backend="triton" a CPU run then computes what the CUDA kernels compute, up to the
order of float32 additions (GEMM blocking, the forward's split count)."""

from kernels.kl import linear_kl, linear_kl_reference, linear_logprob_entropy_kl
from kernels.logprob_entropy import linear_logprob_entropy, linear_logprob_entropy_reference
from kernels.utils import TileConfig

__all__ = [
    "linear_logprob_entropy",
    "linear_logprob_entropy_reference",
    "linear_kl",
    "linear_kl_reference",
    "linear_logprob_entropy_kl",
    "TileConfig",
]
