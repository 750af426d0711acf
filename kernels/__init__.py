"""Op implementations: PyTorch references and Triton kernels (installed as k3compile.kernels)."""
