"""One op per module: pure-JAX reference, CUDA custom call, and dispatcher."""
