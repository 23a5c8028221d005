"""GPU kernels hostswap's operators run where the library kernels are slower for its shapes."""
