"""poslsh decode-bench: decoding speed and the key/value cache of each scheme, and its goals judged."""
from conftest import poslsh


def test_decode_bench_runs_and_judges_its_goals(tmp_path):
    import pandas as pd

    from poslsh_cli.experiments.decode_bench import command as decode_bench
    from poslsh_cli.verdicts.claims import Status

    res = poslsh("decode-bench", "context=[64,512]", "new_tokens=3", "hidden=32", "heads=4",
                 "kv_heads=4", "head_dim=8", "intermediate=64", "sigma=4", f"out={tmp_path / 'd'}")
    assert res.exit_code == 0, res.output
    df = pd.read_csv(tmp_path / "d" / "results.csv")
    assert len(df) == 6 and set(df.position) == {"alibi", "windowed", "poslsh"}
    long = df[df.context == 512].set_index("position")
    assert long.kv_tokens["alibi"] == 512 + 3 and long.kv_tokens["poslsh"] < 128  # sigma=4: blocks of tens
    assert long.kv_bytes["alibi"] == long.full_kv_bytes["alibi"] > 4 * long.kv_bytes["poslsh"]
    assert all(v.status is Status.NOT_MEASURED for v in decode_bench.claims(df))  # no 64k context here

    def table(speed: float, kv: float) -> pd.DataFrame:
        return pd.DataFrame([dict(context=65536, position="alibi", s=0, tokens_per_s=10.0, kv_bytes=800.0),
                             dict(context=65536, position="poslsh", s=8, tokens_per_s=10.0 * speed, kv_bytes=800.0 * kv)])

    good, slow = decode_bench.claims(table(5.0, 0.1)), decode_bench.claims(table(3.0, 0.2))
    assert [v.status for v in good] == [Status.SUPPORTED] * 2
    assert [v.status for v in slow] == [Status.NOT_SUPPORTED] * 2
