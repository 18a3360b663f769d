"""``poslsh generate``: bounded by the model's positions (a rotary model refuses what it has no
positions for; a scheme without a position limit says it extrapolates), the text streamed as
the tokens come, the same text with and without the cache, a swapped scheme, and bad input."""
import numpy as np
import pytest

from conftest import poslsh
from poslsh_cli.lm.convert import save
from poslsh_cli.lm.trained import TrainInfo
from poslsh_cli.lm.loading import Arch, build_model
from poslsh_cli.lm.positions import PositionState

#: a byte model with room for 96 positions
ARCH = Arch(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, head_dim=8, max_positions=96)


def checkpoint(path, position, seq_len=32):
    state = PositionState(position, np.array([2.0, 4.0, 8.0, 16.0]), s=4 if position == "poslsh" else 0,
                          seed=3)
    save(build_model(ARCH, state, seed=1).eval(), path, TrainInfo(scheme=state, seq_len=seq_len), None)
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


def test_the_text_is_streamed_as_the_tokens_come(poslsh_checkpoint):
    """The prompt, then each new piece of text as its token is generated, together the whole text
    (what the command prints)."""
    from poslsh_cli.lm.generate import generate

    ck = poslsh_checkpoint
    pieces, seen = [], []

    def stream(text):
        pieces.append(text)
        seen.append(len(pieces))

    out = generate(ck, prompt="Once", max_new_tokens=12, stream=stream)
    assert pieces[0] == "Once" and len(pieces) > 3, pieces
    assert "".join(pieces) == out.text and out.new_tokens == 12
    res = poslsh("generate", str(ck), "prompt=Once", "max_new_tokens=12")
    assert res.exit_code == 0 and res.stdout == out.text + "\n", (res.stdout, out.text)


# ---------------------------------------------------------------------------------------------
# on a Positional-LSH checkpoint: the cache, a swapped scheme, bad input


def test_generate_command(tmp_path, poslsh_checkpoint):
    """poslsh generate: the prompt continued, the same text with and without the cache (greedy),
    a swapped scheme, and one error line for a wrong key or a missing checkpoint."""
    ck = poslsh_checkpoint
    texts = []
    for cache in ("true", "false"):
        res = poslsh("generate", str(ck), "prompt=Once upon a time", "max_new_tokens=12",
                     f"cache={cache}")
        assert res.exit_code == 0, res.output
        texts.append(res.stdout)
        assert "12 new tokens" in res.stderr and "poslsh s=8" in res.stderr
    assert texts[0] == texts[1] and texts[0].startswith("Once upon a time")
    res = poslsh("generate", str(ck), "prompt=abc", "max_new_tokens=4", "attention=alibi")
    assert res.exit_code == 0 and "alibi" in res.stderr and "positioned" in res.stderr
    for args, why in ((["max_tokens=3"], "unknown key 'max_tokens'"), (["attention=bogus"], "attention='bogus'")):
        res = poslsh("generate", str(ck), *args)
        assert res.exit_code != 0 and why in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = poslsh("generate", str(tmp_path / "missing"))
    assert res.exit_code != 0 and "does not exist" in res.stderr
