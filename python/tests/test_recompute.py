"""A streamed block computes what the same block computes in plain PyTorch, on the same
BF16-rounded weights, with dropout drawing from the random streams and under autocast: keeping
its activations (the default), or recomputing its forward in the backward (recompute=True),
which must then compute what the forward computed."""

import copy

import pytest
import torch

import selective_precision as sp

DIM, BLOCKS = 32, 3
ALL_BF16 = "selective_precision:\n  telemetry_enabled: false\n  mode: off\n"


class DropoutBlock(torch.nn.Module):
    """A residual block with dropout; records the dtype each call computed its matmul in."""

    def __init__(self, p):
        super().__init__()
        self.fc = torch.nn.Linear(DIM, DIM)
        self.drop = torch.nn.Dropout(p)
        self.matmul_dtypes = []

    def forward(self, x):
        h = self.fc(x)
        self.matmul_dtypes.append(h.dtype)
        return x + self.drop(torch.tanh(h))


@pytest.fixture(params=[False, True], ids=["kept", "recompute"])
def recompute(request):
    return request.param


def streamed_and_plain(p, recompute):
    """The blocks streamed, and a plain copy whose streamed weights are rounded to BF16 as the
    layer delivers them."""
    torch.manual_seed(11)
    blocks = torch.nn.ModuleList(DropoutBlock(p) for _ in range(BLOCKS))
    plain = copy.deepcopy(blocks)
    with torch.no_grad():
        for block in plain:
            block.fc.weight.copy_(block.fc.weight.to(torch.bfloat16).float())
    streamed = sp.StreamedBlocks(blocks, streamed=["fc.weight"], config=ALL_BF16, recompute=recompute)
    return blocks, streamed, plain


def run_plain(plain, x):
    h = x
    for block in plain:
        h = block(h)
    return h


def test_dropout_gives_the_gradient_plain_pytorch_gives(recompute):
    blocks, streamed, plain = streamed_and_plain(0.5, recompute)
    x = torch.randn(8, DIM)

    torch.manual_seed(2024)
    streamed.begin_step(0)
    y = streamed(x)
    y.square().mean().backward()
    streamed.post_backward()
    after_streamed = torch.get_rng_state()

    torch.manual_seed(2024)
    y_plain = run_plain(plain, x)
    y_plain.square().mean().backward()
    after_plain = torch.get_rng_state()

    assert torch.equal(y, y_plain), "the forward draws the same dropout masks"
    for b in range(BLOCKS):
        got, want = streamed.masters(b)["fc.weight"].grad, plain[b].fc.weight.grad
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), "block %d: %.3g relative" % (
            b,
            ((got - want).norm() / want.norm()).item(),
        )
        assert torch.allclose(blocks[b].fc.bias.grad, plain[b].fc.bias.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(after_streamed, after_plain), "the recompute leaves the caller's random stream as it was"
    streamed.end_step(0.0)


def test_a_block_under_bf16_autocast_computes_in_bf16_in_every_pass(recompute):
    blocks, streamed, plain = streamed_and_plain(0.0, recompute)
    x = torch.randn(8, DIM)

    streamed.begin_step(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = streamed(x)
    y.float().square().mean().backward()  # outside autocast, as a training loop does
    streamed.post_backward()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_plain = run_plain(plain, x)
    y_plain.float().square().mean().backward()

    for block in blocks:
        assert block.matmul_dtypes == [torch.bfloat16] * (2 if recompute else 1), "forward, then any recompute"
    assert not torch.is_autocast_enabled("cpu"), "the recompute leaves autocast as it found it"
    assert torch.equal(y, y_plain)
    for b in range(BLOCKS):
        got, want = streamed.masters(b)["fc.weight"].grad, plain[b].fc.weight.grad
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), "block %d" % b
    streamed.end_step(0.0)


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_the_recompute_draws_no_numbers_the_forward_did_not(p, recompute):
    """Two steps in a row: the second step's masks are those plain PyTorch draws for it, which
    holds only if the first step's recompute left the stream where the forward left it."""
    blocks, streamed, plain = streamed_and_plain(p, recompute)
    x = torch.randn(8, DIM)
    torch.manual_seed(5)
    outputs = []
    for step in range(2):
        streamed.begin_step(step)
        y = streamed(x)
        y.square().mean().backward()
        streamed.post_backward()
        streamed.end_step(0.0)
        outputs.append(y.detach())
    torch.manual_seed(5)
    for step in range(2):
        y_plain = run_plain(plain, x)
        y_plain.square().mean().backward()
        assert torch.equal(outputs[step], y_plain.detach()), "step %d" % step


def test_a_run_with_dropout_resumes_bit_for_bit(tmp_path, recompute):
    """Six steps straight, against three steps, a save (the layer's state, the optimizer's and
    the random stream), and three steps in a fresh process's worth of objects."""

    def make(seed):
        torch.manual_seed(seed)
        blocks = torch.nn.ModuleList(DropoutBlock(0.3) for _ in range(BLOCKS))
        streamed = sp.StreamedBlocks(blocks, streamed=["fc.weight"], config=ALL_BF16, recompute=recompute)
        optimizer = torch.optim.AdamW(streamed.optimizer_parameters(blocks), lr=1e-2)
        return blocks, streamed, optimizer

    def train(streamed, optimizer, steps, x):
        losses = []
        for step in steps:
            with streamed.step(step, optimizer) as s:
                s.loss = streamed(x).square().mean()
                s.loss.backward()
            losses.append(s.loss.item())
        return losses

    x = torch.randn(8, DIM)
    _, streamed, optimizer = make(31)
    torch.manual_seed(100)
    straight = train(streamed, optimizer, range(6), x)

    blocks, streamed, optimizer = make(31)
    torch.manual_seed(100)
    first = train(streamed, optimizer, range(3), x)
    torch.save(
        {"layer": streamed.export_state(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
         "resident": {n: p for n, p in blocks.named_parameters() if n.endswith("bias")}},
        tmp_path / "checkpoint.pt",
    )
    saved = torch.load(tmp_path / "checkpoint.pt")
    blocks, streamed, optimizer = make(999)  # other initial weights: all must come from the save
    streamed.restore_state(saved["layer"])
    with torch.no_grad():
        for name, p in blocks.named_parameters():
            if name in saved["resident"]:
                p.copy_(saved["resident"][name])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"])
    resumed = train(streamed, optimizer, range(3, 6), x)
    assert first + resumed == straight
