"""k3 op family `kda`: its op definitions (op.py), PyTorch reference and kernels."""
