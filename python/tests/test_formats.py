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
    assert (codes.dtype, codes.shape, scales.dtype, scales.shape) == (torch.uint8, (64, 128), torch.bfloat16, (64, 4))
    again = sp.quantize_nf4(x, 64, threads=2)
    assert torch.equal(codes, again[0]) and torch.equal(scales, again[1])
    y = sp.dequantize_nf4(codes, scales, 64)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    into = torch.empty(64, 256, dtype=torch.bfloat16)
    assert sp.dequantize_nf4(codes, scales, 64, out=into) is into and torch.equal(into, y)
    assert 0.05 < _relative_error(x, y) < 0.15  # NF4 of Gaussian weights: about 10%
    # Every scale is its group's absmax rounded up to bfloat16, so no value grows past it.
    absmax = x.float().abs().reshape(64, 4, 64).amax(dim=2)
    assert torch.all(scales.float() >= absmax) and torch.all(scales.float() < absmax * 1.01)


def test_nf4_codes_sit_two_a_byte_an_even_column_in_the_low_nibble():
    levels = torch.tensor([-1.0, 1.0] * 32).reshape(1, 64)  # code 0 at even columns, 15 at odd ones
    codes, scales = sp.quantize_nf4(levels, 64)
    assert torch.all(codes == 0xF0) and scales.item() == 1.0


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
    with pytest.raises(ValueError, match="quantize_int8: float32 or bfloat16 expected, got Half"):
        sp.quantize_int8(torch.zeros(2, 2, dtype=torch.float16))
    codes, scales = sp.quantize_nf4(torch.randn(4, 128))
    with pytest.raises(ValueError, match=r"scales: a bfloat16 CPU tensor of shape \(4, 2\) expected"):
        sp.dequantize_nf4(codes, scales[:, :1])
    with pytest.raises(ValueError, match="dtype torch.float32 or torch.bfloat16 expected"):
        sp.dequantize_nf4(codes, scales, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"dequantize_nf4: out: a contiguous BFloat16 CPU tensor of shape \(4, 128\)"):
        sp.dequantize_nf4(codes, scales, out=torch.empty(4, 128))
