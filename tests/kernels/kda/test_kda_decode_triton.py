"""Triton KDA decode step against the PyTorch references: one step, several steps of a sequence, bf16."""

import pytest
import torch
import torch.nn.functional as F

from k3compile.kernels.kda import decode_triton as kdt
from k3compile.kernels.kda.reference import kda_decode_step_ref, kda_recurrent_ref
from k3compile.kernels._common.launch import launch_config
from k3compile.kernels._common.compare import rel_rms as _rel_rms


@pytest.fixture
def block_v(monkeypatch):
    """force(n): launch the kernel with BLOCK_V = n instead of its default."""

    def force(n):
        def patched(name, dev, defaults, **sizes):
            return {**launch_config(name, dev, defaults, **sizes), "BLOCK_V": n}

        monkeypatch.setattr(kdt, "launch_config", patched)

    return force


def _inputs(B, T, H, K, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)  # as the layer feeds it: L2-normed keys
    v = torch.randn(B, T, H, V, generator=g)
    gate = F.logsigmoid(torch.randn(B, T, H, K, generator=g) + 2.0)  # log decays in (-inf, 0)
    beta = torch.rand(B, T, H, generator=g)
    state = torch.randn(B, H, K, V, generator=g)
    return *(t.to(dtype) for t in (q, k, v, gate, beta)), state


@pytest.mark.parametrize("bv", [16, 32])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_step_matches_reference_ragged_k_v(block_v, bv, scale):
    block_v(bv)  # V = 20: two ragged blocks of 16, or one of 32; K = 24 pads to 32
    q, k, v, g, beta, state = _inputs(2, 1, 3, 24, 20)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    old = state.clone()
    o, s_new = kdt.kda_decode_step(*args, scale)
    o_ref, s_ref = kda_decode_step_ref(*args, scale)
    assert o.shape == (2, 3, 20) and o.dtype == torch.float32 and o.is_contiguous()
    assert s_new.shape == (2, 3, 24, 20) and s_new.dtype == torch.float32
    assert _rel_rms(o, o_ref) < 1e-6 and _rel_rms(s_new, s_ref) < 1e-6
    assert torch.equal(state, old) and s_new.data_ptr() != state.data_ptr()


def test_decay_is_applied_before_the_delta_correction(block_v):
    # Hand case, K = V = 1: S = 2, g = log(0.5), k = 1, beta = 1, v = 3 -> decayed S = 1,
    # residual = 3 - 1 = 2, S = 1 + 2 = 3, o = scale * 3 * q = 0.5 * 3 * 2 = 3. (Undecayed S^T k would give 2.5.)
    block_v(16)
    one = torch.ones(1, 1, 1)
    o, s = kdt.kda_decode_step(2 * one, one, 3 * one, torch.log(0.5 * one), torch.ones(1, 1), 2 * one[..., None], 0.5)
    assert o.item() == pytest.approx(3.0) and s.item() == pytest.approx(3.0)


def test_steps_follow_the_recurrent_reference(block_v):
    block_v(16)
    B, T, H, K, V = 1, 5, 2, 24, 20
    q, k, v, g, beta, state = _inputs(B, T, H, K, V, seed=1)
    o_ref, s_ref = kda_recurrent_ref(q, k, v, g, beta, None, state)
    S, outs = state, []
    for t in range(T):  # q[:, t] etc. are non-contiguous views
        o_t, S = kdt.kda_decode_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], S, None)
        outs.append(o_t)
    assert _rel_rms(torch.stack(outs, 1), o_ref) < 1e-5 and _rel_rms(S, s_ref) < 1e-5


def test_bf16_inputs_fp32_state():
    q, k, v, g, beta, state = _inputs(2, 1, 4, 32, 48, dtype=torch.bfloat16, seed=2)
    args = (q[:, 0], k[:, 0], v[:, 0], g[:, 0].float(), beta[:, 0], state)
    o, s_new = kdt.kda_decode_step(*args, None)
    o_ref, s_ref = kda_decode_step_ref(*args, None)
    assert o.dtype == torch.bfloat16 and s_new.dtype == torch.float32
    assert _rel_rms(o, o_ref) < 1e-2 and _rel_rms(s_new, s_ref) < 1e-5
