"""Graph rewrites and fusion: Relax passes from the imported graph to fused TIR kernels."""
