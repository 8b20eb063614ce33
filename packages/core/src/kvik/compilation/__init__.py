"""Compiling the model: torch.compile split at attention (kvik.compilation.piecewise)."""
