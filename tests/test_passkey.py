"""poslsh passkey: the prompts, and a run scoring every (length, depth, key) of a checkpoint."""
import pytest

from conftest import poslsh


def test_passkey_prompts_and_run(tmp_path, poslsh_checkpoint):
    """The prompt is exactly `length` tokens with the needle at its depth and the answer last; the
    command scores every (length, depth, key) of a checkpoint and refuses a length too short."""
    import pandas as pd

    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.experiments.passkey import NEEDLE, prompt

    encode = lambda text: list(text.encode())  # noqa: E731
    for depth in (0.0, 0.5, 1.0):
        ids, m = prompt(encode, 300, depth, "12345")
        text = bytes(ids).decode()
        assert len(ids) == 300 and m == 6 and text.endswith("The pass key is 12345")
        at = text.index(NEEDLE.format(key="12345"))
        room = 300 - len(NEEDLE.format(key="12345")) - len("What is the pass key? The pass key is 12345")
        assert at == round(depth * room)
    with pytest.raises(ConfigError, match="too short"):
        prompt(encode, 40, 0.5, "12345")
    res = poslsh("passkey", str(poslsh_checkpoint), "depths=[0,1]", "trials=2", f"out={tmp_path / 'p'}")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "p" / "results.csv")
    assert sorted(set(df.length)) == [128, 256, 512] and len(df) == 3 * 2 * 2
    assert ((df.correct == 1) == (df.answer_top1 == 1.0)).all() and (df.answer_nll > 0).all()
    assert df.groupby("length").key.nunique().min() >= 2  # a new key per trial
