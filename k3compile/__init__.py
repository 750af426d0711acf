"""k3compile: YAML specs of Kimi-K3-class models, analysed, lowered and emitted as PyTorch modules."""

__version__ = "0.1.0"


def load(path):
    """Import an emitted package (see k3compile.loader.load)."""
    from k3compile.loader import load as _load

    return _load(path)
