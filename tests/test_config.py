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
