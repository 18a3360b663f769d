"""Configuration: every command composes and validates from the registry; the one validation
turns values into concrete types with one-line messages; every preset belongs to one command."""
import json
import subprocess
import sys
from dataclasses import FrozenInstanceError

import pytest

from poslsh_cli.app import registry
from poslsh_cli.core.config import CONF_DIR
from poslsh_cli.core.errors import ConfigError

COMMANDS = sorted(registry.experiments())


def spec_of(command, overrides=()):
    exp = registry.get(command)
    extra = [f"{exp.positional}=['/some/run']"] if exp.positional else []  # e.g. perplexity needs a run
    return registry.compose_spec(exp, extra + list(overrides))


@pytest.mark.parametrize("command", COMMANDS)
def test_default_config_composes_into_a_frozen_spec(command):
    exp = registry.get(command)
    assert (CONF_DIR / f"{exp.config_name}.yaml").exists()
    spec = spec_of(command)
    assert spec.seed in (0, (0,)) and isinstance(spec, exp.spec)
    with pytest.raises(FrozenInstanceError):
        spec.seed = 1


def test_conf_dir_is_inside_the_package():
    from pathlib import Path

    import poslsh_cli

    assert Path(poslsh_cli.__file__).parent / "conf" == CONF_DIR


def test_values_become_concrete_types():
    from poslsh_cli.experiments.bench.command import BenchMethod
    from poslsh_cli.experiments.matrix_error.command import Computation as Method

    cfg = spec_of("matrix-error", ["n=64", "sigma=2", "s=3", "method=both"])
    assert cfg.n == (64,) and cfg.sigma == (2.0,) and cfg.s == (3,) and cfg.method is Method.BOTH
    b = spec_of("bench", ["causal=true", "methods=[exact,poslsh]"])
    assert b.causal == (True,) and b.methods == (BenchMethod.EXACT, BenchMethod.POSLSH)
    o = spec_of("output-error", ["layers=[3,1]", "causal=false", "baselines=[]"])
    assert o.layers == (3, 1) and o.causal is False and o.baselines == ()
    assert spec_of("output-error").layers == "all" and spec_of("output-error").causal == "auto"


@pytest.mark.parametrize("command,overrides,needle", [
    ("matrix-error", ["nope=1"], "unknown key"),
    ("matrix-error", ["n=[1.5]"], "n must be an integer, got 1.5"),
    ("matrix-error", ["n=[]"], "n must not be empty"),
    ("bench", ["causal=[maybe]"], "causal must be true or false, got 'maybe'"),
    ("output-error", ["causal=maybe"], "causal must be auto, true or false, got 'maybe'"),
    ("output-error", ["layers=[-1]"], "layers must be >= 0, got -1"),
    ("output-error", ["model.path=[1]"], "model.path must be a string"),
    ("output-error", ["model=nope"], "Could not find 'model/nope'"),
    ("sample", ["heads=0"], "heads must be >= 1"),
])
def test_bad_values_are_refused_with_one_message(command, overrides, needle):
    with pytest.raises(ConfigError, match=None) as info:
        spec_of(command, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_preset_belongs_to_one_command_and_validates(preset):
    exp = registry.owner_of_preset(preset)
    assert preset in registry.preset_names(exp)
    seed = spec_of(exp.name, [f"experiment={preset}"]).seed
    # presets start at seed 0, but for a confirmatory experiment, whose registered seeds are new ones
    # (tests/test_preregistration.py)
    assert seed == 0 or seed[0] == 0 or preset.startswith(("train_confirm", "train_stability"))


def test_every_preset_has_quick_and_paper_scale():
    for exp in registry.experiments().values():
        for stem in exp.presets:
            for scale in registry.SCALES:
                assert (CONF_DIR / "experiment" / f"{stem}_{scale}.yaml").exists(), (exp.name, stem, scale)


def test_reproduce_plan_covers_every_preset():
    from poslsh_cli.app.reproduce import plan

    for scale in registry.SCALES:
        planned = {preset for _, _, preset in plan(scale)}
        files = {p.stem for p in (CONF_DIR / "experiment").glob(f"*_{scale}.yaml")}
        assert planned == files


@pytest.mark.parametrize("preset,name", [("output_error_qwen3_0_6b_paper", "qwen3-0.6b"),
                                         ("output_error_minilm_quick", "minilm")])
def test_model_presets_select_their_checkpoint(preset, name):
    spec = spec_of("output-error", [f"experiment={preset}"])
    assert spec.model.name == name and spec.model.gpu == (name != "minilm")


def test_model_references_resolve_in_one_place(tmp_path, monkeypatch):
    from poslsh_cli.lm import models

    monkeypatch.setenv("POSLSH_MODELS", str(tmp_path))
    spec = spec_of("output-error", ["model=qwen3-0.6b"])
    assert models.resolve(spec.model) == tmp_path / "Qwen3-0.6B"
    assert models.unavailable(spec.model).startswith("no checkpoint at")
    assert models.shorthand(["model=/x/y", "n=3"]) == ["model=custom", "model.path=/x/y", "n=3"]
    monkeypatch.delenv("POSLSH_MODELS")
    with pytest.raises(ConfigError, match=r"has no path: set model.path=DIR or POSLSH_MODELS \(looked for"):
        models.resolve(spec.model)


def test_presets_that_cannot_run_here_are_skipped_with_a_reason(monkeypatch):
    """reproduce skips (and says why) rather than fails: CUDA presets without CUDA, large models
    without their checkpoint."""
    import torch

    from poslsh_cli.app.reproduce import skip_reason

    monkeypatch.delenv("POSLSH_MODELS", raising=False)
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in skip_reason("bench", "bench_gpu_quick")
    assert skip_reason("bench", "bench_quick") is None
    assert skip_reason("output-error", "output_error_mistral_7b_quick").startswith("POSLSH_MODELS is not set")
    assert skip_reason("output-error", "output_error_minilm_quick") is None


def test_opt_in_presets_run_at_the_paper_scale_only_when_asked(tmp_path):
    from poslsh_cli.app import reproduce

    # the long-context CPU runs, the pilots that sized the language-model presets and the registered
    # experiment at four times the context (its training, its models at T/2, their evaluation and retrieval)
    assert set(reproduce.opt_in()) == {"train_pilot", "train_pilot_l1024", "train_first", "train_long", "perplexity_long",
                                       "train_confirm_l1024", "train_stability_l1024", "perplexity_confirm_l1024",
                                       "passkey_confirm_l1024"}
    assert "--with train_long" in reproduce.not_asked("train_long", "train_long_paper", ())
    assert reproduce.not_asked("train_long", "train_long_paper", ("train_long",)) is None
    assert reproduce.not_asked("train_long", "train_long_quick", ()) is None  # the smoke test runs every preset
    for name in ("train", "train_official", "train_finetune"):  # both protocols run by default
        assert reproduce.not_asked(name, f"{name}_paper", ()) is None
    for name, command in (("perplexity", "perplexity"), ("perplexity_official", "perplexity"), ("passkey", "passkey"),
                          ("eval", "eval")):
        assert reproduce.not_asked(name, f"{name}_paper", ()) is None
        assert (name, command, f"{name}_paper") in reproduce.plan("paper")
    assert reproduce.check_with(["all"]) == tuple(reproduce.opt_in())
    with pytest.raises(ConfigError, match="--with must be one of train_pilot, train_pilot_l1024, train_confirm_l1024, "
                                          "train_stability_l1024, train_first, train_long, perplexity_confirm_l1024, "
                                          "perplexity_long, passkey_confirm_l1024 or all, got 'trian'"):
        reproduce.check_with(["trian"])
    # the driver leaves it out and says why in its run directory, running nothing
    code = ("import sys; import poslsh_cli.app.reproduce as r;"
            "r.plan = lambda scale: [('train_long','train','train_long_paper')];"
            f"sys.exit(r.main('paper', {str(tmp_path)!r}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "skipped train_long: an opt-in preset" in res.stdout
    marker = json.loads((tmp_path / "paper" / "train_long" / "skipped.json").read_text())
    assert "--with train_long" in marker["reason"]
    assert not (tmp_path / "paper" / "train_long" / "config.yaml").exists()


def test_evaluation_presets_run_right_after_the_runs_they_read():
    """The paper's comparison comes first: perplexity_official runs right after train_official, before
    the other trainings; every evaluation preset after each run it reads."""
    from poslsh_cli.app import reproduce

    entries = [e for e in reproduce.plan("paper") if e[1] in ("train", "perplexity", "passkey", "eval")]
    names = [e[0] for e in reproduce.schedule(entries)]
    assert names.index("perplexity_official") == names.index("train_official") + 1 < names.index("train")
    for e in entries:
        for dep in reproduce.reads(e[1], e[2]):
            assert names.index(dep) < names.index(e[0]), (e[0], dep)
    assert reproduce.reads("passkey", "passkey_paper") == ("train", "train_official", "train_finetune")


def test_reproduce_refuses_an_unknown_with_in_one_line(tmp_path):
    res = subprocess.run([sys.executable, "-m", "poslsh_cli", "reproduce", "--with", "trian", "--runs", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "--with must be one of" in res.stderr and not any(tmp_path.iterdir())


@pytest.mark.parametrize("command", COMMANDS)
def test_every_default_in_the_yaml_is_the_spec_default(command):
    """conf/<command>.yaml writes every key's default (what --help shows) and the spec's key(...)
    declares it (what the schema holds): the two agree, value for value after validation, and the
    YAML leaves out no key. Config groups (model) are chosen in the defaults list, not compared."""
    import dataclasses
    import typing

    import yaml

    from poslsh_cli.core.config import build_spec

    exp = registry.get(command)
    raw = yaml.safe_load((CONF_DIR / f"{exp.config_name}.yaml").read_text())
    raw.pop("defaults")
    required = {exp.positional: ["/some/run"]} if exp.positional else {}
    hints = typing.get_type_hints(exp.spec)
    groups = {f.name for f in dataclasses.fields(exp.spec)
              if any(dataclasses.is_dataclass(t) for t in typing.get_args(hints[f.name]) or (hints[f.name],))}
    from_yaml = build_spec(exp.spec, {**{k: v for k, v in raw.items() if k not in groups}, **required})
    from_spec = build_spec(exp.spec, required)
    differ = {f.name: (getattr(from_yaml, f.name), getattr(from_spec, f.name)) for f in dataclasses.fields(exp.spec)
              if getattr(from_yaml, f.name) != getattr(from_spec, f.name)}
    assert not differ, f"conf/{exp.config_name}.yaml and {exp.spec.__name__} disagree (yaml, spec): {differ}"


def test_reproduce_only_runs_the_presets_named_or_every_preset_of_a_command(tmp_path):
    from poslsh_cli.app import reproduce

    assert reproduce.check_only(["train_official", "eval"], "paper") == ("train_official", "eval")
    lm = reproduce.check_only(["train", "perplexity", "passkey", "eval"], "paper")
    assert {"train", "train_official", "train_finetune", "perplexity", "perplexity_official", "passkey", "eval"} <= set(lm)
    assert not {"matrix_error", "bench", "output_error_minilm"} & set(lm)
    with pytest.raises(ConfigError, match="--only takes a preset .* or a command .*, got 'trian'"):
        reproduce.check_only(["trian"], "paper")
    res = subprocess.run([sys.executable, "-m", "poslsh_cli", "reproduce", "--only", "trian", "--runs", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1 and "--only takes" in res.stderr
    assert not any(tmp_path.iterdir())
    # the driver runs the chosen presets alone
    code = ("import sys; import poslsh_cli.app.reproduce as r; ran = [];"
            "r._run_wave = lambda wave, *a, **k: ran.extend(e[0] for e in wave);"
            f"code = r.main('quick', {str(tmp_path)!r}, only=('block_stats',)); print(ran); sys.exit(code)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "['block_stats']", (res.stdout, res.stderr)
