"""k3 op family `mx`: its op definitions (op.py), PyTorch reference and kernels."""
