"""The IR: lowering a Spec to a torch.fx graph over k3 ops, verification, the pass manager."""
