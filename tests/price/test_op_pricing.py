"""Op pricing: attention FLOPs by PyTorch's formulas, the GPU's attention kernel, ops priced by memory traffic."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

import fxmem
from fxmem.price.cost import DEVICE_PRESETS, estimate
from fxmem.price.memory import tensors_of
from fxmem.price.op_pricing import ATTENTION_BACKWARD, ATTENTION_FORWARD, FLOP_FORMULAS, MEMORY_BOUND
from fxmem.planner.plan import Plan
from fxmem.price.joint_problem import split_joint
from tests.conftest import joint_of

CPU, H100 = DEVICE_PRESETS["cpu"], DEVICE_PRESETS["h100"]


class Attention(torch.nn.Module):
    """One attention block through F.scaled_dot_product_attention, causal or with a mask tensor."""

    def __init__(self, dim: int = 32, heads: int = 4, mask: bool = False):
        super().__init__()
        self.qkv, self.out, self.heads, self.mask = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), heads, mask

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.mask else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d)).relu().sum()


def _attention_nodes(joint):
    nodes = [n for n in joint.graph.nodes if "scaled_dot_product" in str(n.target)]
    forward = next(n for n in nodes if not str(n.target).split(".")[-2].endswith("_backward"))
    backward = next(n for n in nodes if str(n.target).split(".")[-2].endswith("_backward"))
    return forward, backward


def _bytes(node) -> int:
    ins = sum(t.numel() * t.element_size() for n in node.all_input_nodes for t in tensors_of(n))
    return ins + sum(t.numel() * t.element_size() for t in tensors_of(node))


@pytest.mark.parametrize("kv_heads", [8, 2], ids=["same-heads", "grouped-query"])
def test_every_attention_backend_has_pytorchs_formula(kv_heads):
    """PyTorch's formulas for every backend; under grouped-query attention (2 key/value heads for 8
    query heads) the FLOPs of the same attention with each key/value head repeated over its group,
    what the math path counts op by op."""
    registry = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS).flop_registry
    q, grad = torch.randn(2, 8, 64, 16), torch.randn(2, 8, 64, 24)
    k, v = torch.randn(2, kv_heads, 48, 16), torch.randn(2, kv_heads, 48, 24)
    k8, v8 = k.repeat_interleave(8 // kv_heads, dim=1), v.repeat_interleave(8 // kv_heads, dim=1)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as math_path:
        F.scaled_dot_product_attention(q, k, v, enable_gqa=kv_heads != 8)
    assert math_path.get_total_flops() == sdpa_flop_count(q.shape, k8.shape, v8.shape) > 0
    for name in ATTENTION_FORWARD:
        assert registry[getattr(torch.ops.aten, name)](q, k, v, out_val=grad) == sdpa_flop_count(q.shape, k8.shape, v8.shape)
    for name in ATTENTION_BACKWARD:
        assert registry[getattr(torch.ops.aten, name)](grad, q, k, v, out_val=(q, k, v)) == \
            sdpa_backward_flop_count(grad.shape, q.shape, k8.shape, v8.shape)
    assert all(hasattr(torch.ops.aten, name) for name in MEMORY_BOUND), "names of aten ops"


def test_attention_flops_are_pytorchs_and_recomputing_it_costs_time():
    joint, num_fwd_outputs = joint_of(Attention(), torch.randn(2, 128, 32))
    costs = estimate(joint, CPU, backward=set(split_joint(joint, num_fwd_outputs).backward))
    forward, backward = _attention_nodes(joint)
    q, k, v = (torch.randn(t.meta["val"].shape) for t in forward.args[:3])
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as math_path:
        F.scaled_dot_product_attention(q, k, v)  # the same math unfused: two bmm's FlopCounterMode counts
    fwd = costs[forward.name]
    assert fwd.op.startswith("_scaled_dot_product_flash_attention_for_cpu")
    assert fwd.flops == math_path.get_total_flops() > 0
    shapes = [n.meta["val"].shape for n in backward.args[:4]]
    assert costs[backward.name].flops == sdpa_backward_flop_count(*shapes) > 0
    assert fwd.seconds == CPU.seconds(fwd.flops, _bytes(forward)) > CPU.seconds(0, _bytes(forward))
    assert not fwd.fallback and fwd.kernel == ""


def test_a_plan_counts_attention_flops_and_prices_its_recompute():
    torch.manual_seed(0)
    model, x = Attention(dim=64, heads=4), torch.randn(4, 64, 64)
    plan = fxmem.plan(model, (x,))
    rows = [r for r in plan.nodes if r.op.startswith("_scaled_dot_product")]
    assert rows, "the attention output is a value backward needs"
    b, s, d, h = 4, 64, 64, 4
    formula = 2 * (2 * b * h * s * s * (d // h))  # q·kᵀ and probs·v, as torch.utils.flop_counter.sdpa_flop
    assert all(r.flops == formula and r.seconds >= formula / CPU.flop_rate(torch.float32) for r in rows), \
        "recomputing attention costs its FLOPs' time"
    assert plan.total_flops >= 3 * formula and plan.fallback_ops == ()  # forward, and backward's five matmuls


@pytest.mark.parametrize("dtype, mask, kernel", [
    (torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
    (torch.bfloat16, True, "_scaled_dot_product_efficient_attention"),
    (torch.float32, False, "_scaled_dot_product_efficient_attention"),
    (torch.float64, False, "math"),
])
def test_a_gpu_target_prices_the_kernel_the_gpu_runs(dtype, mask, kernel):
    joint, num_fwd_outputs = joint_of(Attention(mask=mask).to(dtype), torch.randn(2, 16, 32, dtype=dtype))
    on_cpu, on_gpu = estimate(joint, CPU), estimate(joint, H100)
    for node, suffix in zip(_attention_nodes(joint), ("", "_backward")):
        cost = on_gpu[node.name]
        assert cost.kernel == (kernel + suffix if kernel != "math" else "math")
        assert cost.flops == on_cpu[node.name].flops > 0 and on_cpu[node.name].kernel == ""
        if kernel == "math":  # the scores go through memory: more than the fused kernels move
            assert cost.seconds > H100.seconds(cost.flops, _bytes(node), dtype)
        else:
            assert cost.seconds == H100.seconds(cost.flops, _bytes(node), dtype)


def test_plan_for_a_gpu_names_the_kernels_it_priced():
    torch.manual_seed(0)
    plan = fxmem.plan(Attention().to(torch.bfloat16), (torch.randn(2, 16, 32, dtype=torch.bfloat16),), target="h100")
    assert plan.priced_as == {"_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
                              "_scaled_dot_product_flash_attention_for_cpu_backward":
                                  "_scaled_dot_product_flash_attention_backward"}
    assert "priced as _scaled_dot_product_flash_attention" in " ".join(plan.table().split())  # values wrap at 120
    assert Plan.from_json(plan.to_json()) == plan


class Whitened(torch.nn.Module):
    """A Cholesky factorisation: an op with no FLOP formula in torch's counter."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.proj(x)
        gram = h.transpose(-1, -2) @ h + torch.eye(h.shape[-1])
        return torch.linalg.cholesky(gram).relu().sum()


def test_ops_without_a_formula_are_priced_by_traffic_and_listed():
    joint, num_fwd_outputs = joint_of(Whitened(), torch.randn(32, 16))
    costs = estimate(joint, CPU)
    fallback = costs.fallback_ops()
    assert any(op.startswith("linalg_cholesky_ex") for op in fallback)
    assert not any(op.split(".")[0] in ("mm", "addmm", "add", "relu", "sum", "t", "transpose") for op in fallback)
    for node in joint.graph.nodes:
        if node.name in costs.nodes and costs[node.name].fallback:
            assert costs[node.name].flops == 0
            assert costs[node.name].seconds == CPU.seconds(0, _bytes(node))
    plan = fxmem.plan(Whitened(), (torch.randn(32, 16),))
    assert plan.fallback_ops == fallback
    line = next(line for line in plan.table().splitlines() if line.startswith("priced by memory traffic"))
    assert all(op in line for op in fallback)
    assert Plan.from_json(plan.to_json()).fallback_ops == fallback
