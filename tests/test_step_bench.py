"""poslsh step-bench: the training paths compared in one run, and the long-context training goals
judged on synthetic tables."""
import pandas as pd

from conftest import RUN, poslsh, status_of
from poslsh_cli.app import registry
from poslsh_cli.verdicts.claims import Status

# ---------------------------------------------------------------------------------------------
# step-bench: long-context training goals


def step_table(poslsh_ratio, mem_ratio, lengths=(2048, 8192, 16384)):
    rows = []
    for L in lengths:
        a = 1e-9 * L * L
        for position, s, t, m in (("rope", 0, a, 100.0), ("alibi", 0, a, 100.0),
                                  ("poslsh", 10, a * poslsh_ratio[L], 100.0 * mem_ratio)):
            rows.append({"seq_len": L, "position": position, "s": s, "backend": "auto", "attention_path": "x",
                         "batch": 1, "step_seconds": t, "tokens_per_s": L / t, "peak_mem_mb": m, "params": 1,
                         "device": "cpu", "steps": 3})
    return pd.DataFrame(rows)


def test_long_context_goals_and_crossover():
    from poslsh_cli.experiments.step_bench import command as step_bench

    good = step_bench.report(RUN, step_table({2048: 1.3, 8192: 0.8, 16384: 0.4}, 1.2))
    assert status_of(good, "at long context") is Status.SUPPORTED
    assert status_of(good, "peak memory") is Status.SUPPORTED
    assert any("faster than exact ALiBi from L=8192 on" in p for p in good.paragraphs)
    slow = step_bench.report(RUN, step_table({2048: 1.3, 8192: 1.1, 16384: 0.4}, 1.6))
    assert status_of(slow, "at long context") is Status.NOT_SUPPORTED
    assert status_of(slow, "peak memory") is Status.NOT_SUPPORTED
    assert any("from L=16384 on" in p for p in slow.paragraphs)
    short = step_bench.report(RUN, step_table({1024: 0.9, 2048: 0.9}, 1.0, lengths=(1024, 2048)))
    assert status_of(short, "at long context") is Status.NOT_MEASURED


def test_the_paper_setting_claim_reads_the_rows_at_its_setting_only():
    """L=8192, one sigma = 256 for every head, s=100: SUPPORTED when the step time and the memory are
    both within 1.5x exact ALiBi's, NOT SUPPORTED when one is not, NOT MEASURED at another setting or
    in a table without the sigmas column."""
    from poslsh_cli.experiments.step_bench import command as step_bench

    def table(t_ratio, m_ratio, sigmas="sigma=256 every head", s=100):
        rows = [{"seq_len": 8192, "position": p, "s": k, "backend": "auto", "attention_path": "x", "batch": 2,
                 "step_seconds": t, "tokens_per_s": 1.0, "peak_mem_mb": m, "params": 1, "device": "cuda", "steps": 3,
                 "sigmas": sigmas} for p, k, t, m in (("alibi", 0, 0.04, 2600.0),
                                                      ("poslsh", s, 0.04 * t_ratio, 2600.0 * m_ratio))]
        return pd.DataFrame(rows)

    claim = "at the paper's setting"
    assert status_of(step_bench.report(RUN, table(1.4, 1.1)), claim) is Status.SUPPORTED
    assert status_of(step_bench.report(RUN, table(1.7, 1.1)), claim) is Status.NOT_SUPPORTED
    assert status_of(step_bench.report(RUN, table(1.1, 1.6)), claim) is Status.NOT_SUPPORTED
    assert status_of(step_bench.report(RUN, table(1.1, 1.1, sigmas="standard")), claim) is Status.NOT_MEASURED
    assert status_of(step_bench.report(RUN, table(1.1, 1.1, s=10)), claim) is Status.NOT_MEASURED
    assert status_of(step_bench.report(RUN, table(1.1, 1.1).drop(columns="sigmas")), claim) is Status.NOT_MEASURED


# ---------------------------------------------------------------------------------------------
# poslsh step-bench end to end


def test_step_bench_compares_paths_in_one_run(tmp_path):
    r = poslsh("step-bench", "seq_len=[64]", "hidden=32", "layers=1", "heads=4", "kv_heads=4", "head_dim=8",
               "intermediate=64", "batch=2", "steps=1", "warmup=0", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv")
    paths = set(zip(df.position, df.attention_path))
    assert {("rope", "sdpa+rope"), ("alibi", "rank1"), ("alibi", "dense"), ("poslsh", "dense")} <= paths
    assert len(df[df.position == "poslsh"]) == 2  # s=10 and s=20; auto and dense are one path here
    assert len(df[df.position == "alibi"]) == 2  # auto and dense are one path; rank1 the other
    assert (df.step_seconds > 0).all()
    assert set(df[df.position != "rope"].sigmas) == {"standard"}
    r = poslsh("step-bench", "seq_len=[64]", "hidden=32", "layers=1", "heads=4", "kv_heads=4", "head_dim=8",
               "intermediate=64", "batch=2", "steps=1", "warmup=0", "position=[alibi,poslsh]", "s=[4]",
               "backend=[auto]", "sigma=16", f"out={tmp_path / 'constant'}")
    assert r.exit_code == 0, r.output
    assert set(pd.read_csv(tmp_path / "constant" / "results.csv").sigmas) == {"sigma=16 every head"}


def test_step_bench_at_the_paper_ratio_reports_the_mask_share_and_its_goals(tmp_path):
    """sigma_ratio= gives one sigma = ratio x L for every head, batch_tokens= the batch at each L; past
    the dense limit Positional LSH at s=100 trains on the union band; every Positional-LSH row has the
    share of its step spent drawing masks and building their layout, and the report judges the goals."""
    r = poslsh("step-bench", "seq_len=[128,512]", "hidden=32", "layers=1", "heads=4", "kv_heads=4", "head_dim=8",
               "intermediate=64", "batch_tokens=1024", "sigma_ratio=0.03125", "position=[rope,alibi,poslsh]",
               "s=[100]", "backend=[auto]", "steps=1", "warmup=0", f"out={tmp_path}")
    assert r.exit_code == 0, r.output
    df = pd.read_csv(tmp_path / "results.csv")
    assert dict(zip(df.seq_len, df.batch)) == {128: 8, 512: 2}
    assert set(df[df.position == "alibi"].sigmas) == {"sigma=4 every head", "sigma=16 every head"}
    p = df[df.position == "poslsh"].set_index("seq_len")
    assert p.attention_path[128] == "dense" and p.attention_path[512] == "union/fused"
    assert ((p.mask_share > 0) & (p.mask_share < 1)).all() and (p.mask_seconds > 0).all()
    assert (df[df.position != "poslsh"].mask_share == 0).all()
    sec = registry.get("step-bench").report(tmp_path, df)
    claims = {v.claim for v in sec.verdicts}
    assert any("at the paper's ratio sigma = L/32 with s=100" in c for c in claims)
    assert any("drawing the masks and building their layout takes at most 10%" in c for c in claims)
    assert "masks (share)" in registry.get("step-bench").summary(df)[0]
    r = poslsh("step-bench", "sigma=4", "sigma_ratio=0.1", f"out={tmp_path / 'bad'}")
    assert r.exit_code == 2 and "give one" in r.stderr
