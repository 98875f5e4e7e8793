"""fusion_passes.numerics' fp8 code comparisons: what they accept and what they reject."""

import torch

from fusion_passes.numerics import fp8_codes_apart, fp8_codes_equal, fp8_nan_codes


def _codes(*values):
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn)


def test_nan_codes_of_either_sign_are_one_value():
    assert fp8_nan_codes(_codes(0x7F, 0xFF, 0x7E, 0x00)).tolist() == [True, True, False, False]
    assert fp8_codes_equal(_codes(0x7F, 0x01, 0x80), _codes(0xFF, 0x01, 0x80))


def test_codes_equal_rejects_any_other_difference():
    expected = _codes(0x7F, 0x01, 0x80, 0x7E)
    assert not fp8_codes_equal(_codes(0x7F, 0x02, 0x80, 0x7E), expected)  # a neighbouring code
    assert not fp8_codes_equal(_codes(0x7F, 0x01, 0x00, 0x7E), expected)  # -0 against +0
    assert not fp8_codes_equal(_codes(0x7E, 0x01, 0x80, 0x7E), expected)  # 448 where NaN was
    assert not fp8_codes_equal(_codes(0x7F, 0x01, 0x80, 0x7F), expected)  # NaN where 448 was


def test_codes_apart_counts_steps_across_zero():
    assert fp8_codes_apart(_codes(0x01, 0x80), _codes(0x02, 0x00)) == 1
    assert fp8_codes_apart(_codes(0x81), _codes(0x01)) == 2
