"""Verdict rules that must not flip on noise: a claim over several groups, the training-speed
claim fed timings with noise, and the exact-law test of the largest block against a law 30% too
wide. Each rule is checked over many simulated draws against the rate it promises."""
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from poslsh_cli.app import registry
from poslsh_cli.verdicts.claims import GROUPS_RULE, Status, combine

S, N, I, M = Status.SUPPORTED, Status.NOT_SUPPORTED, Status.INCONCLUSIVE, Status.NOT_MEASURED
RUN = Path("synthetic")


# ---------------------------------------------------------------------------------------------
# a claim over several groups


@pytest.mark.parametrize("groups,expected", [
    ([S, I, I, I, I, I], I),  # one group supports, five cannot tell: not a supported claim
    ([S, S, S, I, I], S),     # most groups support, none contradicts
    ([S, S, I, I], I),        # half is not most
    ([S, S, S, N], N),        # a group where the claim fails
    ([N, I, I], N),
    ([I, I], I),
    ([S, M, M], S),           # groups not measured do not count
    ([M, M], M),
    ([], M),
])
def test_groups_combine_honestly(groups, expected):
    assert combine(groups) is expected


def test_every_verdict_over_groups_says_how_groups_combine():
    from test_block_stats import block_table
    from test_matrix_error import matrix_table
    from test_output_error import output_table

    sections = [registry.get("matrix-error").report(RUN, matrix_table(-0.5, 0.03)),
                registry.get("output-error").report(RUN, output_table(0.05)),
                registry.get("block-stats").report(RUN, block_table(grow=False))]
    over_groups = [v for sec in sections for v in sec.verdicts
                   if any(w in v.claim for w in ("decays like", "falls like", "stays bounded"))]
    assert len(over_groups) == 4
    for v in over_groups:
        assert GROUPS_RULE in v.rule, (v.claim, v.rule)


# ---------------------------------------------------------------------------------------------
# "Positional LSH trains faster than exact ALiBi", fed timings with noise


def train_times(ratio, seeds, noise, g, lengths=(256, 1024)):
    """Rows of a train run with what the speed claim reads: each cell's median step time, exact
    ALiBi's law times ``ratio`` for Positional LSH at the longest L, with log-normal ``noise``."""
    rows = []
    for L in lengths:
        for seed in seeds:
            for pos, s in (("alibi", 0), ("poslsh", 10)):
                law = 1e-6 * L * L * (ratio if pos == "poslsh" and L == max(lengths) else 1.0)
                rows.append(dict(position=pos, s=s, seed=seed, seq_len=L, attn_dropout=0.0, sigmas="standard",
                                 step_seconds=law * float(np.exp(noise * g.standard_normal()))))
    return pd.DataFrame(rows)


def speed_verdict(df):
    from poslsh_cli.experiments.train.report import claim_crossover

    [v] = claim_crossover(df)
    return v


def test_equal_step_times_with_noise_are_not_a_speed_up():
    """The same timing law for both schemes, 5% noise, three seeds: SUPPORTED at most about as
    often as the rule's error rate (2.5%), not every other time."""
    g = np.random.default_rng(0)
    found = [speed_verdict(train_times(1.0, (0, 1, 2), 0.05, g)).status for _ in range(200)]
    assert found.count(S) <= 20 and found.count(N) <= 20, (found.count(S), found.count(N))


def test_a_clear_speed_up_over_several_seeds_is_supported_and_states_its_interval():
    from poslsh_cli.verdicts.stats import t_interval

    g = np.random.default_rng(1)
    df = train_times(0.7, (0, 1, 2, 3, 4), 0.05, g)
    v = speed_verdict(df)
    assert v.status is S, v
    big = df[df.seq_len == 1024].pivot(index="seed", columns="position", values="step_seconds")
    iv = t_interval(np.log(big.poslsh / big.alibi))
    assert f"{iv.estimate:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}] (95%, 5 seeds)" in v.evidence, v.evidence
    assert speed_verdict(train_times(1.3, (0, 1, 2, 3, 4), 0.05, g)).status is N
    one = speed_verdict(train_times(0.7, (0,), 0.05, g))
    assert one.status is I and "1 seed" in one.evidence, one


# ---------------------------------------------------------------------------------------------
# block-stats: the largest width against its exact law, and a law 30% too wide


def widths_table(wider, trials, g):
    """block-stats rows whose largest widths follow the exact law with sigma times ``wider``."""
    from test_block_stats import block_table

    df = block_table(grow=False, trials=trials)
    return df.assign(max_width=[g.gamma(2.0, wider * r.sigma, size=int(r.s)).max() for r in df.itertuples()])


def law_verdict(df):
    sec = registry.get("block-stats").report(RUN, df)
    [v] = [v for v in sec.verdicts if "largest width follows" in v.claim]
    return v


def test_a_law_30_percent_too_wide_is_not_passed_for_want_of_trials():
    """Five trials per (σ, s) group cannot tell the exact law from one 30% wider (the test rejects
    the wider one about one time in six): INCONCLUSIVE, saying so and how many trials would do,
    not SUPPORTED four times in five."""
    g = np.random.default_rng(0)
    found = [law_verdict(widths_table(1.3, 5, g)) for _ in range(100)]
    statuses = [v.status for v in found]
    assert statuses.count(S) <= 5, statuses.count(S)
    inconclusive = [v for v in found if v.status is I]
    assert inconclusive and all("power" in v.evidence and "trials=" in v.evidence for v in inconclusive), \
        inconclusive[0].evidence


def test_enough_trials_pass_the_exact_law_and_reject_one_30_percent_wider():
    g = np.random.default_rng(1)
    v = law_verdict(widths_table(1.0, 60, g))
    assert v.status is S and "power" in v.evidence, v
    assert law_verdict(widths_table(1.3, 60, g)).status is N


# ---------------------------------------------------------------------------------------------
# claims declared once (poslsh_cli.verdicts.declared)


@pytest.fixture
def declared():
    """Claims declared by a test, removed from the registry after it."""
    from poslsh_cli.verdicts.declared import CLAIMS

    before = dict(CLAIMS)
    yield CLAIMS
    CLAIMS.clear()
    CLAIMS.update(before)


def test_a_claim_is_declared_once_and_every_verdict_of_it_carries_its_ids(declared):
    """One declaration per id; a family's sentence, and only a family's, names its member; a verdict
    gets the declared sentence with the run's fields, the rule with its numbers, the claim's id, and
    for a family's member the family's id, sentence and member, with the tag after the sentence."""
    from poslsh_cli.verdicts.claims import Groups
    from poslsh_cli.verdicts.declared import Claim, Role

    one = Claim("test/one", "bench", "a call at n={n} is fast", "at most {goal} s", metric="seconds",
                sides=({"method": "exact"}, {"method": "poslsh", "s": "*"}))
    with pytest.raises(ValueError, match="declared twice"):
        Claim("test/one", "bench", "again")
    with pytest.raises(ValueError, match="member"):
        Claim("test/family", "bench", "no member here", family=True)
    with pytest.raises(ValueError, match="member"):
        Claim("test/not_family", "bench", "{member} is fast")
    with pytest.raises(ValueError, match="baseline, compared"):
        Claim("test/sides", "bench", "x", sides=({"method": "exact"},))
    v = one.verdict(S, "0.1 s", n=1024, goal=0.5)
    assert (v.claim, v.rule, v.key, v.claim_id, v.family) == ("a call at n=1024 is fast", "at most 0.5 s", "test/one",
                                                                "test/one", "")
    assert one.role is Role.EXPLORATORY and declared["test/one"] is one
    fam = Claim("test/each_s", "bench", "Positional LSH {member} reaches exact ALiBi on {task}", "rule", family=True)
    with pytest.raises(ValueError, match="names its member"):
        fam.verdict(S, "")
    m = fam.verdict(N, "gap", member="s=10", task="copy", tag="[600 steps]", group="copy")
    assert m.claim == "Positional LSH s=10 reaches exact ALiBi on copy [600 steps]"
    assert (m.key, m.family, m.member, m.tag) == ("test/each_s[s=10]", "test/each_s[copy]", "s=10", "[600 steps]")
    assert m.family_text == "Positional LSH … reaches exact ALiBi on copy"
    # a claim over groups through its declaration: the declared rule and how groups combine
    g = Groups()
    g.add(True, "L=256: 0.9x")
    assert g.verdict(one, n=8, goal=1).rule == "at most 1 s; " + GROUPS_RULE
    assert one.not_measured("no rows", n=8, goal=1).status is M


def test_the_claims_command_lists_each_commands_declared_claims():
    from conftest import poslsh

    out = poslsh("claims", "decode-bench")
    assert out.exit_code == 0
    assert out.stdout.count("- **") == 2 and "decode_bench/kv_held" in out.stdout and "compares: position=poslsh" in out.stdout
    # in a process of its own (no test has imported a module this one did not): every declaration, each once
    import subprocess

    from conftest import ENV, POSLSH
    from poslsh_cli.app import registry
    from poslsh_cli.verdicts.declared import CLAIMS

    registry.experiments()
    every = subprocess.run([*POSLSH, "claims"], env=ENV, capture_output=True, text=True, timeout=120)
    assert every.returncode == 0, every.stderr
    listed = [line.split("**")[1] for line in every.stdout.splitlines() if line.startswith("- **")]
    declared = [c for c in CLAIMS if not c.startswith("test/")]
    assert sorted(listed) == sorted(declared) and len(listed) == len(set(listed)) >= 50
    assert {"finetune/gap_falls_with_s", "extrapolation/robust", "across/gap_grows_with_L_s10"} <= set(listed)
    assert "- **primary/reaches_alibi_s10** (perplexity, primary)" in every.stdout
    bad = poslsh("claims", "nope")
    assert bad.exit_code == 2 and "no command 'nope'" in bad.stderr
