"""Plan: which padded shapes are worth building.

findings (the hardware rules a shape breaks), propose (candidate paddings), probe (the GEMM
probe that ranks them in seconds), advise (non-exact reshapes a retrain would buy)."""
