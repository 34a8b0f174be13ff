"""sp.stream(): the model's own loop calls each streamed block, with any arguments, and the plain
PyTorch loop (backward, clip, optimizer step, zero_grad) is the whole protocol. Every check holds
the streamed model against the same model in plain PyTorch on the same BF16-rounded weights."""

import copy
import functools
import gc
import io
import os
import pickle
import weakref

import pytest
import torch

import selective_precision as sp

DIM = 16
ALL_BF16 = {"mode": "off", "telemetry_enabled": False}


class Block(torch.nn.Module):
    """Takes a mask, a (cos, sin) tuple and a number besides its input; returns its output and an
    auxiliary loss, as a mixture-of-experts block returns its load-balancing loss."""

    def __init__(self, p=0.3):
        super().__init__()
        self.fc = torch.nn.Linear(DIM, DIM)
        self.norm = torch.nn.LayerNorm(DIM)
        self.drop = torch.nn.Dropout(p)

    def forward(self, h, mask=None, position_embeddings=None, scale=1.0):
        cos, sin = position_embeddings
        y = self.drop(self.fc(self.norm(h)) * cos + sin) * scale
        if mask is not None:
            y = y * mask
        return h + y, y.square().mean()


class Model(torch.nn.Module):
    def __init__(self, blocks=3, p=0.3):
        super().__init__()
        self.embed = torch.nn.Linear(8, DIM)
        self.layers = torch.nn.ModuleList(Block(p) for _ in range(blocks))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x, mask=None):
        h, aux = self.embed(x), 0.0
        pe = (torch.full((DIM,), 0.9, device=x.device), torch.full((DIM,), 0.01, device=x.device))
        for layer in self.layers:
            h, a = layer(h, mask=mask, position_embeddings=pe, scale=0.5)
            aux = aux + a
        return self.head(h).square().mean() + aux


def bf16_rounded(model, layers="layers"):
    """The model with its blocks' 2-D weights rounded to BF16, as the layer delivers them."""
    with torch.no_grad():
        for name, p in getattr(model, layers).named_parameters():
            if p.dim() == 2 and name.endswith("weight"):
                p.copy_(p.to(torch.bfloat16).float())
    return model


def plain_and_streamed(seed=0, recompute=None, **model_options):
    torch.manual_seed(seed)
    plain = bf16_rounded(Model(**model_options))
    streamed = copy.deepcopy(plain)
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16, recompute=recompute)
    return plain, streamed


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_keys_parameters_and_gradients_are_plain_pytorchs_with_dropout_and_any_arguments():
    plain, streamed = plain_and_streamed()
    assert [n for n, _ in streamed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    master = streamed.layers[1].fc.weight
    assert isinstance(master, torch.nn.Parameter) and master.dtype == torch.float32 and master.numel() == DIM * DIM
    x, mask = torch.randn(4, 8), (torch.rand(DIM) > 0.2).float()
    torch.manual_seed(7)
    plain(x, mask).backward()
    torch.manual_seed(7)
    loss = streamed(x, mask)
    loss.backward()
    expected, got = grads(plain), grads(streamed)
    assert got.keys() == expected.keys()  # every streamed weight and the aux loss's path get one
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("recompute", [False, True])
def test_several_backwards_through_one_forward_train_as_plain_pytorch(recompute):
    """loss.backward(retain_graph=True) and a second loss over the same forward (it used to be
    refused: "backward through block2 of a training pass that has ended"): the gradients add up
    as plain PyTorch's, the step counts one training pass, and the next step trains."""
    plain, streamed = plain_and_streamed(p=0.3, recompute=recompute)
    x = torch.randn(4, 8)
    for model in (plain, streamed):
        torch.manual_seed(3)
        loss = model(x)
        loss.backward(retain_graph=True)
        (loss * loss).backward()
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-5, atol=1e-6, msg=name)
    torch.optim.SGD(streamed.parameters(), lr=0.1).step()
    assert streamed.layers.last_report.training_passes == 1
    assert streamed.layers.last_report.eval_h2d_bytes == 0
    streamed(x).backward()


@pytest.mark.parametrize("recompute", [False, True])
def test_a_backward_asked_for_some_gradients_only_leaves_the_streamed_weights_alone(recompute):
    """torch.autograd.grad(loss, [x]) and backward(inputs=[...]) give the streamed weights no
    gradient, as plain PyTorch gives a parameter left out none (with recompute=True they took one,
    and a full backward through the same graph after it counted them twice)."""
    plain, streamed = plain_and_streamed(p=0.0, recompute=recompute)
    x = torch.randn(4, 8, requires_grad=True)
    for model in (plain, streamed):
        loss = model(x)
        torch.autograd.grad(loss, [x], retain_graph=True)
        model(x).backward(inputs=[model.embed.weight])
        assert model.layers[0].fc.weight.grad is None
        loss.backward()
    assert grads(streamed).keys() == grads(plain).keys()
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_a_pass_that_exits_early_then_one_in_another_order_are_two_passes():
    """An evaluation that stops after two blocks, then one that begins with the second; a
    grad-mode pass whose outputs are dropped after two blocks, then a training pass in reverse:
    each later pass is a pass of its own, as in plain PyTorch (a block it had called, or any block
    once the host dropped the earlier pass's outputs, begins it)."""
    plain, streamed = plain_and_streamed(p=0.0)
    pe = (torch.full((DIM,), 0.9), torch.full((DIM,), 0.01))

    def run(model, order, x):
        h = model.embed(x)
        for i in order:
            h, _ = model.layers[i](h, position_embeddings=pe, scale=0.5)
        return h.square().mean()

    x = torch.randn(4, 8)
    results = []
    for model in (plain, streamed):
        with torch.no_grad():
            run(model, (0, 1), x)
            evaluated = run(model, (1, 0, 2), x)
        run(model, (1, 2), x)  # grad mode, its outputs dropped
        run(model, (2, 1, 0), x).backward()
        results.append((evaluated, grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-5, atol=1e-6, msg=name)


class Permuted(Model):
    """Calls its layers in another order than the list's, as a model whose list is not its call
    order does."""

    order = (0, 2, 1)

    def forward(self, x, mask=None):
        h, aux = self.embed(x), 0.0
        pe = (torch.full((DIM,), 0.9), torch.full((DIM,), 0.01))
        for i in self.order:
            h, a = self.layers[i](h, mask=mask, position_embeddings=pe, scale=0.5)
            aux = aux + a
        return self.head(h).square().mean() + aux


@pytest.mark.parametrize("recompute", [False, True])
def test_blocks_called_in_another_order_than_listed_train_as_plain_pytorch(recompute):
    """Any call order is served (it used to be refused: "block2 was called where block1 came
    next"): training and evaluation are plain PyTorch's, dropout included, and the prefetch follows
    the order from the first pass on, which fetched block 1 ahead in vain, once."""
    torch.manual_seed(5)
    plain = bf16_rounded(Permuted())
    streamed = copy.deepcopy(plain)
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16, recompute=recompute)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, streamed)]
    unused = []
    for i in range(2):
        x = torch.randn(4, 8)
        for model in (plain, streamed):
            torch.manual_seed(i)
            model(x).backward()
        for name, g in grads(plain).items():
            torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-5, atol=1e-6, msg=name)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        unused.append(streamed.layers.last_report.prefetch_unused)
        for model in (plain, streamed):
            bf16_rounded(model)
        with torch.no_grad():
            torch.testing.assert_close(streamed.eval()(x), plain.eval()(x), rtol=1e-5, atol=1e-6)
        streamed.train(), plain.train()
    assert unused == [1, 0]


def cuda_or_skip():
    if not torch.cuda.is_available():
        if os.environ.get("SP_REQUIRE_GPU") == "1":
            pytest.fail("SP_REQUIRE_GPU=1, but torch sees no CUDA device")
        pytest.skip("no CUDA device")


def test_on_cuda_the_blocks_compute_there_from_host_masters_and_train_as_plain_pytorch():
    cuda_or_skip()
    torch.manual_seed(0)
    plain = bf16_rounded(Model(p=0.3)).cuda()
    streamed = copy.deepcopy(plain)
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16, device="cuda")
    assert streamed.layers[0].fc.weight.device.type == "cpu" and streamed.layers[0].fc.bias.device.type == "cuda"
    x = torch.randn(4, 8, device="cuda")
    for model in (plain, streamed):
        torch.manual_seed(9)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()
    for name, p in plain.named_parameters():
        got = streamed.get_parameter(name).grad
        torch.testing.assert_close(got.to(p.grad.device), p.grad, rtol=1e-3, atol=1e-5, msg=name)
    optimizer = torch.optim.AdamW(streamed.parameters(), lr=1e-3)
    optimizer.step()
    optimizer.zero_grad()
    assert streamed.layers.last_report.h2d_bytes > 0


def test_the_plain_loop_trains_the_streamed_weights_and_ends_each_step():
    plain, streamed = plain_and_streamed(p=0.0)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, streamed)]
    x = torch.randn(4, 8)
    norms = []
    for model, optimizer in zip((plain, streamed), optimizers):
        loss = model(x)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        if model is streamed:
            streamed.layers.report_loss(loss)
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(norms[1], norms[0])  # the streamed weights are in the norm
    for name, p in plain.named_parameters():  # and the optimizer stepped them all alike
        torch.testing.assert_close(streamed.get_parameter(name), p, msg=name)
    for step in range(1, 3):
        before = streamed.layers[0].fc.weight.detach().clone()
        streamed(x).backward()
        optimizers[1].step()
        optimizers[1].zero_grad()
        report = streamed.layers.last_report
        assert report.step == step and report.training_passes == 1 and report.h2d_bytes > 0
        assert not torch.equal(streamed.layers[0].fc.weight, before)
        assert streamed.layers[0].fc.weight.grad is None


class SignSGD:
    """An optimizer that is not torch.optim's: no step hooks tell the layer it ran."""

    def __init__(self, params, lr):
        self.params, self.lr = list(params), lr

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad.sign(), alpha=-self.lr)


def change_the_weights(model, how, optimizers):
    """One update of `model` that torch.optim's hooks do not see."""
    with torch.no_grad():
        if how == "by_hand":
            for p in model.parameters():
                if p.grad is not None:
                    p -= 0.1 * p.grad
        elif how == "other_optimizer":
            optimizers.setdefault(id(model), SignSGD(model.parameters(), lr=1e-2)).step()
        elif how == "load_state_dict":
            model.load_state_dict({k: v * 0.9 for k, v in model.named_parameters()}, strict=False)
        else:
            model.layers[1].fc.weight.mul_(0.9)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["by_hand", "other_optimizer", "load_state_dict", "edit_in_place"])
def test_weights_changed_by_anyone_are_streamed_from_the_next_forward(how):
    """Without torch.optim the next forward trains on the changed weights, as plain PyTorch does
    (it used to stream the first step's weights), and that change ends the policy's step."""
    plain, streamed = plain_and_streamed(seed=21, p=0.0)
    x, optimizers = torch.randn(4, 8), {}
    for step in range(3):
        losses = []
        for model in (plain, streamed):
            loss = model(x)
            loss.backward()
            losses.append(loss.item())
            change_the_weights(model, how, optimizers)
            bf16_rounded(model)
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7), step
        with torch.no_grad():
            assert streamed(x).item() == pytest.approx(plain(x).item(), rel=1e-5, abs=1e-7), step
    report = streamed.layers.last_report
    assert report.step == 1 and report.training_passes == 1
    assert all(m["count"] > 0 for m in streamed.layers.last_moments)  # the backward's, not the cleared ones


def test_a_weight_changed_between_the_forward_and_its_backward_is_refused_as_pytorch_does():
    _, streamed = plain_and_streamed(p=0.0)
    loss = streamed(torch.randn(4, 8))
    with torch.no_grad():
        streamed.layers[2].fc.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="block2's master 'fc.weight' was modified in place after the forward"):
        loss.backward()
    streamed.zero_grad()
    streamed(torch.randn(4, 8)).backward()  # the next pass runs


def test_a_master_given_new_storage_is_refused_not_read():
    _, streamed = plain_and_streamed(p=0.0)
    weight = streamed.layers[0].fc.weight
    weight.data = weight.data.clone()
    with pytest.raises(RuntimeError, match="master 'fc.weight' no longer holds the storage the layer streams from"):
        streamed(torch.randn(4, 8))


def test_two_forwards_before_one_backward_train_as_plain_pytorch_with_dropout():
    """The contrastive loop (sentence-transformers' losses run it): two grad-mode forwards, then
    one backward of a loss over both (it used to be refused); then a backward per forward."""
    plain, streamed = plain_and_streamed(seed=41, p=0.3)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    for model in (plain, streamed):
        torch.manual_seed(9)
        (model(a) - 2 * model(b)).square().backward()
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-5, atol=1e-6, msg=name)
    optimizer = torch.optim.SGD(streamed.parameters(), lr=0.1)
    optimizer.step()
    assert streamed.layers.last_report.training_passes == 2
    optimizer.zero_grad()
    losses = [streamed(a), streamed(b)]
    losses[0].backward()
    losses[1].backward()
    optimizer.step()
    assert streamed.layers.last_report.training_passes == 2


class CheckpointedModel(Model):
    """Model, each block under torch.utils.checkpoint, as Hugging Face's gradient checkpointing
    runs them."""

    def __init__(self, reentrant=False, **options):
        super().__init__(**options)
        self.reentrant = reentrant

    def forward(self, x, mask=None):
        h, aux = self.embed(x), 0.0
        pe = (torch.full((DIM,), 0.9), torch.full((DIM,), 0.01))
        for layer in self.layers:
            block = functools.partial(layer, mask=mask, position_embeddings=pe, scale=0.5)
            h, a = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.reentrant)
            aux = aux + a
        return self.head(h).square().mean() + aux


def test_blocks_under_the_hosts_checkpointing_train_as_plain_pytorch_with_dropout():
    """torch.utils.checkpoint (non-reentrant) recomputes each block before its backward, inside
    it: the layer serves that recompute from the backward's fetch (it used to refuse the block as
    out of order), and the gradients are plain PyTorch's, dropout masks included."""
    torch.manual_seed(31)
    plain = bf16_rounded(CheckpointedModel(p=0.3))
    streamed = copy.deepcopy(plain)
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16)
    x = torch.randn(4, 8)
    for model in (plain, streamed):
        torch.manual_seed(8)
        model(x).backward()
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-5, atol=1e-6, msg=name)
    for model in (plain, streamed):
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        bf16_rounded(model)
    assert streamed.layers.last_report.training_passes == 1

    # Two forwards, then the first one's backward, then the second's: each recompute joins the
    # pass whose forward gave the block these inputs.
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    for model in (plain, streamed):
        model.zero_grad()
        torch.manual_seed(10)
        losses = [model(a), model(b)]
        losses[0].backward()
        losses[1].backward()
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-5, atol=1e-6, msg=name)
    streamed.zero_grad()

    streamed.reentrant = True  # its forward runs without a graph: the recompute has no pass to join
    with pytest.raises(RuntimeError, match="called in grad mode inside a backward, on inputs that no training pass's "
                                           "forward gave it.*use_reentrant=False"):
        streamed(x).backward()


def test_a_reentrant_recompute_never_joins_an_earlier_pass_whose_input_has_died():
    """An earlier pass's graph outlives its backward while the host holds the loss, but its saved
    inputs are freed; the reentrant checkpoint's new inputs can then take a freed input's address.
    The layer must still refuse them (it once took one for the dead input, about 2% of times)."""
    torch.manual_seed(31)
    streamed = bf16_rounded(CheckpointedModel(p=0.3))
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16)
    messages = set()
    for _ in range(300):
        streamed.reentrant = False
        losses = [streamed(torch.randn(4, 8)), streamed(torch.randn(4, 8))]
        losses[0].backward()
        losses[1].backward()
        streamed.zero_grad()
        streamed.reentrant = True
        with pytest.raises(RuntimeError) as refused:
            streamed(torch.randn(4, 8)).backward()
        messages.add(str(refused.value).split(":")[1].split(",")[0])
    assert messages == {" block2 was called in grad mode inside a backward"}


def test_gradient_accumulation_and_evaluation_forwards_within_a_step():
    plain, streamed = plain_and_streamed(p=0.0)
    xs = [torch.randn(4, 8) for _ in range(2)]
    for model in (plain, streamed):
        for x in xs:
            model(x).backward()
            with torch.no_grad():
                model(x)
    for name, g in grads(plain).items():
        torch.testing.assert_close(grads(streamed)[name], g, rtol=1e-6, atol=1e-7, msg=name)
    optimizer = torch.optim.SGD(streamed.parameters(), lr=0.1)
    optimizer.step()
    assert streamed.layers.last_report.training_passes == 2
    with torch.no_grad():
        torch.testing.assert_close(streamed(xs[0]), plain_after_sgd(plain, xs[0]), rtol=1e-2, atol=1e-3)


def plain_after_sgd(plain, x):
    torch.optim.SGD(plain.parameters(), lr=0.1).step()
    return plain(x)


@pytest.mark.parametrize("recompute", [False, True])
def test_bf16_autocast_computes_in_bf16_in_the_forward_and_any_recompute(recompute):
    plain, streamed = plain_and_streamed(p=0.0, recompute=recompute)
    dtypes = []
    streamed.layers[0].fc.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = streamed(x)
    loss.backward()
    assert dtypes == [torch.bfloat16] * (2 if recompute else 1)  # the forward, then any recompute
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain(x).backward()
    torch.testing.assert_close(streamed.layers[0].fc.weight.grad, plain.layers[0].fc.weight.grad)


def test_state_dict_holds_the_masters_and_round_trips_with_the_plain_model_both_ways():
    plain, streamed = plain_and_streamed()
    state = streamed.state_dict()
    assert torch.equal(state["layers.0.fc.weight"], plain.layers[0].fc.weight)
    # Streamed -> plain: the policy's extra state is the one key the plain model lacks.
    fresh = Model()
    result = fresh.load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["layers._extra_state"] and not result.missing_keys
    torch.testing.assert_close(fresh.layers[1].fc.weight, plain.layers[1].fc.weight, rtol=0, atol=0)
    # Plain -> streamed, strict: the masters take the weights, and the next pass streams them.
    torch.manual_seed(5)
    other = bf16_rounded(Model(p=0.0))
    streamed.load_state_dict(other.state_dict())
    streamed.eval(), other.eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(streamed(x), other(x))
    # The policy state round-trips through torch.save.
    buffer = io.BytesIO()
    torch.save(streamed.state_dict(), buffer)
    streamed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))


def test_misuse_is_refused_by_name():
    plain, streamed = plain_and_streamed(p=0.0)
    with pytest.raises(TypeError, match="pickled whole"):
        pickle.dumps(streamed)
    streamed.to(torch.float32)  # changes nothing: allowed
    x = torch.randn(4, 8)
    # An optimizer that leaves out some streamed weights.
    partial = torch.optim.SGD([streamed.layers[0].fc.weight, streamed.layers[1].fc.weight], lr=0.1)
    streamed(x).backward()
    with pytest.raises(ValueError, match=r"steps 2 of the 3 .*layers.2.fc.weight"):
        partial.step()
    torch.optim.SGD(streamed.parameters(), lr=0.1).step()
    # A block called twice in one pass.
    pe = (torch.ones(DIM), torch.zeros(DIM))
    h, _ = streamed.layers[0](torch.randn(4, DIM), position_embeddings=pe)
    h, _ = streamed.layers[1](h, position_embeddings=pe)
    with pytest.raises(RuntimeError, match=r"block1 was called twice in one training pass, before block2 was called"):
        streamed.layers[1](h, position_embeddings=pe)
    # An argument a recompute could not give again, in training: taken, since the block is
    # called once; recomputing, refused (and accepted without a graph).
    class Half:
        def __rmul__(self, tensor):
            return tensor * 0.5

    h = torch.randn(4, DIM)
    for layer in streamed.layers:
        h, _ = layer(h, position_embeddings=pe, scale=Half())
    h.sum().backward()
    _, recomputing = plain_and_streamed(p=0.0, recompute=True)
    with pytest.raises(TypeError, match=r"streamed block 0 .*scale=Half"):
        recomputing.layers[0](torch.randn(4, DIM), position_embeddings=pe, scale=Half())
    with torch.no_grad():
        recomputing.layers[0](torch.randn(4, DIM), position_embeddings=pe, scale=Half())
    with pytest.raises(FileNotFoundError, match="no/such.yaml"):
        sp.stream(Model().layers, config="no/such.yaml")


def test_a_config_directory_a_doubled_nf4_group_size_and_unasked_telemetry(tmp_path, monkeypatch):
    """A directory given as the config says so; the NF4 group size is stated once (two that
    differ are refused, naming both); without output_dir the policy writes no file, even where
    its config turns telemetry on, as the shipped ones do."""
    torch.manual_seed(3)
    with pytest.raises(IsADirectoryError, match="config: a directory, where the policy's YAML file was expected"):
        sp.stream(Model().layers, config=tmp_path)
    static_nf4 = {"mode": "static", "tiers": ["bf16", "nf4"], "force_nf4_blocks": [0], "nf4_group_size": 128,
                  "telemetry_enabled": False}
    with pytest.raises(ValueError, match=r"nf4_group_size is 64 \(the layer's option\), but <config mapping> sets "
                                         r"the policy's nf4_group_size to 128; state it once"):
        sp.stream(Model().layers, config=static_nf4, nf4_group_size=64)
    def nf4_bytes(config, **options):
        return sp.stream(torch.nn.ModuleList([torch.nn.Linear(512, 512)]), config=config, **options).image_bytes(
            0, "nf4")

    # The config's 128 is the layer's too: half the scales of 64's.
    assert nf4_bytes(static_nf4) == nf4_bytes({}, nf4_group_size=128) < nf4_bytes({}) == nf4_bytes({}, nf4_group_size=64)

    monkeypatch.chdir(tmp_path)
    shipped = os.path.join(sp.config_dir(), "policy", "dynamic.yaml")
    model = Model()
    model.layers = sp.stream(model.layers, config=shipped)
    model(torch.randn(4, 8)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert os.listdir(tmp_path) == []
    out = tmp_path / "run"
    model = Model()
    model.layers = sp.stream(model.layers, config=shipped, output_dir=out)
    model(torch.randn(4, 8)).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model.layers.close()
    assert os.listdir(tmp_path) == ["run"] and os.listdir(out) == ["selective_precision_telemetry.jsonl"]


def test_a_step_with_no_backward_is_refused_at_the_optimizer():
    _, streamed = plain_and_streamed(p=0.0)
    optimizer = torch.optim.SGD(streamed.parameters(), lr=0.1)
    streamed(torch.randn(4, 8))  # a grad-mode forward opens the step; no backward follows
    with pytest.raises(RuntimeError, match="post_backward"):
        optimizer.step()
    loss = streamed(torch.randn(4, 8))  # the step goes on: its backward comes now
    loss.backward()
    optimizer.step()
    report = streamed.layers.last_report
    assert report.step == 0 and report.training_passes == 1  # the forward alone was an evaluation's


def test_grad_mode_forwards_whose_outputs_are_dropped_keep_nothing_alive():
    """An evaluation loop under model.eval() without no_grad: each forward's pass is closed by the
    next one once its graph is gone, so nothing of it stays (its inputs included)."""
    _, streamed = plain_and_streamed(p=0.0)
    streamed.eval()
    seen = []
    streamed.layers[0].register_forward_pre_hook(lambda module, args: seen.append(weakref.ref(args[0])))
    for _ in range(3):
        streamed(torch.randn(4, 8))
    gc.collect()
    assert [ref() is None for ref in seen] == [True, True, True]  # nothing but the graph kept them


def test_each_streamed_model_holds_its_own_optimizer_hooks_and_they_go_with_it():
    """No registry of models in the module: each stream() registers its own pair of torch.optim
    step hooks, holding its layer weakly. Two models train side by side with an optimizer each,
    each step reaching its own model only; close() removes its pair, and so does dropping the
    model, which neither the hooks nor the extension keep alive (the extension held the modules,
    which hold the layer: a cycle through C++ that no collector could free)."""
    from torch.optim import optimizer as torch_optimizer

    def hooks():
        return len(torch_optimizer._global_optimizer_pre_hooks), len(torch_optimizer._global_optimizer_post_hooks)

    before = hooks()
    _, first = plain_and_streamed(seed=1, p=0.0)
    _, second = plain_and_streamed(seed=2, p=0.0)
    assert hooks() == (before[0] + 2, before[1] + 2)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, second)]
    for step in range(2):
        for model, optimizer in zip((first, second), optimizers):
            model(torch.randn(4, 8)).backward()
            optimizer.step()
            optimizer.zero_grad()
            assert model.layers.last_report.step == step
    first.layers.close()
    assert hooks() == (before[0] + 1, before[1] + 1)
    layer = weakref.ref(second.layers._layer())
    del second, optimizers, model, optimizer  # the loop's names held the last pair
    gc.collect()
    assert layer() is None and hooks() == before


def test_an_evaluation_under_eval_mode_without_no_grad_is_not_a_training_pass():
    _, streamed = plain_and_streamed(p=0.0)
    optimizer = torch.optim.SGD(streamed.parameters(), lr=0.1)
    streamed.eval()
    streamed(torch.randn(4, 8))  # grad mode on: a graph, but no backward
    streamed.train()
    streamed(torch.randn(4, 8)).backward()
    optimizer.step()
    report = streamed.layers.last_report
    assert report.training_passes == 1 and 0 < report.eval_h2d_bytes < report.h2d_bytes


def test_a_tensor_the_block_reads_without_registering_it_gets_its_gradient():
    torch.manual_seed(3)
    gate = torch.nn.Parameter(torch.randn(DIM))

    class Gated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(DIM, DIM)

        def forward(self, h):
            return h + self.fc(h) * gate

    blocks = torch.nn.ModuleList(Gated() for _ in range(2))
    plain = bf16_rounded(torch.nn.Module(), layers="blocks") if False else copy.deepcopy(blocks)
    with torch.no_grad():
        for p in plain.parameters():
            if p.dim() == 2:
                p.copy_(p.to(torch.bfloat16).float())
    x = torch.randn(4, DIM)
    h = x
    for b in plain:
        h = b(h)
    h.sum().backward()
    expected = gate.grad.clone()
    gate.grad = None
    streamed = sp.stream(blocks, config=ALL_BF16)
    h = x
    for b in streamed:
        h = b(h)
    h.sum().backward()
    torch.testing.assert_close(gate.grad, expected)


def test_ddp_over_the_rest_of_the_model_leaves_the_streamed_blocks_to_the_layer(tmp_path):
    """DDP averages the parameters outside the streamed blocks during the backward; the blocks'
    own are the layer's (it averages them itself with a process_group), so DDP is told to
    ignore them, as it is told for any parameter another mechanism reduces. The optimizer's hook
    then averages only what DDP did not: nothing after a synced backward, DDP's own after a
    backward under no_sync()."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method="file://%s" % (tmp_path / "init"), rank=0, world_size=1)
    try:
        plain, streamed = plain_and_streamed(p=0.0)
        ignored = [n for n, _ in streamed.named_parameters() if n.startswith("layers.")]
        DDP._set_params_and_buffers_to_ignore_for_model(streamed, ignored)
        model = DDP(streamed)
        x = torch.randn(4, 8)
        for m in (plain, model):
            m(x).backward()
        for name, g in grads(plain).items():
            torch.testing.assert_close(streamed.get_parameter(name).grad, g, rtol=1e-6, atol=1e-7, msg=name)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        layer = streamed.layers._layer()
        assert layer.rest_to_average(optimizer) == []  # DDP averaged them in the backward
        optimizer.step()
        assert streamed.layers.last_report.step == 0
        optimizer.zero_grad()
        with model.no_sync():
            model(x).backward()
        outside = [p for n, p in streamed.named_parameters() if not n.startswith("layers.")]
        assert outside and {id(p) for p in layer.rest_to_average(optimizer)} == {id(p) for p in outside}
        optimizer.step()
        assert streamed.layers.last_report.step == 1
    finally:
        dist.destroy_process_group()


def test_a_frozen_base_with_trainable_adapters_ends_its_steps_at_the_adapters_optimizer():
    """LoRA on a frozen base: the streamed weights train not, the adapters (resident parameters of
    the blocks) do; the optimizer that steps them ends the layer's step, and one that steps
    neither (the embeddings') is left alone."""

    class Adapted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(DIM, DIM)
            self.fc.weight.requires_grad_(False)
            self.lora_a = torch.nn.Parameter(torch.randn(4, DIM) * 0.1)
            self.lora_b = torch.nn.Parameter(torch.zeros(DIM, 4))

        def forward(self, h):
            return h + self.fc(h) + h @ self.lora_a.t() @ self.lora_b.t()

    torch.manual_seed(4)
    embed = torch.nn.Linear(8, DIM)
    layers = sp.stream(torch.nn.ModuleList(Adapted() for _ in range(2)), config=ALL_BF16, streamed=["fc.weight"],
                       moments_from=["lora_a", "lora_b"])
    adapters = torch.optim.AdamW([p for n, p in layers.named_parameters() if "lora" in n], lr=1e-2)
    embeddings = torch.optim.SGD(embed.parameters(), lr=0.1)
    for step in range(2):
        h = embed(torch.randn(4, 8))
        for layer in layers:
            h = layer(h)
        h.square().mean().backward()
        embeddings.step()
        assert layers.last_report is None or layers.last_report.step == step - 1
        adapters.step()
        assert layers.last_report.step == step
        assert len(layers.last_moments) == 2
        for opt in (adapters, embeddings):
            opt.zero_grad()


def test_a_transfer_policy_keeps_blocks_bf16_where_the_quantized_route_does_not_pay(tmp_path):
    """The plugin forces INT8 on block 1; the machine's transfer policy lets it through only
    where INT8 was measured faster, and an unreadable policy allows no quantized route."""
    def policy(name, int8_rules):
        path = tmp_path / name
        path.write_text('{"format": "sp-transfer-policy", "version": 1, "speedup_threshold": 1.0, "sources": '
                        '[{"machine": "test", "backend": "host", "device": "fixed"}], "rules": {"int8_frozen": %s, '
                        '"int8_trained": %s}}' % (int8_rules, int8_rules))
        return str(path)

    forced = {"telemetry_enabled": False, "mode": "static", "tiers": ["bf16", "int8"], "force_int8_blocks": [1]}
    pays = '[{"min_bytes": 0, "max_bytes": null, "measured_speedup": 2.0}]'
    for transfer_policy, routes in ((None, ["bf16", "int8"]), (policy("pays.json", pays), ["bf16", "int8"]),
                                    (policy("never.json", "[]"), ["bf16", "bf16"]),
                                    (str(tmp_path / "absent.json"), ["bf16", "bf16"])):
        torch.manual_seed(3)
        model = Model(blocks=2, p=0.0)
        model.layers = sp.stream(model.layers, config=forced, transfer_policy=transfer_policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):  # the plugin's first hints come after the first step
            model(torch.randn(4, 8)).backward()
            optimizer.step()
            optimizer.zero_grad()
        assert model.layers.routes() == routes, transfer_policy
        model.layers.close()



def test_the_options_are_one_typed_object_or_its_fields_as_keywords():
    torch.manual_seed(3)
    blocks = Model(p=0.0).layers
    by_object = sp.stream(copy.deepcopy(blocks), config=ALL_BF16, options=sp.StreamOptions(recompute=True))
    by_keywords = sp.stream(copy.deepcopy(blocks), config=ALL_BF16, recompute=True)
    assert by_object._layer().recomputes and by_keywords._layer().recomputes
    assert not sp.stream(copy.deepcopy(blocks), config=ALL_BF16)._layer().recomputes  # one process: kept
    with pytest.raises(TypeError, match=r"give the options once.*\['device'\]"):
        sp.stream(copy.deepcopy(blocks), options=sp.StreamOptions(), device="cpu")
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['prefetch'\]; known: .*'prefetch_window'"):
        sp.stream(copy.deepcopy(blocks), prefetch=2)
    with pytest.raises(TypeError, match="options= expected a selective_precision.StreamOptions, got dict"):
        sp.StreamedBlocks(copy.deepcopy(blocks), streamed=["fc.weight"], options={"device": "cpu"})
    with pytest.raises(TypeError, match="recompute= expected True, False or None, got str"):
        sp.StreamOptions(recompute="yes")
    with pytest.raises(TypeError):
        sp.StreamOptions("cpu")  # keyword-only


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("an error in the backward (out of memory, say)")


def test_what_plain_pytorch_allows_around_the_blocks_trains_as_plain_pytorch():
    """Found by an adversarial review of the kept activations. Each trains as plain PyTorch, and
    the model trains on afterwards: an output changed in place; a block returning a view of its
    own weight; a loss on a lower block's output alone; a gradient asked of an output above block
    0; an error inside a block's backward."""
    plain, streamed = plain_and_streamed(p=0.0)
    x = torch.randn(4, 8)
    pe = (torch.full((DIM,), 0.9), torch.full((DIM,), 0.01))

    def run(model, lowest_loss=False, inplace=False, weight_view=False):
        h, outputs = model.embed(x), []
        for layer in model.layers:
            h, _ = layer(h, position_embeddings=pe)
            if inplace:
                h.mul_(0.9)
            outputs.append(h)
        loss = outputs[0].square().mean() if lowest_loss else model.head(h).square().mean()
        if weight_view:
            loss = loss + model.layers[1].fc.weight.t().square().mean()
        return loss, outputs

    for case in ({"inplace": True}, {"lowest_loss": True}):
        for model in (plain, streamed):
            model.zero_grad()
            run(model, **case)[0].backward()
        for name, want in grads(plain).items():
            torch.testing.assert_close(dict(streamed.named_parameters())[name].grad, want, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: "%s, %s: %s" % (case, name, m))
    # A gradient asked of block 1's output: the pass ends there, and the next one trains.
    loss, outputs = run(streamed)
    (g,) = torch.autograd.grad(loss, [outputs[1]])
    assert g.shape == outputs[1].shape
    # An error inside block 1's backward: the next pass trains.
    original = Block.forward
    try:
        Block.forward = lambda self, h, **kw: original(self, _RaisesInBackward.apply(h), **kw)
        with pytest.raises(ValueError, match="an error in the backward"):
            run(streamed)[0].backward()
    finally:
        Block.forward = original
    streamed.zero_grad()
    run(streamed)[0].backward()
    assert streamed.layers[0].fc.weight.grad is not None


class _WeightViewBlock(Block):
    def forward(self, h, **kwargs):
        y, aux = super().forward(h, **kwargs)
        return y, self.fc.weight.t()  # a view of the delivered weight, which the host reads later


def test_a_block_returning_a_view_of_its_weight_gives_it_memory_of_its_own():
    torch.manual_seed(4)
    plain = bf16_rounded(Model(p=0.0))
    plain.layers = torch.nn.ModuleList(_WeightViewBlock(0.0) for _ in range(3))
    bf16_rounded(plain)
    streamed = copy.deepcopy(plain)
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16)
    x = torch.randn(4, 8)
    pe = (torch.full((DIM,), 0.9), torch.full((DIM,), 0.01))
    for model in (plain, streamed):
        h, regulariser = model.embed(x), 0.0
        for layer in model.layers:
            h, weight_t = layer(h, position_embeddings=pe)
            regulariser = regulariser + weight_t.square().mean()
        (model.head(h).square().mean() + regulariser).backward()
    torch.testing.assert_close(streamed.layers[1].fc.weight.grad, plain.layers[1].fc.weight.grad, rtol=1e-4, atol=1e-6)


def test_what_the_layer_cannot_serve_right_is_refused_by_name():
    """A gradient hook on a master (it would never run), a double backward, and inputs= naming a
    master (it would get no gradient)."""
    _, streamed = plain_and_streamed(p=0.0)
    x = torch.randn(4, 8)
    master = streamed.layers[1].fc.weight
    handle = master.register_hook(lambda g: g * 2)
    with pytest.raises(RuntimeError, match="streamed master 1.fc.weight has a gradient hook"):
        streamed(x)
    handle.remove()
    x_grad = x.clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="create_graph=True reached block2"):
        torch.autograd.grad(streamed(x_grad), [x_grad], create_graph=True)
    with pytest.raises(RuntimeError, match="asks for the gradient of block2's streamed master 'fc.weight'"):
        streamed(x).backward(inputs=[streamed.embed.weight, streamed.layers[2].fc.weight])
    streamed.zero_grad()
    streamed(x).backward()  # and the model trains on
    assert master.grad is not None


class _Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, DIM)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, DIM)) for _ in range(2))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h).float().square().mean()


def test_a_cast_after_stream_keeps_the_masters_and_computes_in_the_new_dtype():
    """model.to(torch.bfloat16) after stream(): the rest of the model casts, the masters stay fp32
    on the host, and the blocks compute in bf16, as the plain model cast the same way. A move to
    another device is refused."""
    torch.manual_seed(8)
    plain = bf16_rounded(_Residual())
    streamed = copy.deepcopy(plain)
    streamed.layers = sp.stream(streamed.layers, config=ALL_BF16)
    streamed.to(torch.bfloat16)
    plain.to(torch.bfloat16)
    assert streamed.layers[0][1].weight.dtype == torch.float32 and streamed.layers[0][1].weight.device.type == "cpu"
    assert streamed.layers[0][0].weight.dtype == torch.bfloat16 and streamed.embed.weight.dtype == torch.bfloat16
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    loss, want = streamed(x), plain(x)
    torch.testing.assert_close(loss, want)
    loss.backward()
    want.backward()
    torch.testing.assert_close(streamed.layers[1][1].weight.grad, plain.layers[1][1].weight.grad.float(), rtol=2e-2,
                               atol=1e-4)
    with pytest.raises(RuntimeError, match=r"streamed block 0 .*would move its streamed parameters"):
        streamed.layers.to("meta")


def test_a_forced_route_holds_from_the_first_fetch_and_for_inference_only():
    """A static policy's forced routes (ABI 1.3's initial hints) stream from the first pass:
    an inference under no_grad before any step computes on the NF4 images, and step 0 moves them."""
    forced = {"mode": "static", "telemetry_enabled": False, "tiers": ["bf16", "int8", "nf4"], "force_nf4_blocks": [1]}
    nf4, bf16 = plain_and_streamed(p=0.0)  # the same weights; bf16 streamed all-BF16
    nf4.layers = sp.stream(nf4.layers, config=forced)
    assert nf4.layers.routes() == ["bf16", "nf4", "bf16"]
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert not torch.equal(nf4(x), bf16(x))  # block 1 computes on its NF4 image already
    nf4(x).backward()
    torch.optim.SGD(nf4.parameters(), lr=0.0).step()
    report = nf4.layers.last_report
    assert report.step == 0 and report.h2d_bytes_nf4 > 0
