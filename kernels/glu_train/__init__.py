"""k3 op family `glu_train`: its op definitions (op.py), PyTorch reference and kernels."""
