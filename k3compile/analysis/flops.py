"""Forward FLOPs per token at a given context, from the spec alone.

For one token that sees `context` tokens (a decode step at that position, or
the last token of a prefill of that length):

- matmuls: 2 x (active matmul parameters), the output head included and the
  input embedding (a lookup) excluded; routed experts count top-k of n;
- Gated MLA: scores 2 H (d_nope + d_rope) N plus values 2 H d_v N per layer
  (expanded form; the absorbed decode form moves, not removes, these);
- KDA, chunked form with chunk C: H (6 dk^2 + 3 C dk + C^2) per layer and token
  (intra-chunk UT transform, inter-chunk state read and update);
- without the delta rule (gated linear attention, chunk C' = 16): H (4 dk^2 + 4 C' dk) per layer and
  token (decayed intra-chunk scores and their values, inter-chunk state read and update);
- short convolution: 2 W (3 H dk) per KDA layer;
- attention residuals: 4 S d per application (a dot product and a weighted sum
  over S sources; the norm is elementwise and not counted).
Elementwise work (norms, gates, activations, softmax) is not counted.
"""

from __future__ import annotations

from k3compile.analysis.params import active_numel
from k3compile.analysis.sources import attn_res_source_counts
from k3compile.spec.schema import MIXER_KDA, MIXER_MLA, Spec
from k3compile.spec.weights import weight_inventory

KDA_CHUNK = 64
GLA_CHUNK = 16  # kernels.gla.CHUNK


def forward_flops_per_token(spec: Spec, context: int) -> dict:
    """FLOPs of one token's forward pass at `context`, by term, with the total under 'forward'."""
    matmul = 2 * sum(active_numel(w) for w in weight_inventory(spec) if w.matmul)
    n_kda = spec.mixers.count(MIXER_KDA)
    n_mla = spec.mixers.count(MIXER_MLA)
    attention = 0
    if n_mla:
        m = spec.mla
        attention = n_mla * 2 * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * context
    kda = conv = 0
    if n_kda:
        H, K = spec.kda.num_heads, spec.kda.head_dim
        if spec.kda.delta_rule:
            C = KDA_CHUNK
            kda = n_kda * H * (6 * K * K + 3 * C * K + C * C)
        else:
            C = GLA_CHUNK
            kda = n_kda * H * (4 * K * K + 4 * C * K)
        conv = n_kda * 2 * spec.kda.short_conv_size * 3 * H * K
    attn_res = 4 * spec.hidden_size * sum(attn_res_source_counts(spec))
    return {
        "forward": matmul + attention + kda + conv + attn_res,
        "matmul": matmul,
        "attention": attention,
        "kda": kda,
        "short_conv": conv,
        "attn_res": attn_res,
        "context": context,
    }
