"""k3 op family `activations`: its op definitions (op.py), PyTorch reference and kernels."""
