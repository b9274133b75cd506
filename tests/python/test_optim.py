"""megacore.optim: DynamicLossScaler against an independent statement of its rule, state round trip,
config errors, and the DDP bucket-size default."""

import pytest

import megacore
from megacore import optim


def reference_scales(pattern, scale, interval, hysteresis, lo, hi):
    good, hyst, out = 0, hysteresis, []
    for inf in pattern:
        if inf:
            good = 0
            hyst -= 1
            if hyst <= 0:
                scale, hyst = max(scale * 0.5, lo), 0
        else:
            good += 1
            if good == interval:
                good, hyst, scale = 0, hysteresis, min(scale * 2.0, hi)
        out.append(scale)
    return out


def test_loss_scaler_follows_the_rule():
    cfg = optim.LossScalerConfig(initial_scale=1024.0, growth_interval=3, hysteresis=2, min_scale=256.0,
                                 max_scale=4096.0)
    s = optim.DynamicLossScaler(cfg)
    pattern = [False] * 3 + [True, False, True, True, True, True, True] + [False] * 16
    want = reference_scales(pattern, 1024.0, 3, 2, 256.0, 4096.0)
    got = []
    for inf in pattern:
        s.update(inf)
        got.append(s.scale)
    assert got == want
    assert s.inv_scale == 1.0 / s.scale
    t = optim.DynamicLossScaler(cfg)
    t.load_state(s.state())
    assert t.state() == s.state()


def test_loss_scaler_errors():
    with pytest.raises(megacore.ConfigError, match="growth_factor"):
        optim.DynamicLossScaler(optim.LossScalerConfig(growth_factor=0.5))
    s = optim.DynamicLossScaler()
    with pytest.raises(megacore.ValueError, match="scale"):
        s.load_state({"scale": -1.0, "growth_tracker": 0, "hysteresis_tracker": 0})


def test_default_bucket_size():
    assert optim.default_bucket_size(1) == 40_000_000
    assert optim.default_bucket_size(128) == 128_000_000
