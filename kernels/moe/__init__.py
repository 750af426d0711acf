"""k3 op family `moe`: its op definitions (op.py), PyTorch reference and kernels."""
