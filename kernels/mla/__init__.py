"""k3 op family `mla`: its op definitions (op.py), PyTorch reference and kernels."""
