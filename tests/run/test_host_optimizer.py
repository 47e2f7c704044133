"""HostOptimizer trains as the torch optimizer it wraps, bit for bit, with any part of its state on the host.

On the CPU the "host copies" are plain copies, but the code path is the one a GPU runs (hooks, host copies
of parameters and gradients, the update on them, the values copied back). Dropout is off so that the two
models see the same random numbers.
"""
import copy

import pytest
import torch

from fxmem.run.host_optimizer import HostOptimizer, supports

transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def llama():
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def train(model, optimizer, scheduler=None, steps=3, clip=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 8), generator=gen)
        model(x, labels=x).loss.backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif clip == "optimizer":
            optimizer.clip_grad_norm_(0.05)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def pair(make, optimizer_class=torch.optim.AdamW, every=2, **options):
    torch.manual_seed(0)
    reference = make()
    model = copy.deepcopy(reference)
    ref_opt = optimizer_class(reference.parameters(), lr=1e-2, **options)
    opt = HostOptimizer(optimizer_class(model.parameters(), lr=1e-2, **options))
    opt.place(list(model.parameters())[::every])
    return reference, ref_opt, model, opt


def assert_same(reference, model):
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("make", [gpt2, llama])
@pytest.mark.parametrize("every", [1, 2])  # all parameters' state on the host, or every other one's
def test_trains_as_torch_adamw(make, every):
    reference, ref_opt, model, opt = pair(make, every=every)
    train(reference, ref_opt)
    train(model, opt)
    assert_same(reference, model)
    host = opt.host_parameters
    assert host and all(s.device.type == "cpu" for p in host for s in opt.state[p].values())
    assert len(host) == len(list(model.parameters())[::every])


def test_adam_with_weight_decay_and_amsgrad():
    reference, ref_opt, model, opt = pair(llama, torch.optim.Adam, weight_decay=0.1, amsgrad=True)
    train(reference, ref_opt)
    train(model, opt)
    assert_same(reference, model)


@pytest.mark.parametrize("clip", ["torch", "optimizer"])
def test_clipping_by_norm(clip):
    """torch's clip_grad_norm_ after backward (the host copies are made again where it changed the gradients)
    and the optimizer's own (which sees the host copies, as it must when gradients leave the device)."""
    reference, ref_opt, model, opt = pair(gpt2)
    train(reference, ref_opt, clip="torch")
    train(model, opt, clip=clip)
    assert_same(reference, model)


def test_offloaded_gradients_are_freed_and_clipped():
    reference, ref_opt, model, _ = pair(gpt2)
    opt = HostOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), offload_gradients=True)
    opt.place(list(model.parameters()))
    x = torch.randint(0, 64, (2, 8))
    model(x, labels=x).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()  # a fresh start, as the other step below
    train(reference, ref_opt, clip="torch")
    train(model, opt, clip="optimizer")
    assert_same(reference, model)


def test_scheduler_changes_the_learning_rate():
    reference, ref_opt, model, opt = pair(llama)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.3)
    train(reference, ref_opt, ref_sched)
    train(model, opt, sched)
    assert_same(reference, model)
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 1e-2


def test_state_dict_round_trip():
    """Its state_dict is torch's (equal to the reference's); loaded into a new one, training goes on as the
    reference's does; a torch optimizer loads it too."""
    reference, ref_opt, model, opt = pair(gpt2)
    train(reference, ref_opt)
    train(model, opt)
    ours, theirs = opt.state_dict(), ref_opt.state_dict()
    assert ours["param_groups"] == theirs["param_groups"] and ours["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        assert all(torch.equal(state[k], ours["state"][i][k].to(state[k].device)) for k in state)
    again = HostOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    again.place(list(model.parameters())[1::2])  # another placement than the one that saved it
    again.load_state_dict(ours)
    assert all(s.device.type == "cpu" for p in again.host_parameters for s in again.state[p].values())
    plain = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2)
    plain.load_state_dict(ours)
    train(reference, ref_opt, seed=2)
    train(model, again, seed=2)
    assert_same(reference, model)


def test_moving_state_between_device_and_host():
    reference, ref_opt, model, opt = pair(llama)
    train(reference, ref_opt, steps=2)
    train(model, opt, steps=2)
    opt.place([])  # everything back on the device mid-training
    train(reference, ref_opt, steps=1, seed=3)
    train(model, opt, steps=1, seed=3)
    assert_same(reference, model)


def test_supported_optimizers_named():
    assert supports("adamw") and supports(torch.optim.Adam([torch.nn.Parameter(torch.ones(1))]))
    sgd = HostOptimizer(torch.optim.SGD([p := torch.nn.Parameter(torch.ones(2))], lr=0.1, momentum=0.9))
    assert not supports("sgd")
    with pytest.raises(ValueError, match="state stays on the device"):
        sgd.place([p])
    sgd.place([])  # on the device it trains as SGD does
    p.grad = torch.ones(2)
    sgd.step()
    assert torch.allclose(p.detach(), torch.full((2,), 0.9))


def test_bf16_parameters_keep_bf16_state_as_torch_does():
    torch.manual_seed(0)
    reference = llama().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = HostOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt.place(list(model.parameters()))
    train(reference, ref_opt)
    train(model, opt)
    assert_same(reference, model)
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in opt.host_parameters)


def test_parameters_changed_outside_step_are_read_again():
    """A checkpoint loaded into the model between steps: the host copies are made again from it."""
    reference, ref_opt, model, opt = pair(gpt2)
    train(reference, ref_opt, steps=1)
    train(model, opt, steps=1)
    torch.manual_seed(5)
    loaded = gpt2().state_dict()
    reference.load_state_dict(loaded)
    model.load_state_dict(loaded)
    train(reference, ref_opt, steps=2, seed=4)
    train(model, opt, steps=2, seed=4)
    assert_same(reference, model)


def test_the_wrapped_optimizer_refuses_to_step():
    p = torch.nn.Parameter(torch.ones(2))
    wrapped = torch.optim.AdamW([p], lr=0.1)
    HostOptimizer(wrapped)
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="step that one"):
        wrapped.step()
