"""k3 op family `attn_res`: its op definitions (op.py), PyTorch reference and kernels."""
