"""The confirmatory experiment's registration (docs/PREREGISTRATION.md) is fixed and is what runs.

The registered block may not change once the experiment's first model has started: its digest is
pinned here, and the presets that run it are read back against it, so an edit to either the
registration or the presets that would change the experiment fails this file."""
import hashlib
import re
from pathlib import Path

import pytest
import yaml

from poslsh_cli.app import registry

ROOT = Path(__file__).resolve().parents[1]
REGISTRATION = ROOT / "docs" / "PREREGISTRATION.md"
#: sha256 of the registered YAML block as committed before the first model of train_confirm trained.
#: Changing it is changing the registration: that is a new, differently named experiment, not an edit.
REGISTERED_DIGEST = "ef6a1e50c5a5692613349f858f62a44f5957cc7ed5753f3f9de79b6dc09f6bce"


def registered_block() -> str:
    text = REGISTRATION.read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "the registration holds exactly one YAML block"
    return blocks[0]


def registered() -> dict:
    return yaml.safe_load(registered_block())


def compose(command: str, preset: str):
    return registry.compose_spec(registry.get(command), [f"experiment={preset}"])


def test_the_registered_block_is_the_one_committed_before_the_runs():
    digest = hashlib.sha256(registered_block().encode("utf-8")).hexdigest()
    assert digest == REGISTERED_DIGEST, "docs/PREREGISTRATION.md's registered block changed after registration"


def test_the_training_preset_runs_exactly_the_registered_design():
    reg = registered()
    spec = compose("train", reg["train_preset"])
    assert [int(x) for x in spec.seed] == reg["seeds"]
    assert spec.steps in (reg["steps"], (reg["steps"],))
    assert tuple(spec.seq_len) == (reg["seq_len"],) and spec.sigma == reg["sigma"]
    assert spec.sigma == reg["seq_len"] / 32  # the paper's ratio sigma / L
    primary = reg["primary"]
    assert sorted(int(p["s"]) for p in primary) == sorted(int(s) for s in spec.s)
    positions = {p.value for p in spec.position}
    assert {p["treatment"] for p in primary} | {p["control"] for p in primary} <= positions
    assert positions - {"alibi", "poslsh"} == set(reg["secondary_positions"])
    # the primary schemes train every seed, the secondary ones only the first few
    assert sorted(spec.all_seeds) == ["alibi", "poslsh"]
    assert list(spec.seed[:spec.first_seeds]) == reg["secondary_seeds"]


def test_the_evaluation_preset_measures_the_registered_endpoint():
    reg = registered()
    spec = compose("perplexity", reg["eval_preset"])
    assert [str(c) for c in spec.checkpoints] == [reg["train_preset"].removesuffix("_paper")]
    assert spec.trials == reg["mask_draws"] >= 3
    assert spec.max_tokens is None  # the whole validation split
    assert reg["seq_len"] in spec.lengths
    assert {"own"} <= {a.value for a in spec.attention}


@pytest.mark.parametrize("run", ["train", "train_official", "train_finetune"])
def test_the_registered_seeds_are_used_by_no_published_run(run):
    config = yaml.safe_load((ROOT / "docs" / "results" / run / "config.yaml").read_text())
    published = config["seed"] if isinstance(config["seed"], list) else [config["seed"]]
    assert not set(registered()["seeds"]) & set(published)


def test_the_power_rule_gives_the_registered_seed_count():
    """Eleven seeds: the fewest at which one comparison at Holm's first step (one-sided 0.05/3)
    decides a true gap half a margin from the margin with probability at least 0.8, at the
    planning spread and margin the registration names."""
    from scipy import stats
    import numpy as np

    sd, margin, alpha, k = 0.0079, 0.0167, 0.05, 3

    def power(n):
        df = n - 1
        return 1 - stats.nct.cdf(stats.t.ppf(1 - alpha / k, df), df, (margin / 2) / (sd / np.sqrt(n)))

    n = next(n for n in range(3, 100) if power(n) >= 0.8)
    assert n == len(registered()["seeds"]) == 11
    assert power(n - 1) < 0.8 <= power(n)


def test_the_analysis_reads_the_registered_design():
    """The code's registration (what the report decides with) is the registered block, field for field,
    and names the commit that added the block."""
    from poslsh_cli.verdicts.registered import CONFIRM_L256 as reg

    block = registered()
    assert reg.name == block["registration"] and reg.train_run == block["train_preset"].removesuffix("_paper")
    assert list(reg.seeds) == block["seeds"] and reg.steps == block["steps"]
    assert reg.seq_len == block["seq_len"] and reg.sigma == block["sigma"] and reg.mask_draws == block["mask_draws"]
    assert [(p.id, p.treatment, p.s, p.control) for p in reg.primary] == \
        [(p["id"], p["treatment"], p["s"], p["control"]) for p in block["primary"]]
    assert reg.alpha == block["alpha"] and "holm" in block["correction"]
    assert f"{reg.stability_df} degrees of freedom" in block["stability"]
    assert f"{reg.margin_fraction:g} x exact ALiBi's mean" in block["margin"]
    assert [st for _, st in reg.earlier] == [int(x) for x in re.findall(r"T = ([0-9, ]+)", block["stability"])[0]
                                              .replace(" ", "").split(",")][:-1]
    assert f"{reg.stability_level:.0%} interval" in block["stability"]


def test_the_registering_commit_added_the_registration_before_any_confirmatory_result():
    """The commit the analysis names is the one that added docs/PREREGISTRATION.md, and no published
    snapshot of the registered run is older than it."""
    import datetime
    import json
    import subprocess

    from poslsh_cli.verdicts.registered import CONFIRM_L256 as reg

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("a shallow clone has no history to read the registration from")
    added = git("log", "--diff-filter=A", "--format=%H %cI", "--", "docs/PREREGISTRATION.md").stdout.split()
    assert added[:1] == [reg.commit]
    registered_at = datetime.datetime.fromisoformat(added[1])
    meta = ROOT / "docs" / "results" / reg.train_run / "meta.json"
    if meta.exists():  # once published: its first model started after the registration
        started = datetime.datetime.fromisoformat(json.loads(meta.read_text())["started"]).replace(
            tzinfo=datetime.timezone.utc)
        assert started > registered_at
