"""Privacy primitives: per-example gradients and clipping, and Gaussian noise."""
