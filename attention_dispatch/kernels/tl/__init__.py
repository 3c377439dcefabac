"""The tl (triton.language) kernels: every feature, every CUDA GPU from sm80 and the CPU interpreter."""
