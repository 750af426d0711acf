"""k3compile: YAML specs of Kimi-K3-class models, analysed, lowered and emitted as PyTorch modules."""

__version__ = "0.1.0"
