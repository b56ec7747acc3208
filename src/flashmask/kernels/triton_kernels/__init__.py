"""The Triton attention kernels: every supported GPU (compute capability >= 8.0) and, through
Triton's interpreter, the CPU (how CI runs them). ``forward`` holds the forward kernel and the
element mask every family shares; ``backward`` the dK/dV, dQ, fused and row-term kernels."""
