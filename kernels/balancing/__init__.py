"""k3 op family `balancing`: its op definitions (op.py), PyTorch reference and kernels."""
