"""A real client: tiny randomly initialised Qwen3-Next and Kimi Linear models from transformers (config only,
seeded, no downloads) give the same logits with tilela's op patched in at the model's call site (the module global
that transformers hooks to FLA's chunk_gated_delta_rule / chunk_kda) as with the model's own torch implementation."""

import inspect

import pytest
import torch

import tilela

transformers = pytest.importorskip("transformers")

SEQ = 40
# relative difference of the logits allowed per model dtype; measured on the CPU (transformers 5.24): 1.5e-7 to
# 1.7e-7 in fp32, 3.7e-3 to 4.1e-3 in bf16
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def qwen3_next(head_dim=32):
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM, modeling_qwen3_next

    config = Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "full_attention"], max_position_embeddings=512)
    return (Qwen3NextForCausalLM(config), modeling_qwen3_next, "torch_chunk_gated_delta_rule",
            tilela.chunk_gated_delta_rule)


def kimi_linear(head_dim=32):
    from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM, modeling_kimi_linear

    config = KimiLinearConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=head_dim,
        linear_num_heads=2, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return KimiLinearForCausalLM(config), modeling_kimi_linear, "chunk_kimi_delta_attention", tilela.chunk_kda


def _torch_implementation(site):
    """The function behind transformers' hub-kernel wrapper at a model's call site: the wrapper's __wrapped__, the
    wrapper itself a function (transformers 5.24) or called by the `kernels` package's module that stands at the call
    site (transformers 5.25, which requires `kernels`)."""
    if isinstance(site, torch.nn.Module):
        site = inspect.getclosurevars(type(site).forward).nonlocals["func"]
    return site.__wrapped__


@pytest.mark.parametrize("device,dtype,head_dim", [("cpu", torch.float32, 32), ("cpu", torch.bfloat16, 32),
                                                    pytest.param("cuda", torch.bfloat16, 128, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("build", [qwen3_next, kimi_linear])
def test_logits_with_tilela_equal_the_torch_fallback(build, device, dtype, head_dim, monkeypatch):
    """On a Hopper GPU at head dim 128 Qwen3-Next's layer runs the TileLang kernels."""
    torch.manual_seed(0)
    model, module, call_site, op = build(head_dim)
    model = model.to(device, dtype).eval()
    ids = torch.randint(3, 256, (2, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    # the model's own torch implementation (transformers would pick FLA's function instead where FLA is installed)
    monkeypatch.setattr(module, call_site, _torch_implementation(getattr(module, call_site)))
    with torch.no_grad():
        want = model(ids).logits.float()
        calls = []

        def ours(*args, **kwargs):
            calls.append(kwargs.get("use_qk_l2norm_in_kernel"))
            return op(*args, **kwargs)

        monkeypatch.setattr(module, call_site, ours)
        got = model(ids).logits.float()
    assert calls == [True]  # one linear-attention layer, called as FLA is, with the l2norm option
    err = ((got - want).norm() / want.norm()).item()
    assert err < TOLERANCE[dtype], f"relative logits difference {err:.2e}"
