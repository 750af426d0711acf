"""k3 op family `norms`: its op definitions (op.py), PyTorch reference and kernels."""
