"""``poslsh generate``: bounded by the model's positions (a rotary model refuses what it has no
positions for; a scheme without a position limit says it extrapolates), and the text streamed as
the tokens come."""
import numpy as np
import pytest

from conftest import poslsh
from poslsh_cli.lm.convert import save
from poslsh_cli.lm.loading import Arch, build_model
from poslsh_cli.lm.positions import PositionState

#: a byte model with room for 96 positions
ARCH = Arch(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, head_dim=8, max_positions=96)


def checkpoint(path, position, seq_len=32):
    state = PositionState(position, np.array([2.0, 4.0, 8.0, 16.0]), num_samples=4 if position == "poslsh" else 0,
                          seed=3)
    save(build_model(ARCH, state, seed=1).eval(), path, {"scheme": state.to_json(), "seq_len": seq_len}, None)
    return path


def test_a_rotary_model_refuses_more_tokens_than_it_has_positions(tmp_path):
    ck = checkpoint(tmp_path / "rope", "rope")
    res = poslsh("generate", str(ck), "prompt=abcd", "max_new_tokens=100000000")
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.output
    assert "96 positions" in res.stderr and "at most 92 new tokens" in res.stderr, res.stderr
    res = poslsh("generate", str(ck), "prompt=abcd", "max_new_tokens=92")
    assert res.exit_code == 0 and "92 new tokens" in res.stderr, res.output


@pytest.mark.parametrize("position", ["alibi", "poslsh"])
def test_a_scheme_without_a_position_limit_says_it_extrapolates(tmp_path, position):
    ck = checkpoint(tmp_path / position, position)
    res = poslsh("generate", str(ck), "prompt=abcd", "max_new_tokens=100")
    assert res.exit_code == 0, res.output
    assert "extrapolates" in res.stderr and "trained at (32)" in res.stderr and "100 new tokens" in res.stderr, \
        res.stderr
    res = poslsh("generate", str(ck), "prompt=abcd", "max_new_tokens=10")
    assert res.exit_code == 0 and "extrapolates" not in res.stderr, res.stderr


def test_the_text_is_streamed_as_the_tokens_come(tmp_path):
    """The prompt, then each new piece of text as its token is generated, together the whole text
    (what the command prints)."""
    from poslsh_cli.lm.generate import generate

    ck = checkpoint(tmp_path / "ck", "poslsh")
    pieces, seen = [], []

    def stream(text):
        pieces.append(text)
        seen.append(len(pieces))

    out = generate(ck, prompt="Once", max_new_tokens=12, stream=stream)
    assert pieces[0] == "Once" and len(pieces) > 3, pieces
    assert "".join(pieces) == out.text and out.new_tokens == 12
    res = poslsh("generate", str(ck), "prompt=Once", "max_new_tokens=12")
    assert res.exit_code == 0 and res.stdout == out.text + "\n", (res.stdout, out.text)
