"""The k3 ops, one folder each (installed as k3compile.kernels.<op>): op.py (the torch.library op), reference.py,
and the kernels registered per device (triton.py for cuda, c.py + <op>.c for cpu); shared helpers in _common/.

Importing this package registers every `torch.ops.k3.*` operator. Adding an op family: its folder and one
line in OPS.
"""

import importlib

OPS = (
    "activations",
    "attn_res",
    "attn_res_normed",
    "balancing",
    "experts",
    "fused",
    "gla",
    "glu_train",
    "kda",
    "mla",
    "moe",
    "mx",
    "norms",
    "short_conv",
)

for _op in OPS:
    importlib.import_module(f"{__name__}.{_op}.op")
