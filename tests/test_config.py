"""Every preset in conf/ composes and validates; the schemas refuse unknown keys."""
from pathlib import Path

import pytest

from poslsh_cli.cli import _compose
from poslsh_cli.config import CONF_DIR, SCHEMAS, ConfigError, config_name, validate


@pytest.mark.parametrize("command", sorted(SCHEMAS))
def test_default_config_composes_and_validates(command):
    assert (CONF_DIR / f"{config_name(command)}.yaml").exists()
    cfg = validate(command, _compose(command, []))
    assert cfg.seed == 0


def test_conf_dir_is_inside_the_package():
    import poslsh_cli

    assert Path(poslsh_cli.__file__).parent / "conf" == CONF_DIR


def test_scalars_become_lists():
    cfg = validate("matrix-error", _compose("matrix-error", ["n=64", "sigma=2", "s=3"]))
    assert cfg.n == (64,) and cfg.sigma == (2.0,) and cfg.s == (3,)


def test_unknown_key_refused_by_schema():
    with pytest.raises(ConfigError):
        _compose("matrix-error", ["nope=1"])


def test_non_integer_n_refused():
    with pytest.raises(ConfigError, match="n must be an integer"):
        validate("matrix-error", _compose("matrix-error", ["n=[1.5]"]))


def _command_of(preset: str) -> str:
    for prefix, command in (("matrix_", "matrix-error"), ("block_stats", "block-stats"),
                            ("output_error", "output-error"), ("bench", "bench")):
        if preset.startswith(prefix):
            return command
    raise AssertionError(f"preset {preset} has no command")


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes_and_validates(preset):
    command = _command_of(preset)
    cfg = validate(command, _compose(command, [f"experiment={preset}"]))
    assert cfg.seed == 0


def test_every_experiment_has_quick_and_paper_scale():
    stems = {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")}
    bases = {s.rsplit("_", 1)[0] for s in stems}
    for base in bases:
        assert {f"{base}_quick", f"{base}_paper"} <= stems, base


def test_reproduce_list_points_at_existing_presets():
    from poslsh_cli.reproduce import EXPERIMENTS

    for _, command, preset in EXPERIMENTS:
        for scale in ("quick", "paper"):
            assert (CONF_DIR / "experiment" / f"{preset}_{scale}.yaml").exists()
            assert _command_of(f"{preset}_{scale}") == command


@pytest.mark.parametrize("preset", ["output_error_qwen3_0_6b_paper", "output_error_minilm_quick"])
def test_model_presets_select_their_checkpoint(preset):
    cfg = validate("output-error", _compose("output-error", [f"experiment={preset}"]))
    assert cfg.model.name in ("qwen3-0.6b", "minilm")
