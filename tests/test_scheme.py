"""One scheme from the command line to the kernel: Scheme.from_keys, the one constructor from a
command's keys, applies the one bandwidth rule; the scheme vocabulary is declared where a reader sees
it; a scheme's JSON round-trips (old checkpoints' too, through the one migration), its masks replay from (seed, tag, layer, head), and
the run-time PositionState is a Scheme."""
import subprocess
import sys

import numpy as np
import pytest

from poslsh_cli.attention.scheme import SCHEME_LAYOUT, Position, Scheme, SchemeKeys, model_label, randomized
from poslsh_cli.lm.positions import PositionState
from poslsh_cli.numerics.methods import Method
from poslsh_cli.numerics.sampling import alibi_sigmas, derive_seed, sample_partitions


def of(cls, position, heads, model_sigmas=None, native=None, **keys):
    """The scheme the keys name, as a command builds it (Scheme.from_keys)."""
    return cls.from_keys(SchemeKeys(position, **keys), heads, model_sigmas,
                         **({} if native is None else {"native": native}))


def test_the_bandwidth_rule_is_the_schemes():
    own = np.array([3.0, 5.0, 7.0, 9.0])
    assert np.array_equal(of(Scheme, "alibi", 4, sigma=8.0).sigmas, np.full(4, 8.0))
    assert np.array_equal(of(Scheme, "alibi", 4, model_sigmas=own).sigmas, own)
    assert np.allclose(of(Scheme, "alibi", 4, model_sigmas=own, alibi="standard").sigmas, alibi_sigmas(4))
    assert np.allclose(of(Scheme, "poslsh", 8, s=10).sigmas, alibi_sigmas(8))
    with pytest.raises(ValueError, match="alibi=model"):
        of(Scheme, "alibi", 4, alibi="model")
    with pytest.raises(ValueError, match="give one"):
        of(Scheme, "alibi", 4, sigma=8.0, model_sigmas=own, alibi="model")


def test_a_scheme_is_named_by_its_label():
    assert of(Scheme, "poslsh", 4, s=100).label == "poslsh s=100"
    assert of(Scheme, "poslsh", 4, s=20, sampler="sobol").label == "poslsh s=20 sobol"
    assert of(Scheme, "alibi", 4, s=100).label == "alibi" and of(Scheme, "alibi", 4, s=100).s == 0  # no masks
    assert of(Scheme, "rope", 4).label == model_label("rope")
    assert randomized(Position.POSLSH) and not randomized(Position.ROPE) and of(Scheme, "poslsh", 2).draws


def test_a_schemes_json_round_trips_and_old_checkpoints_load():
    sch = of(Scheme, "poslsh", 4, sigma=8.0, s=20, seed=3, sampler="stratified", window_sigmas=2.0, backend="blocks")
    d = sch.to_json()
    assert d == {"layout": SCHEME_LAYOUT, "position": "poslsh", "sigmas": [8.0] * 4, "s": 20, "window_sigmas": 2.0, "seed": 3,
                 "backend": "blocks", "sampler": "stratified"}
    back = Scheme.from_json(d)
    assert back.to_json() == d and back.label == sch.label
    assert "sampler" not in of(Scheme, "poslsh", 2, s=2).to_json()  # iid, the default, is not written
    old = {"position": "poslsh", "sigmas": [8.0, 8.0], "num_samples": 10, "window_sigmas": 4.0, "seed": 0,
           "backend": "auto"}
    assert Scheme.from_json(old).s == 10 and Scheme.from_json({**old, "layout": 1}).s == 10
    with pytest.raises(Exception, match="layout 3, newer than this poslsh reads"):
        Scheme.from_json({**d, "layout": 3}, "ck/config.json")
    # the run-time state saves the same JSON, plus native for an ALiBi checkpoint's own attention
    state = PositionState.from_json(d)
    assert isinstance(state, Scheme) and state.to_json() == d
    native = of(PositionState, "alibi", 2, sigma=4.0, native=True)
    assert native.to_json()["native"] is True and PositionState.from_json(native.to_json()).native


def test_masks_replay_from_seed_tag_layer_and_head():
    sch = of(Scheme, "poslsh", 3, sigma=6.0, s=5, seed=11)
    spec = sch.attention_spec(layer=2, n=64, tag=("step", 7))
    for h, part in enumerate(spec.partitions):
        want = sample_partitions(64, 6.0, 5, np.random.default_rng(derive_seed(11, "masks", "step", 7, 2, h)))
        assert np.array_equal(part.widths, want.widths) and np.array_equal(part.shifts, want.shifts)
    # the training state draws the same masks at its step, and others at the next
    state = of(PositionState, "poslsh", 3, sigma=6.0, s=5, seed=11)
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
    sch = of(Scheme, "poslsh", 2, sigma=4.0, s=100)
    assert sch.plan(q, q, q) == plan_for(sch.method, q, q, q, True, s=100)
    assert of(Scheme, "poslsh", 2, sigma=4.0, s=2, backend="blocks").plan(q, q, q).backend.value == "blocks"


def test_the_scheme_module_imports_no_torch():
    code = "import sys, poslsh_cli.attention.scheme; assert 'torch' not in sys.modules, 'torch imported'"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_one_vocabulary_of_schemes_with_visible_members():
    """Position and Method list their members in their class bodies (a type checker sees
    Position.POSLSH); each method's scheme name is its Position, in the same order, rope last."""
    assert [p.value for p in Position] == ["none", "fixed_block", "windowed", "alibi", "poslsh", "rope"]
    assert [m.scheme for m in Method] == [p.value for p in Position][:-1]
    assert Position.ALIBI.method is Method.EXACT and Position.NONE.method is Method.NO_BIAS
    assert Position.POSLSH.draws and not Position.ALIBI.draws and not Position.ROPE.draws
    with pytest.raises(ValueError, match="rope uses the model's own attention"):
        Position.ROPE.method


def test_the_keys_of_a_command_spec_build_its_scheme():
    """SchemeKeys.of reads the scheme keys a spec declares (a sweep's tuple and a null are not a
    scheme's value) and takes the cell's own over them; a swapped scheme keeps the bandwidths."""
    from types import SimpleNamespace

    spec = SimpleNamespace(position=("alibi", "poslsh"), s=(10, 20), sigma=8.0, window_sigmas=2.0, sampler=None,
                           seed=5, backend="blocks", steps=100)
    keys = SchemeKeys.of(spec, position="poslsh", s=20)
    assert keys == SchemeKeys(Position.POSLSH, s=20, sigma=8.0, window_sigmas=2.0, seed=5, backend="blocks")
    sch = Scheme.from_keys(keys, 4)
    assert np.array_equal(sch.sigmas, np.full(4, 8.0)) and (sch.s, sch.backend, sch.sampler) == (20, "blocks", "iid")
    alibi = sch.swapped("alibi", 10, 3)
    assert alibi.position is Position.ALIBI and alibi.s == 0 and np.array_equal(alibi.sigmas, sch.sigmas)
    assert alibi.window_sigmas == 2.0 and alibi.seed == 3
