"""INT4 weights: GPTQ's layout turned into the kernels', the INT4 linear and experts modules, the MoE backends."""
