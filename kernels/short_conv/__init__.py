"""k3 op family `short_conv`: its op definitions (op.py), PyTorch reference and kernels."""
