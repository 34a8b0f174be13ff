"""The layer's host optimizer as a Python function (sp.adamw_step_): AdamW as torch computes it,
the same bytes on any thread count, the fused image equal to quantizing the updated weights, and
named refusals."""

import pytest
import torch

import selective_precision as sp
from selective_precision._selective_precision import _ROUTES


def _state(seed, shapes=((64, 128), (128,))):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(*s, generator=g) for s in shapes]
    grads = [torch.randn(*s, generator=g) for s in shapes]
    return params, grads, [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]


def test_three_steps_follow_torch_adamw():
    params, grads, m, v = _state(0)
    reference = [torch.nn.Parameter(p.clone()) for p in params]
    optimizer = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for step in (1, 2, 3):
        assert sp.adamw_step_(params, grads, m, v, lr=1e-2, step=step, betas=(0.9, 0.99), weight_decay=0.1) is None
        for p, g in zip(reference, grads):
            p.grad = g
        optimizer.step()
    for ours, theirs in zip(params, reference):
        torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(m, reference):
        torch.testing.assert_close(ours, optimizer.state[theirs]["exp_avg"], rtol=1e-6, atol=1e-7)


def test_the_result_does_not_depend_on_threads():
    one, two = _state(1), _state(1)
    sp.adamw_step_(*one, lr=1e-3, step=1, threads=1)
    sp.adamw_step_(*two, lr=1e-3, step=1, threads=2)
    for a, b in zip(one, two):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_the_fused_nf4_image_holds_the_codes_of_the_updated_weights():
    params, grads, m, v = _state(2, shapes=((64, 256),))
    image = sp.adamw_step_(params, grads, m, v, lr=1e-3, step=1, image="nf4")
    assert image.dtype == torch.uint8
    assert bytes(image[:4].tolist()) == b"SLAB"
    codes, scales = sp.quantize_nf4(params[0], 64, scale_dtype=torch.bfloat16)
    # One tensor: its codes at the first 256-aligned offset after the header and entry.
    assert torch.equal(image[256:256 + codes.numel()], codes.flatten())
    first_scale = 256 + codes.numel()
    assert torch.equal(image[first_scale:first_scale + 2 * scales.numel()], scales.flatten().view(torch.uint8))
    # The next step writes into the same image.
    again = sp.adamw_step_(params, grads, m, v, lr=1e-3, step=2, image="nf4", out=image)
    assert again is image
    assert torch.equal(image[256:256 + codes.numel()], sp.quantize_nf4(params[0], 64)[0].flatten())


def test_bad_arguments_are_refused_by_name():
    params, grads, m, v = _state(3)
    with pytest.raises(ValueError, match="adamw_step_: step 0: the first step is 1"):
        sp.adamw_step_(params, grads, m, v, lr=1e-3, step=0)
    with pytest.raises(ValueError, match=r"grads\[1\]: a contiguous float32 CPU tensor of the shape of params\[1\]"):
        sp.adamw_step_(params, [grads[0], grads[1][:64]], m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="2 params, 1 grads"):
        sp.adamw_step_(params, grads[:1], m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="out: a contiguous, 16-byte aligned uint8 CPU tensor of"):
        sp.adamw_step_(params, grads, m, v, lr=1e-3, step=1, image="bf16", out=torch.empty(7, dtype=torch.uint8))
    quoted = ["'%s'" % r for r in _ROUTES]  # the build's routes: 'bf16', 'int8' or 'nf4'
    with pytest.raises(ValueError, match="image 'fp8': None, %s or %s expected" % (", ".join(quoted[:-1]), quoted[-1])):
        sp.adamw_step_(params, grads, m, v, lr=1e-3, step=1, image="fp8")
