"""The confirmatory experiments' registrations (docs/PREREGISTRATION.md at L = 256,
docs/PREREGISTRATION_L1024.md at L = 1024) are fixed and are what runs.

A registered block may not change once its experiment's first model has started: its digest is
pinned here, and the presets that run it are read back against it, so an edit to either the
registration or the presets that would change the experiment fails this file."""
import hashlib
import re
from pathlib import Path

import pytest
import yaml

from poslsh_cli.app import registry

ROOT = Path(__file__).resolve().parents[1]
#: each registration's page and the sha256 of its YAML block as committed before its first model trained.
#: Changing one is changing the registration: that is a new, differently named experiment, not an edit.
REGISTRATIONS = {
    "PREREGISTRATION.md": "ef6a1e50c5a5692613349f858f62a44f5957cc7ed5753f3f9de79b6dc09f6bce",
    "PREREGISTRATION_L1024.md": "dddadd110b170b24380dc33333325cc9ffc365d6fa748c3ab9b7d196b599f175",
}
PAGES = list(REGISTRATIONS)


def registered_block(page: str = "PREREGISTRATION.md") -> str:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.S | re.M)
    assert len(blocks) == 1, "the registration holds exactly one YAML block"
    return blocks[0]


def registered(page: str = "PREREGISTRATION.md") -> dict:
    return yaml.safe_load(registered_block(page))


def compose(command: str, preset: str):
    return registry.compose_spec(registry.get(command), [f"experiment={preset}"])


@pytest.mark.parametrize("page", PAGES)
def test_the_registered_block_is_the_one_committed_before_the_runs(page):
    digest = hashlib.sha256(registered_block(page).encode("utf-8")).hexdigest()
    assert digest == REGISTRATIONS[page], f"docs/{page}'s registered block changed after registration"


@pytest.mark.parametrize("page", PAGES)
def test_the_training_preset_runs_exactly_the_registered_design(page):
    reg = registered(page)
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
    if "stability_preset" in reg:  # the models at T/2 of the stability check: the primary schemes, as registered
        half = compose("train", reg["stability_preset"])
        assert [int(x) for x in half.seed] == reg["stability_seeds"] == reg["seeds"][:len(reg["stability_seeds"])]
        assert {p.value for p in half.position} == {"alibi", "poslsh"} and tuple(half.s) == tuple(spec.s)
        T = [int(x) for x in re.findall(r"T = ([0-9, ]+)", reg["stability"])[0].replace(" ", "").split(",")]
        assert T == [half.steps if isinstance(half.steps, int) else half.steps[0], reg["steps"]]
        for name in ("seq_len", "sigma", "batch", "hidden", "layers", "heads", "lr", "weight_decay", "warmup_fraction"):
            assert getattr(half, name) == getattr(spec, name), name


def test_the_longer_context_differs_from_l256_only_in_context():
    """confirm-L1024-v1 trains train_confirm's model, tokens per step, schedule, steps and seeds at four
    times the context, sigma = L/32."""
    short, long_ = (compose("train", registered(p)["train_preset"]) for p in PAGES)
    assert tuple(long_.seq_len) == (4 * short.seq_len[0],) and long_.sigma == 4 * short.sigma
    assert long_.batch * long_.seq_len[0] == short.batch * short.seq_len[0]
    for name in ("seed", "s", "steps", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "lr",
                 "weight_decay", "warmup_fraction", "all_seeds"):
        assert getattr(long_, name) == getattr(short, name), name


@pytest.mark.parametrize("page", PAGES)
def test_the_evaluation_preset_measures_the_registered_endpoint(page):
    reg = registered(page)
    spec = compose("perplexity", reg["eval_preset"])
    runs = [reg["train_preset"]] + ([reg["stability_preset"]] if "stability_preset" in reg else [])
    assert [str(c) for c in spec.checkpoints] == [r.removesuffix("_paper") for r in runs]
    assert spec.trials == reg["mask_draws"] >= 3
    assert spec.max_tokens is None  # the whole validation split
    assert reg["seq_len"] in spec.lengths
    assert {"own"} <= {a.value for a in spec.attention}


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("run", ["train", "train_official", "train_finetune"])
def test_the_registered_seeds_are_used_by_no_published_run(run, page):
    config = yaml.safe_load((ROOT / "docs" / "results" / run / "config.yaml").read_text())
    published = config["seed"] if isinstance(config["seed"], list) else [config["seed"]]
    assert not set(registered(page)["seeds"]) & set(published)


def power(n, sd, margin, alpha=0.05, k=3):
    """The noncentral-t power of one comparison at Holm's first step (one-sided alpha / k) to decide a
    true gap half a margin from the margin, with n seeds."""
    from scipy import stats
    import numpy as np

    df = n - 1
    return 1 - stats.nct.cdf(stats.t.ppf(1 - alpha / k, df), df, (margin / 2) / (sd / np.sqrt(n)))


@pytest.mark.parametrize("page", PAGES)
def test_the_power_rule_gives_the_registered_seed_count(page):
    """L = 256: eleven seeds, the fewest at which one comparison at Holm's first step decides a true gap
    half a margin from the margin with probability at least 0.8, at the planning spread and margin the
    registration names. L = 1024: the rule gives nine; eleven are registered (the same seeds as L = 256),
    with the power the page states at 1, 1.25 and 1.5 times the planning spread."""
    reg = registered(page)
    sd, margin = (float(x) for x in re.search(r"planning sd ([0-9.]+), planning margin ([0-9.]+)", reg["power"]).groups())
    n = next(n for n in range(3, 100) if power(n, sd, margin) >= 0.8)
    assert power(n - 1, sd, margin) < 0.8 <= power(n, sd, margin)
    assert len(reg["seeds"]) == 11
    if page == "PREREGISTRATION.md":
        assert n == 11
    else:
        text = " ".join((ROOT / "docs" / page).read_text().split())
        assert n == 9 and "Nine would meet the rule" in text
        for k in (8, 9, 10, 11):
            assert f"{power(k, sd, margin):.2f} at {k}" in text
        assert f"power stays {power(11, 1.25 * sd, margin):.2f} if" in text
        assert f"({power(11, 1.5 * sd, margin):.2f} at 1.5 times)" in text


def registration(page: str):
    """The code's registration of a page (what the report decides with)."""
    from poslsh_cli.verdicts import registered as r

    return {"PREREGISTRATION.md": r.CONFIRM_L256, "PREREGISTRATION_L1024.md": r.CONFIRM_L1024}[page]


@pytest.mark.parametrize("page", PAGES)
def test_the_analysis_reads_the_registered_design(page):
    """The code's registration (what the report decides with) is the registered block, field for field,
    and names the commit that added the block."""
    reg = registration(page)
    block = registered(page)
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
    if "stability_preset" in block:  # its models at T/2 are its own run, whose comparisons are secondary too
        assert reg.companions == (block["stability_preset"].removesuffix("_paper"),) == tuple(r for r, _ in reg.earlier)
    assert reg.page == f"docs/{page}"
    if "across_lengths" in block:  # the comparison across lengths, as the code decides it
        from poslsh_cli.verdicts.registered import ACROSS_L

        across = block["across_lengths"]
        assert ACROSS_L.long is reg and ACROSS_L.short.name == across["against"]
        assert list(ACROSS_L.ids) == across["ids"] and len(ACROSS_L.ids) == len(reg.primary)
        assert across["within_margin"] == f"H0 D >= {ACROSS_L.bound:g} rejected" and "H0 D <= 0" in across["grows"]
        assert f"holm over the 3 values of s at {ACROSS_L.alpha:g}" in across["correction"] and "Welch" in across["test"]
    from poslsh_cli.experiments.perplexity.registered import registration_of

    assert registration_of(reg.train_run) is reg and all(registration_of(f"{c}/0") is reg for c in reg.companions)
    assert registration_of("train_official") is None  # an earlier point from an exploratory run stays exploratory


@pytest.mark.parametrize("page", PAGES)
def test_the_registering_commit_added_the_registration_before_any_confirmatory_result(page):
    """The commit the analysis names is the one that added docs/PREREGISTRATION.md, and no published
    snapshot of the registered run is older than it."""
    import datetime
    import json
    import subprocess

    reg = registration(page)

    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)

    if git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("a shallow clone has no history to read the registration from")
    added = git("log", "--diff-filter=A", "--format=%H %cI", "--", f"docs/{page}").stdout.split()
    assert added[:1] == [reg.commit]
    registered_at = datetime.datetime.fromisoformat(added[1])
    meta = ROOT / "docs" / "results" / reg.train_run / "meta.json"
    if meta.exists():  # once published: its first model started after the registration
        started = datetime.datetime.fromisoformat(json.loads(meta.read_text())["started"]).replace(
            tzinfo=datetime.timezone.utc)
        assert started > registered_at
