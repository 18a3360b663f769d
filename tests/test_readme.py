"""The README's Python examples run as written (the public names they import keep working)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_python_block_of_the_readme_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no Python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
    err = float(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < err < 0.5  # Positional LSH with s=16 approximates exact ALiBi (the printed relative error)


def test_the_loader_is_importable_from_the_package():
    import poslsh_cli
    from poslsh_cli.lm.loading import load_model

    assert poslsh_cli.load_model is load_model
