"""``check_payload``: exactly the finite payloads pass, in every page dtype, wherever a bad value sits."""

import pytest
import torch

from mmtier.config import ModalitySpec
from mmtier.errors import DTypeError
from mmtier.pages.payload import check_payload

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _spec(dtype: str) -> ModalitySpec:
    return ModalitySpec(name="text", page_size=16, num_layers=2, num_kv_heads=3, head_dim=8, dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_finite_payloads_pass_including_the_dtype_extremes(dtype):
    spec, tdt = _spec(dtype), DTYPES[dtype]
    t = torch.randn(2, 37, 3, 8).to(tdt)
    check_payload(spec, t)
    big = torch.finfo(tdt).max                 # finite extremes whose float32 sum would overflow
    t.view(-1)[::5] = big
    t.view(-1)[1::5] = -big
    check_payload(spec, t)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_value_anywhere_is_refused(dtype, poison):
    spec, tdt = _spec(dtype), DTYPES[dtype]
    g = torch.Generator().manual_seed(hash((dtype, str(poison))) & 0xFFFF)
    for _ in range(8):
        t = torch.randn(2, 37, 3, 8, generator=g).to(tdt)
        t.view(-1)[int(torch.randint(t.numel(), (1,), generator=g))] = poison
        with pytest.raises(DTypeError, match="NaN or Inf"):
            check_payload(spec, t)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_finite_values_whose_sum_overflows_pass(dtype):
    """The one-pass sum overflows to Inf on these finite values: the exact check decides."""
    spec, tdt = _spec(dtype), DTYPES[dtype]
    t = torch.randn(2, 37, 3, 8).to(tdt).abs() + 1
    t.view(-1)[::3] = torch.finfo(tdt).max
    assert not torch.isfinite(t.sum())
    check_payload(spec, t)
    t.view(-1)[7] = float("nan")
    with pytest.raises(DTypeError, match="NaN or Inf"):
        check_payload(spec, t)
