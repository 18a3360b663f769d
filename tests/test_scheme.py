"""One scheme from the command line to the kernel: Scheme.of applies the one bandwidth rule, a
scheme's JSON round-trips (old checkpoints' too), its masks replay from (seed, tag, layer, head), and
the run-time PositionState is a Scheme."""
import subprocess
import sys

import numpy as np
import pytest

from poslsh_cli.attention.scheme import Position, Scheme, model_label, randomized
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.numerics.sampling import alibi_sigmas, derive_seed, sample_partitions


def test_the_bandwidth_rule_is_the_schemes():
    own = np.array([3.0, 5.0, 7.0, 9.0])
    assert np.array_equal(Scheme.of("alibi", 4, sigma=8.0).sigmas, np.full(4, 8.0))
    assert np.array_equal(Scheme.of("alibi", 4, model_sigmas=own).sigmas, own)
    assert np.allclose(Scheme.of("alibi", 4, model_sigmas=own, alibi="standard").sigmas, alibi_sigmas(4))
    assert np.allclose(Scheme.of("poslsh", 8, s=10).sigmas, alibi_sigmas(8))
    with pytest.raises(ValueError, match="alibi=model"):
        Scheme.of("alibi", 4, alibi="model")
    with pytest.raises(ValueError, match="give one"):
        Scheme.of("alibi", 4, sigma=8.0, model_sigmas=own, alibi="model")


def test_a_scheme_is_named_by_its_label():
    assert Scheme.of("poslsh", 4, s=100).label == "poslsh s=100"
    assert Scheme.of("poslsh", 4, s=20, sampler="sobol").label == "poslsh s=20 sobol"
    assert Scheme.of("alibi", 4, s=100).label == "alibi"  # s is read only where masks are drawn
    assert Scheme.of("rope", 4).label == model_label("rope")
    assert randomized(Position.POSLSH) and not randomized(Position.ROPE) and Scheme.of("poslsh", 2).draws


def test_a_schemes_json_round_trips_and_old_checkpoints_load():
    sch = Scheme.of("poslsh", 4, sigma=8.0, s=20, seed=3, sampler="stratified", window_sigmas=2.0, backend="blocks")
    d = sch.to_json()
    assert d == {"position": "poslsh", "sigmas": [8.0] * 4, "s": 20, "window_sigmas": 2.0, "seed": 3,
                 "backend": "blocks", "sampler": "stratified"}
    back = Scheme.from_json(d)
    assert back.to_json() == d and back.label == sch.label
    assert "sampler" not in Scheme.of("poslsh", 2, s=2).to_json()  # iid, the default, is not written
    old = {"position": "poslsh", "sigmas": [8.0, 8.0], "num_samples": 10, "window_sigmas": 4.0, "seed": 0,
           "backend": "auto"}
    assert Scheme.from_json(old).s == 10 and Scheme.saved_s(old) == 10 and Scheme.saved_s({}) == 0
    # the run-time state saves the same JSON, plus native for an ALiBi checkpoint's own attention
    state = PositionState.from_json(d)
    assert isinstance(state, Scheme) and state.to_json() == d
    native = PositionState.of("alibi", 2, sigma=4.0, native=True)
    assert native.to_json()["native"] is True and PositionState.from_json(native.to_json()).native


def test_masks_replay_from_seed_tag_layer_and_head():
    sch = Scheme.of("poslsh", 3, sigma=6.0, s=5, seed=11)
    spec = sch.attention_spec(layer=2, n=64, tag=("step", 7))
    for h, part in enumerate(spec.partitions):
        want = sample_partitions(64, 6.0, 5, np.random.default_rng(derive_seed(11, "masks", "step", 7, 2, h)))
        assert np.array_equal(part.widths, want.widths) and np.array_equal(part.shifts, want.shifts)
    # the training state draws the same masks at its step, and others at the next
    state = PositionState.of("poslsh", 3, sigma=6.0, s=5, seed=11)
    state.step = 7
    assert np.array_equal(state.attention_spec(2, 64).bin_table[0], spec.bin_table[0])
    state.step = 8
    assert not np.array_equal(state.attention_spec(2, 64).bin_table[1], spec.bin_table[1])
    state.eval_key = "val"
    ev = state.attention_spec(2, 64)
    assert np.array_equal(ev.bin_table[1], sch.attention_spec(2, 64, tag=("eval", "val")).bin_table[1])


def test_a_schemes_plan_is_the_plans():
    torch = pytest.importorskip("torch")
    from poslsh_cli.attention.plan import plan_for

    q = torch.zeros(1, 2, 300, 8)
    sch = Scheme.of("poslsh", 2, sigma=4.0, s=100)
    assert sch.plan(q, q, q) == plan_for(sch.method, q, q, q, True, s=100)
    assert Scheme.of("poslsh", 2, sigma=4.0, s=2, backend="blocks").plan(q, q, q).backend.value == "blocks"


def test_the_scheme_module_imports_no_torch():
    code = "import sys, poslsh_cli.attention.scheme; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
