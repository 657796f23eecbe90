"""minite.kernels.megatron_rope (one launch) against Megatron-Core's unfused RoPE, bit for bit on the H200 (marker
gpu); and the dispatch of megatron_patches.rope: the kernel only for CUDA inference calls it takes."""
import pytest
import torch

from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd


def _freqs(positions, d, theta=1_000_000.0, device="cpu"):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    f = torch.outer(positions.to(device).float(), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]  # Megatron's [s, 1, 1, d] (rotary_interleaved False)


class _Config:
    apply_rope_fusion = rotary_interleaved = multi_latent_attention = False
    mrope_section = None


def _dispatched(t, f, **kw):
    import megatron.core.transformer.attention as attention_mod

    from minite.megatron_patches.rope import install
    install()
    install()  # idempotent
    return attention_mod.apply_rotary_pos_emb(t, f, config=_Config(), cu_seqlens=None, mscale=1.0, cp_group=object(),
                                              **kw)


def test_dispatch_is_megatrons_rope_off_the_gpu():
    torch.manual_seed(0)
    t = torch.randn(2, 3, 4, 16).bfloat16()
    f = _freqs(torch.arange(2) + 5, 16)
    assert torch.equal(_dispatched(t, f), _apply_rotary_pos_emb_bshd(t, f, mscale=1.0))


def test_dispatch_hands_the_kernel_megatrons_mscale(monkeypatch):
    """Where the kernel applies, it gets the call's tensors and its mscale (here forced on the CPU, kernel faked)."""
    from minite.kernels import megatron_rope
    from minite.megatron_patches import rope as dispatch
    got = []
    monkeypatch.setattr(dispatch, "_fused_applies", lambda *a: True)
    monkeypatch.setattr(megatron_rope, "rope", lambda t, f, mscale: got.append((t, f, mscale)) or t)
    import megatron.core.transformer.attention as attention_mod
    dispatch.install()
    t, f = torch.randn(1, 2, 2, 8).bfloat16(), _freqs(torch.tensor([3]), 8)
    attention_mod.apply_rotary_pos_emb(t, f, config=_Config(), cu_seqlens=None, mscale=0.7, cp_group=object())
    assert len(got) == 1 and got[0][0] is t and got[0][1] is f and got[0][2] == 0.7


@pytest.mark.gpu
def test_dispatch_keeps_megatron_where_the_kernel_does_not_apply(monkeypatch):
    """Partial rotary widths, freqs per batch row, cu_seqlens and interleaving go to Megatron's function; inference
    mode takes the kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from minite.kernels import megatron_rope
    from minite.megatron_patches.rope import _fused_applies
    t = torch.randn(1, 4, 8, 128, device="cuda").bfloat16()
    full = _freqs(torch.tensor([9]), 128, device="cuda")
    cfg = _Config()
    with torch.no_grad():
        assert _fused_applies(t, full, cfg, (), {"mscale": 1.0})
        assert not _fused_applies(t, full[..., :64], cfg, (), {})  # rotary over part of the head
        assert not _fused_applies(t, full.expand(1, 4, 1, 128), cfg, (), {})  # freqs per batch row
        assert not _fused_applies(t, full, cfg, (), {"cu_seqlens": torch.zeros(2, device="cuda")})
        inter = _Config()
        inter.rotary_interleaved = True
        assert not _fused_applies(t, full, inter, (), {})
    with torch.inference_mode():
        assert _fused_applies(t, full, cfg, (), {}) and megatron_rope.applies(t, full)


@pytest.mark.gpu
def test_dispatch_takes_the_kernel_only_without_autograd(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from minite.kernels import megatron_rope
    calls = []
    real = megatron_rope.rope
    monkeypatch.setattr(megatron_rope, "rope", lambda *a: calls.append(1) or real(*a))
    t = torch.randn(1, 4, 8, 128, device="cuda").bfloat16()
    f = _freqs(torch.tensor([9]), 128, device="cuda")
    with torch.no_grad():
        y = _dispatched(t, f)
    assert calls and torch.equal(y, _apply_rotary_pos_emb_bshd(t, f, mscale=1.0))
    calls.clear()
    _dispatched(t.clone().requires_grad_(True), f).sum().backward()  # training: Megatron's ops and their backward
    assert not calls


@pytest.mark.gpu
@pytest.mark.parametrize("s,b,h", [(1, 64, 32), (1, 64, 4), (32, 8, 32), (1, 3, 32)])
def test_fused_rope_is_megatrons_rope_bitwise(s, b, h):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from minite.kernels.megatron_rope import applies, rope
    torch.manual_seed(s * 1000 + b + h)
    d = 128
    qkv = (torch.randn(s, b, h + 2 * 4, d, device="cuda") * 3).bfloat16()  # q as a strided slice of a QKV tensor
    qkv[0, 0, 0] = 0  # a zero head: the signs of its zeros are Megatron's too (Triton 3.6's -x gave +0 for +0)
    t = qkv[:, :, :h]
    for pos in (torch.arange(s) + 17, torch.arange(s) + 40_000, torch.randint(0, 1 << 20, (s,))):
        f = _freqs(pos, d, device="cuda")
        assert applies(t, f)
        for mscale in (1.0, 0.7):
            want = _apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=False, multi_latent_attention=False,
                                              mscale=mscale)
            assert torch.equal(rope(t, f, mscale).view(torch.int16), want.view(torch.int16))  # bits, zeros' signs
