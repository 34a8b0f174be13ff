"""The transfer formats as Python functions: the layer's own kernels, their arrays' shapes, a
round trip within each format's error, the same bytes on any thread count, and named refusals."""

import pytest
import torch

import selective_precision as sp


def _relative_error(x, y):
    return ((x.float() - y.float()).norm() / x.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_round_trips_within_its_error_and_does_not_depend_on_threads(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 256, dtype=dtype)
    codes, scales = sp.quantize_nf4(x, 64, threads=1)
    assert (codes.dtype, codes.shape, scales.dtype, scales.shape) == (torch.uint8, (64, 128), torch.float32, (64, 4))
    again = sp.quantize_nf4(x, 64, threads=2)
    assert torch.equal(codes, again[0]) and torch.equal(scales, again[1])
    y = sp.dequantize_nf4(codes, scales, 64)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    into = torch.empty(64, 256, dtype=torch.bfloat16)
    assert sp.dequantize_nf4(codes, scales, 64, out=into) is into and torch.equal(into, y)
    assert 0.05 < _relative_error(x, y) < 0.15  # NF4 of Gaussian weights: about 10%
    # The scales are the groups' absmax; the layer's images keep them as nearest bfloat16, with
    # the same codes.
    absmax = x.float().abs().reshape(64, 4, 64).amax(dim=2)
    assert torch.equal(scales, absmax)
    codes_bf16, scales_bf16 = sp.quantize_nf4(x, 64, scale_dtype=torch.bfloat16)
    assert torch.equal(codes_bf16, codes) and torch.equal(scales_bf16, absmax.bfloat16())


def test_nf4_codes_sit_two_a_byte_the_first_in_the_high_nibble():
    levels = torch.tensor([-1.0, 1.0] * 32).reshape(1, 64)  # code 0 at even columns, 15 at odd ones
    codes, scales = sp.quantize_nf4(levels, 64)
    assert torch.all(codes == 0x0F) and scales.item() == 1.0


# --- NF4 against bitsandbytes, QLoRA's reference implementation (its CPU backend) ---------------

@pytest.fixture
def bnb_functional():
    """bitsandbytes.functional (a test dependency, pinned in requirements.txt); its tests skip
    where it is not installed, such as a lent GPU machine's own Python."""
    return pytest.importorskip("bitsandbytes.functional")


def _nf4_inputs(bnb_functional):
    """Seeded inputs whose rows are a multiple of 64 long, by name."""
    g = torch.Generator().manual_seed(31)
    gaussian = torch.randn(48, 512, generator=g) * 0.02
    student_t3 = torch.distributions.StudentT(3.0).sample((48, 512))
    zeros = torch.zeros(4, 128)
    # Ties: a group whose absmax is 1, so x * (1 / absmax) is x, holding the bucket bounds
    # bitsandbytes compares against and their float32 neighbours; and the same group negated.
    code = bnb_functional.get_4bit_type("nf4", device="cpu").sort().values
    bounds = (code[:-1] + code[1:]) / 2
    group = torch.cat([torch.ones(1), bounds, bounds.nextafter(torch.tensor(2.0)),
                       bounds.nextafter(torch.tensor(-2.0)), torch.zeros(64 - 1 - 3 * bounds.numel())])
    ties = torch.cat([group, -group]).reshape(1, 128)
    # Scales far from 1: huge, tiny, and an absmax below bitsandbytes' 1e-38 clamp.
    ranges = torch.cat([torch.randn(1, 128, generator=g) * s for s in (1e30, 1e-30, 1e-39)])
    return {"gaussian": gaussian, "student_t3": student_t3, "zeros": zeros, "ties": ties, "ranges": ranges}


@pytest.mark.parametrize("name", ["gaussian", "student_t3", "zeros", "ties", "ranges"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_codes_and_scales_are_bitsandbytes_byte_for_byte(bnb_functional, name, dtype):
    x = _nf4_inputs(bnb_functional)[name].to(dtype)
    packed, state = bnb_functional.quantize_4bit(x, blocksize=64, quant_type="nf4")
    codes, scales = sp.quantize_nf4(x, 64)
    assert torch.equal(codes.flatten(), packed.flatten()), name
    assert torch.equal(scales.flatten(), state.absmax.flatten()), name
    # Dequantized with the float32 scales: bitsandbytes' float32 values exactly, and those
    # rounded to nearest bfloat16. bitsandbytes' own bfloat16 output (its C++ CPU kernel) is the
    # same, except that on a CPU with AVX-512 it flushes subnormal results to zero, where this
    # keeps them (without AVX-512 it keeps them too: an AMD EPYC here without it, 2026-11-27).
    state.dtype = torch.float32
    expected = bnb_functional.dequantize_4bit(packed, state).reshape(x.shape)
    assert torch.equal(sp.dequantize_nf4(codes, scales, 64, dtype=torch.float32), expected), name
    actual = sp.dequantize_nf4(codes, scales, 64, dtype=torch.bfloat16)
    assert torch.equal(actual, expected.bfloat16()), name
    state.dtype = torch.bfloat16
    bnb_bf16 = bnb_functional.dequantize_4bit(packed, state).reshape(x.shape)
    subnormal = (actual.float().abs() < torch.finfo(torch.float32).tiny) & (actual != 0)
    assert torch.equal(actual[~subnormal], bnb_bf16[~subnormal]), name
    flushed_or_same = (bnb_bf16[subnormal] == 0) | (bnb_bf16[subnormal] == actual[subnormal])
    assert torch.all(flushed_or_same), name


def test_nf4_with_the_layers_bfloat16_scales_is_within_one_bfloat16_step_of_bitsandbytes(bnb_functional):
    x = _nf4_inputs(bnb_functional)["student_t3"]
    packed, state = bnb_functional.quantize_4bit(x, blocksize=64, quant_type="nf4")
    state.dtype = torch.bfloat16
    expected = bnb_functional.dequantize_4bit(packed, state).reshape(x.shape)
    codes, scales = sp.quantize_nf4(x, 64, scale_dtype=torch.bfloat16)
    actual = sp.dequantize_nf4(codes, scales, 64)
    steps = (actual.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert steps.max().item() <= 1
    assert torch.equal(actual.sign(), expected.sign())


def test_nf4_of_nan_and_inf_is_defined_where_bitsandbytes_leaves_it_open():
    # bitsandbytes propagates NaN into its absmax and codes whatever its bucketing gives; here a
    # group holding NaN or +-Inf has scale NaN and codes 7 (level 0), and dequantizes to NaN,
    # while the row's other groups are untouched.
    x = torch.randn(3, 128)
    x[0, 5], x[1, 70], x[2, 0] = float("nan"), float("inf"), float("-inf")
    codes, scales = sp.quantize_nf4(x, 64)
    poisoned = torch.tensor([[True, False], [False, True], [True, False]])
    assert torch.equal(scales.isnan(), poisoned)
    nibbles = torch.stack([codes >> 4, codes & 15], dim=2).reshape(3, 2, 64)
    assert torch.all(nibbles[poisoned] == 7)
    y = sp.dequantize_nf4(codes, scales, 64, dtype=torch.float32).reshape(3, 2, 64)
    assert torch.all(y[poisoned].isnan()) and not torch.any(y[~poisoned].isnan())
    clean = x.clone()
    clean[poisoned.repeat_interleave(64, dim=1)] = 0.0
    clean_codes, _ = sp.quantize_nf4(clean, 64)
    keep = (~poisoned).repeat_interleave(32, dim=1)
    assert torch.equal(codes[keep], clean_codes[keep])


def test_int8_round_trips_within_its_error_per_row_and_per_group():
    torch.manual_seed(1)
    x = torch.randn(32, 256)
    for group_size, groups in ((0, 1), (64, 4)):
        codes, scales = sp.quantize_int8(x, group_size)
        assert (codes.dtype, codes.shape, scales.shape) == (torch.int8, (32, 256), (32, groups))
        y = sp.dequantize_int8(codes, scales, group_size, dtype=torch.float32)
        assert _relative_error(x, y) < 0.01
        assert torch.equal(codes, sp.quantize_int8(x, group_size, threads=1)[0])


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="quantize_nf4: a 2-D tensor expected, got 1 dimensions"):
        sp.quantize_nf4(torch.zeros(8))
    with pytest.raises(ValueError, match="quantize_nf4: 3 columns: an even number expected"):
        sp.quantize_nf4(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="quantize_nf4: group_size 48"):
        sp.quantize_nf4(torch.zeros(2, 64), 48)
    with pytest.raises(ValueError, match="quantize_nf4: scale_dtype torch.float32 or torch.bfloat16 expected"):
        sp.quantize_nf4(torch.zeros(2, 64), scale_dtype=torch.float16)
    with pytest.raises(ValueError, match="quantize_int8: float32 or bfloat16 expected, got Half"):
        sp.quantize_int8(torch.zeros(2, 2, dtype=torch.float16))
    codes, scales = sp.quantize_nf4(torch.randn(4, 128))
    with pytest.raises(ValueError, match=r"scales: a float32 or bfloat16 CPU tensor of shape \(4, 2\) expected"):
        sp.dequantize_nf4(codes, scales[:, :1])
    with pytest.raises(ValueError, match="dtype torch.float32 or torch.bfloat16 expected"):
        sp.dequantize_nf4(codes, scales, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dequantize_nf4: out: a contiguous BFloat16 CPU tensor of shape \(4, 128\)"):
        sp.dequantize_nf4(codes, scales, out=torch.empty(4, 128))
