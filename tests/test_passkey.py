"""poslsh passkey: the prompts, and a run scoring every (length, depth, key) of a checkpoint."""
import pytest

from conftest import one_line, poslsh


def test_passkey_prompts_and_run(tmp_path, poslsh_checkpoint):
    """The prompt is exactly `length` tokens with the needle at its depth and the answer last; the
    command scores every (length, depth, key) of a checkpoint and refuses a length too short."""
    import pandas as pd

    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.experiments.passkey.command import NEEDLE, prompt

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
    # each row records the training run, seed and dropout from the checkpoint's record (none here)
    assert df.run.isna().all() and (df.run_seed == -1).all() and (df.attn_dropout == 0).all()  # "" reads as NaN


def test_the_passkey_table_keeps_runs_seeds_and_dropout_apart_with_an_exact_binomial_bound():
    import pandas as pd

    from poslsh_cli.app import registry
    from poslsh_cli.experiments.passkey.command import binomial_interval

    summary = registry.get("passkey").summary  # on migrated rows, as the command runs it
    rows = []
    for run, sigmas in (("train", "standard"), ("train_official", "sigma=8 every head")):
        for seed, hits in ((0, [1, 1, 0, 0]), (1, [1, 0, 0, 0]), (2, [1, 1, 1, 0])):
            for tail, drop in (("", 0.0), ("_attn_dropout-0.1", 0.1)):
                for k, c in enumerate(hits):
                    rows.append({"checkpoint": f"{run}/work/position-alibi_s-0_seed-{seed}{tail}-abc/final",
                                 "position": "alibi", "s": 0, "trained_len": 256, "length": 512, "depth": 0.5,
                                 "trial": k, "seed": k, "key": "1", "correct": c if drop == 0 else 0,
                                 "answer_tokens": 5, "answer_top1": 0.5, "answer_nll": 3.0, "sigmas": sigmas})
    head, table = summary(pd.DataFrame(rows))
    got = {(r[0], r[1]): r for r in table}
    assert set(got) == {("train", "alibi"), ("train", "alibi +dropout 0.1"),
                        ("train_official", "alibi (sigma=8 every head)"),
                        ("train_official", "alibi +dropout 0.1 (sigma=8 every head)")}
    col = {h: i for i, h in enumerate(head)}
    r = got[("train", "alibi")]
    # 6 of the 12 keys over three seeds: the exact (Clopper-Pearson) 95% interval of 6/12 is [21.1%, 78.9%]
    assert r[col["retrieved"]] == "6/12" and r[col["accuracy"]] == "0.50" and r[col["seeds"]] == "3"
    assert r[col["95% bound (exact binomial)"]] == "[21.1%, 78.9%]"
    # none retrieved: a one-sided bound, never a zero-width interval (the rule of three: 0/75 is below 3.9%)
    assert got[("train", "alibi +dropout 0.1")][col["95% bound (exact binomial)"]] == "below 22.1%"
    # rows that record their run, seed and dropout are read by those fields, not by the checkpoint's name
    recorded = pd.DataFrame(rows).assign(run=[r["checkpoint"].split("/")[0] for r in rows],
                                         run_seed=[int(r["checkpoint"].split("seed-")[1][0]) for r in rows],
                                         attn_dropout=[0.1 if "dropout" in r["checkpoint"] else 0.0 for r in rows])
    recorded = recorded.assign(checkpoint=[f"ck{i}" for i in range(len(recorded))])
    assert summary(recorded) == (head, table)
    # a resumed run: rows written before the fields were recorded (NaN there) read them from their name
    mixed = pd.concat([pd.DataFrame(rows[::2]), recorded.iloc[1::2]], ignore_index=True)
    assert mixed.run_seed.isna().any() and summary(mixed) == (head, table)
    assert binomial_interval(0, 75)[1] == pytest.approx(0.0392, abs=1e-4)
    assert binomial_interval(75, 75)[0] == pytest.approx(1 - 0.0392, abs=1e-4)


def test_a_passkey_run_where_nothing_is_retrieved_says_it_is_at_its_floor(tmp_path):
    import pandas as pd

    from poslsh_cli.app import registry

    report = registry.get("passkey").report  # on migrated rows, as the command runs it

    rows = [{"checkpoint": f"train/work/position-{p}_s-0_seed-{seed}-abc/final", "position": p, "s": 0,
             "trained_len": 256, "length": n, "depth": d, "trial": k, "seed": k, "key": 10000 + k, "correct": 0,
             "answer_tokens": 5, "answer_top1": 0.1, "answer_nll": 24.0 + k, "sigmas": ""}
            for p in ("alibi", "rope") for seed in (0, 1, 2) for n in (256, 512) for d in (0.0, 0.5, 1.0)
            for k in range(5)]
    sec = report(tmp_path, pd.DataFrame(rows))
    floor = sec.paragraphs[0]
    assert floor.startswith("At its floor: no model retrieved a key at any length") and "below" in floor
    assert "24.0 to 28.0 nats, against 11.5 for a uniform guess over its 5 digits" in floor, floor
    assert not any("[0.00, 0.00]" in str(t) for t in sec.tables)


def test_a_needle_placed_by_its_distance_in_sigmas(tmp_path, poslsh_checkpoint):
    """distances=[c...]: the needle's last token round(c sigma) tokens before the question, sigma the
    checkpoint's largest bandwidth (16 here) or distance_sigma; the table and the report give accuracy
    per distance; a distance past the prompt is one error line; a rope checkpoint needs distance_sigma."""
    import pandas as pd

    from poslsh_cli.app import registry
    from poslsh_cli.core.errors import ConfigError
    from poslsh_cli.app import registry
    from poslsh_cli.experiments.passkey.command import NEEDLE, QUESTION, prompt

    summary = registry.get("passkey").summary  # on migrated rows, as the command runs it

    encode = lambda text: list(text.encode())  # noqa: E731
    for gap in (0, 17, 100):
        ids, m = prompt(encode, 300, 0.0, "12345", gap)
        text = bytes(ids).decode()
        end = text.index(NEEDLE.format(key="12345")) + len(NEEDLE.format(key="12345"))
        assert len(ids) == 300 and text.index(QUESTION) - end == gap
    with pytest.raises(ConfigError, match="too short for the needle 290 tokens before"):
        prompt(encode, 300, 0.0, "12345", 290)
    res = poslsh("passkey", str(poslsh_checkpoint), "lengths=[256]", "distances=[1,4]", "trials=2",
                 f"out={tmp_path / 'p'}")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "p" / "results.csv")
    assert sorted(zip(df.distance_sigmas, df.distance_tokens)) == [(1.0, 16)] * 2 + [(4.0, 64)] * 2
    head, rows = summary(df)
    assert "needle distance" in head and [r[head.index("needle distance")] for r in rows] == \
        ["1 σ (16 tokens)", "4 σ (64 tokens)"]
    sec = registry.get("passkey").report(tmp_path / "p", df)
    assert "per needle distance from the question (2 distances" in " ".join(sec.paragraphs)
    # a needle that does not fit a length is refused before any cell runs, nothing written
    res = poslsh("passkey", str(poslsh_checkpoint), "lengths=[128,256]", "distances=[1,8]", f"out={tmp_path / 'no'}")
    assert one_line(res) and res.exit_code == 2 and not (tmp_path / "no").exists(), res.output
    assert "distances=8 at sigma 16" in res.stderr and "length=128 is too short for the needle 128 tokens" in res.stderr
    res = poslsh("passkey", str(poslsh_checkpoint), "lengths=[256]", "distances=[2]", "distance_sigma=10",
                 "trials=1", f"out={tmp_path / 'q'}")
    assert res.exit_code == 0, res.output
    assert pd.read_csv(tmp_path / "q" / "results.csv").distance_tokens.tolist() == [20]
    import json
    import shutil

    from poslsh_cli.experiments.passkey.command import PasskeySpec, distance_unit

    rope = tmp_path / "rope"
    shutil.copytree(poslsh_checkpoint, rope)
    cfg = json.loads((rope / "config.json").read_text())
    cfg["poslsh"]["position"] = "rope"
    (rope / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="no bandwidth of its own to measure distances= in .* give distance_sigma="):
        distance_unit(PasskeySpec(distances=(1.0,)), rope, "rope")
    assert distance_unit(PasskeySpec(distances=(1.0,), distance_sigma=32.0), rope, "rope") == 32.0
