"""k3 op family `fused`: its op definitions (op.py), PyTorch reference and kernels."""
