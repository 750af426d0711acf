"""k3 op family `attn_res_normed`: its op definitions (op.py), PyTorch reference and kernels."""
