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
    said = re.search(r"print\(.*\)\s+# ([0-9.]+):", "".join(blocks))
    assert said and abs(err - float(said.group(1))) < 5e-4, "the README states what its example prints"


def test_the_loader_is_importable_from_the_package():
    import poslsh_cli
    from poslsh_cli.lm.loading import load_model

    assert poslsh_cli.load_model is load_model


# ---------------------------------------------------------------------------------------------
# commands as the documentation writes them


ROOT = README.parent
GUIDE = ROOT / "docs" / "GUIDE.md"
#: An unquoted list argument, ``key=[...]``: zsh reads the brackets as a glob ("no matches found").
UNQUOTED_LIST = re.compile(r"(?<![\w'\"])([\w.+~/-]+=\\?\[[^\]\s]*\]?)")


def help_texts() -> dict[str, str]:
    """``poslsh --help`` and every command's ``--help``, as printed."""
    import typer
    from typer.testing import CliRunner

    from poslsh_cli.app.cli import app

    runner = CliRunner()
    names = [""] + list(typer.main.get_command(app).commands)
    return {f"poslsh {n} --help".replace("  ", " "): runner.invoke(app, [n, "--help"] if n else ["--help"],
                                                                  env={"COLUMNS": "200"}).output for n in names}


def documents() -> dict[str, str]:
    """README, GUIDE (without their Python blocks) and every --help text."""
    docs = {p.name: re.sub(r"```python\n.*?```", "", p.read_text(), flags=re.S) for p in (README, GUIDE)}
    return {**docs, **help_texts()}


def test_list_arguments_are_quoted_for_zsh():
    """``poslsh matrix-error n=[4096]`` fails in zsh (the default shell on macOS): every list
    argument the README, the guide and --help show is quoted (``'n=[4096]'``)."""
    found = [f"{where}: {m.group(1)}" for where, text in documents().items()
             for line in text.splitlines() for m in UNQUOTED_LIST.finditer(line)]
    assert not found, "unquoted list arguments:\n" + "\n".join(found)


def recipes(makefile: str) -> dict[str, str]:
    """Each Makefile target's recipe (its tab-indented lines)."""
    out, target = {}, None
    for line in makefile.splitlines():
        m = re.match(r"^([\w.-]+):", line)
        if m:
            target = m.group(1)
            out[target] = ""
        elif line.startswith("\t") and target:
            out[target] += line + "\n"
        elif line.strip() and not line.startswith("#"):
            target = None
    return out


def test_make_commands_name_real_targets_and_variables():
    """Every ``make TARGET VAR=...`` in the README, the guide and --help names a target of the
    Makefile and variables its recipe uses."""
    rec = recipes((ROOT / "Makefile").read_text())
    bad = []
    for where, text in documents().items():
        for target, rest in re.findall(r"\bmake ([a-z][\w-]*)((?: [A-Z_]+=\S*)*)", text):
            if target not in rec:
                bad.append(f"{where}: make {target}: no such target")
            bad += [f"{where}: make {target} {v}=: its recipe does not use {v}"
                    for v in re.findall(r"([A-Z_]+)=", rest) if target in rec and f"$({v})" not in rec[target]]
    assert not bad, "\n".join(bad)
