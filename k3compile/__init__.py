"""k3compile: YAML specs of Kimi-K3-class models, analysed, lowered and emitted as PyTorch modules."""

__version__ = "0.1.0"


def load(path):
    """Import an emitted package (see k3compile.loader.load)."""
    from k3compile.loader import load as _load

    return _load(path)


def train(spec_or_build, steps, data=None, out=None, resume=False, overrides=(), eval_every=None, progress=True,
          stop_after=None, extends_anywhere=False):
    """Train a spec's or a build's Model; returns the metrics records (see k3compile.runtime.train.train)."""
    from k3compile.runtime.train import train as _train

    return _train(spec_or_build, steps, data, out, resume, overrides, eval_every, progress, stop_after,
                  extends_anywhere)
