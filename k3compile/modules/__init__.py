"""nn.Module building blocks over k3 ops; parameter names match the spec weight inventory."""
