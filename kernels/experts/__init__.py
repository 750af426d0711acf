"""k3 op family `experts`: its op definitions (op.py), PyTorch reference and kernels."""
