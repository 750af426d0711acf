"""k3 op family `gla`: its op definitions (op.py), PyTorch reference and kernels."""
