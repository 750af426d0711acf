"""k3compile.ops: the public functional API over the k3 torch.library ops."""
