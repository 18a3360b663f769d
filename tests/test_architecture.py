"""The architecture holds: no import cycles, each command named in its own module only, a CLI
that starts without the numerical stack, and run directories that can hold training."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import poslsh_cli
from poslsh_cli.app import registry
from poslsh_cli.store.cellwork import Checkpoints, MetricsLog
from poslsh_cli.store.rundir import RunDir

PKG = Path(poslsh_cli.__file__).parent


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Every poslsh_cli module -> the poslsh_cli modules it imports, at module level or inside
    functions (a function-level import is still a dependency)."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = import_graph()
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in graph[node]:
            if dep == "poslsh_cli" or (node == "poslsh_cli.experiments" and dep.startswith(node)):
                continue  # the package __init__ files import nothing of ours
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if state.get(dep) is None:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in graph:
        if state.get(node) is None:
            visit(node, [node])


def layers_from_the_architecture_document() -> list[tuple[str, list[str]]]:
    """(layer, folders) rows of the table in docs/ARCHITECTURE.md, top layer first."""
    text = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Layers"):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] not in ("layer", "---") and "`" in cells[1]:
            rows.append((cells[0], re.findall(r"`([a-z_]+)/`", cells[1])))
    return rows


def layer_of(module: str, rank: dict[str, int]) -> int:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("conf", "corpora", "__main__"):
        return -1  # the package itself, its entry point, and data folders (YAML presets, the corpus)
    return rank[parts[1]]


def test_every_folder_is_one_layer_and_imports_only_layers_above_it():
    """The table in docs/ARCHITECTURE.md is the law: poslsh_cli/ holds one folder per layer (the
    numerics layer two) and no loose modules, and each module's imports (module level or inside a
    function) go to its own folder or a layer above."""
    rows = layers_from_the_architecture_document()
    assert [name for name, _ in rows] == ["foundations", "numerics", "run storage", "models and data", "claims",
                                          "experiments", "front ends"]
    rank = {f: i for i, (_, folders) in enumerate(rows) for f in folders}
    assert sum(len(f) for _, f in rows) == len(rank), "a folder listed in two layers"
    loose = sorted(p.name for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert not loose, f"modules outside the layer folders: {loose}"
    folders = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()} - {"conf", "corpora"}  # data only
    assert folders == set(rank), f"folders missing from the table: {sorted(folders - set(rank))}; " \
                                 f"listed but absent: {sorted(set(rank) - folders)}"
    upward, edges = [], set()
    for module, deps in import_graph().items():
        mine = layer_of(module, rank)
        for dep in deps:
            theirs = layer_of(dep, rank)
            if dep == "poslsh_cli" or mine < 0:
                continue
            if theirs > mine:
                upward.append(f"{module} ({rows[mine][0]}) imports {dep} ({rows[theirs][0]})")
            if module.split(".")[1] != dep.split(".")[1]:
                edges.add((module.split(".")[1], dep.split(".")[1]))
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)
    assert ("app", "core") in edges and ("attention", "numerics") in edges  # the graph is read at all


def test_a_verdict_is_made_only_through_its_declared_claim():
    """No module outside ``verdicts/`` builds a ``Verdict`` itself: commands call their declared claim's
    ``verdict`` (poslsh_cli/verdicts/declared.py), so every verdict carries a declared id, rule and sides."""
    makers = []
    for path in PKG.rglob("*.py"):
        if path.parent.name == "verdicts":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Verdict":
                makers.append(f"{module_name(path)}:{node.lineno}")
    assert not makers, makers
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "Verdict"  # the scan sees a maker at all
               for n in ast.walk(ast.parse((PKG / "verdicts" / "declared.py").read_text())))


def test_the_layer_table_names_every_module_of_its_folders():
    """The modules column of docs/ARCHITECTURE.md lists each folder's modules (the experiments row
    its shared ones; the commands' packages are found by the registry)."""
    text = (PKG.parent / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Layers"):text.index("## From argv")]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("layer", "---") or "/`" not in cells[1]:
            continue
        folders = re.findall(r"`([a-z_]+)/`", cells[1])
        listed = set(re.findall(r"`([a-z_]+)`", cells[2]))
        present = {p.stem for f in folders for p in (PKG / f).glob("*.py") if p.stem != "__init__"}
        if "experiments" in folders:
            present = {m for m in present if not (PKG / "experiments" / f"{m}.py").read_text().count("EXPERIMENT = ")}
        assert listed == present, (cells[0], sorted(present - listed), sorted(listed - present))


def test_each_command_is_named_in_its_own_package_only():
    """A command's name appears as a string literal only in its own package (``experiments/<name>/``:
    the command, its report and claims). One name is also an ordinary word elsewhere: "train" is the
    name of a dataset split in the corpus readers, "eval" the tag of the masks drawn while a model is
    evaluated."""
    ordinary = {"train": {"poslsh_cli.lm.data", "poslsh_cli.lm.documents"},
                "eval": {"poslsh_cli.lm.evaluate", "poslsh_cli.lm.positions"}}
    for exp in registry.experiments().values():
        home = "poslsh_cli.experiments." + exp.config_name
        assert (PKG / "experiments" / exp.config_name / "command.py").exists(), exp.name
        owners = []
        for path in PKG.rglob("*.py"):
            if module_name(path) in ordinary.get(exp.name, set()):
                continue
            tree = ast.parse(path.read_text())
            if any(isinstance(n, ast.Constant) and n.value == exp.name for n in ast.walk(tree)):
                owners.append(module_name(path))
        assert owners and all(o.startswith(home + ".") for o in owners), (exp.name, owners)


def test_no_command_imports_another_and_shared_helpers_import_no_command():
    """A command's package imports the shared helpers of ``experiments/`` (base, devices, machine,
    measure) and its own modules, never another command's; the shared helpers import no command."""
    commands = {p.name for p in (PKG / "experiments").iterdir() if (p / "command.py").exists()}
    assert {"train", "perplexity", "bench", "step_bench"} <= commands
    crossing = []
    for module, deps in import_graph().items():
        parts = module.split(".")
        if parts[:2] != ["poslsh_cli", "experiments"] or len(parts) < 3:
            continue
        mine = parts[2] if parts[2] in commands else None
        for dep in deps:
            d = dep.split(".")
            if d[:2] == ["poslsh_cli", "experiments"] and len(d) > 2 and d[2] in commands and d[2] != mine:
                crossing.append(f"{module} imports {dep}")
    assert not crossing, "\n".join(crossing)


def test_every_command_declares_the_scheme_keys_as_the_scheme_does():
    """A key that chooses a scheme (position, s, sigma, sampler, window_sigmas, alibi) means the same in
    every command: its help opens with the meaning attention.scheme declares, its element type is the
    declared one, and its bounds are the declared ones (a command may only widen one, giving the new
    value a meaning in its help: eval's s=0)."""
    import dataclasses
    import typing

    from poslsh_cli.attention.scheme import SCHEME_KEYS, Position
    from poslsh_cli.numerics.sampling import Sampler, Slopes

    element = {"position": Position, "s": int, "sigma": float, "sampler": Sampler, "window_sigmas": float,
               "alibi": Slopes}
    seen, wrong = set(), []
    for name, exp in registry.experiments().items():
        hints = typing.get_type_hints(exp.spec)
        for f in dataclasses.fields(exp.spec):
            if f.name not in SCHEME_KEYS:
                continue
            seen.add(f.name)
            meaning, bounds = SCHEME_KEYS[f.name]
            tp = hints[f.name]
            atoms = {a for a in typing.get_args(tp) or (tp,) if a is not type(None) and a is not Ellipsis}
            if not f.metadata["help"].startswith(meaning):
                wrong.append(f"{name}.{f.name}: help does not open with the declared meaning")
            if atoms != {element[f.name]} and not all(typing.get_args(a) == (element[f.name], ...) for a in atoms):
                wrong.append(f"{name}.{f.name}: type {tp}, not {element[f.name].__name__} (or a tuple of it)")
            for b in ("ge", "gt", "noun"):
                if b in bounds and f.metadata[b] != bounds[b] and not (b == "ge" and f.metadata[b] < bounds[b]):
                    wrong.append(f"{name}.{f.name}: {b}={f.metadata[b]}, declared {bounds[b]}")
    assert not wrong, "\n".join(wrong)
    assert seen == set(SCHEME_KEYS), f"scheme keys no command declares: {set(SCHEME_KEYS) - seen}"



def test_every_command_that_builds_the_byte_model_declares_its_sizes_as_declared():
    """The byte model's size keys (hidden, layers, heads, kv_heads, head_dim, intermediate) are declared
    once (lm.loading.ARCH_KEYS): every command that builds the model (train, step-bench, decode-bench)
    declares all of them with that help and bound, choosing only the default."""
    import dataclasses

    from poslsh_cli.lm.loading import ARCH_KEYS

    builders, wrong = [], []
    for name, exp in registry.experiments().items():
        fields = {f.name: f for f in dataclasses.fields(exp.spec)}
        if not set(ARCH_KEYS) <= set(fields):
            continue
        builders.append(name)
        for k, meaning in ARCH_KEYS.items():
            if fields[k].metadata["help"] != meaning or fields[k].metadata.get("ge") != 1:
                wrong.append(f"{name}.{k}")
    assert sorted(builders) == ["decode-bench", "step-bench", "train"] and not wrong, (builders, wrong)

def test_the_cli_starts_without_the_numerical_stack():
    code = "import sys, poslsh_cli.app.cli; print(sorted(m for m in ('torch','scipy','pandas','matplotlib') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def _top_level_imports(tree):
    """The import statements a module runs when it is imported (not those under TYPE_CHECKING or in functions)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return out


def _targets(node, modules):
    """The modules an import statement loads: ours by name (a name a package's ``__getattr__`` serves
    by the module its ``_WHERE`` names, or any its ``__getattr__`` imports), others by their top package."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    out = []
    for a in node.names:
        sub = f"{node.module}.{a.name}"
        if sub in modules:
            out.append(sub)
        elif node.module in modules and modules[node.module].name == "__init__.py":
            out += [node.module, *_served(modules[node.module], a.name)]
        else:
            out.append(node.module)
    return out


def _served(init: Path, name: str) -> list[str]:
    """The modules a package's ``__getattr__`` imports to serve ``name`` (none: the package defines it)."""
    tree = ast.parse(init.read_text())
    where = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "_WHERE" for t in n.targets)), {})
    if name in where:
        return [where[name]]
    getattr_ = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"), None)
    if getattr_ is None or any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name for n in tree.body):
        return []
    return [n.module for n in ast.walk(getattr_) if isinstance(n, ast.ImportFrom) and n.module]


def _heavy_closure():
    """Every module -> the heavy libraries importing it loads, read from the import statements it runs."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    direct = {name: [t for n in _top_level_imports(ast.parse(path.read_text())) for t in _targets(n, modules)]
              for name, path in modules.items()}
    memo: dict[str, set[str]] = {}

    def heavy(name, seen=()):
        if name in memo or name in seen:
            return memo.get(name, set())
        out = set()
        for t in direct.get(name, []):
            if t in modules:
                out |= heavy(t, (*seen, name))
            elif t.split(".")[0] in HEAVY:
                out.add(t.split(".")[0])
        memo[name] = out
        return out
    return modules, heavy


HEAVY = {"torch", "pandas", "scipy", "matplotlib", "transformers", "hydra", "datasets", "peft", "lm_eval"}


def test_an_import_inside_a_function_defers_a_heavy_library():
    """A function imports one of our modules only to keep a heavy library (torch, pandas, ...) out of
    its own module's import, e.g. the CLI's start; any other import belongs at the top. A package's
    ``__getattr__`` imports on first use by design."""
    modules, heavy = _heavy_closure()
    needless = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for fn in (f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   and f.name != "__getattr__"):
            for node in (n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))):
                ours = [t for t in _targets(node, modules) if t.startswith("poslsh_cli")]
                if ours and not set().union(*(heavy(t) for t in ours)) - heavy(name):
                    needless.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not needless, "\n".join(sorted(set(needless)))


def test_registry_lists_every_command_once_with_its_yaml():
    exps = registry.experiments()
    assert {"sample", "matrix-error", "block-stats", "output-error", "bench"} <= set(exps)
    for exp in exps.values():
        assert (poslsh_cli.core.config.CONF_DIR / f"{exp.config_name}.yaml").exists()
        assert exp.columns and exp.help.strip()


def test_adding_a_command_is_one_package_and_one_yaml(tmp_path):
    """A toy experiment package (its command module) + its YAML, placed in a copy of the package,
    becomes a working command with help, validation, a run directory and a summary: nothing else
    changes."""
    import shutil

    pkg = tmp_path / "poslsh_cli"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "experiments" / "toy").mkdir()
    (pkg / "experiments" / "toy" / "__init__.py").write_text("")
    (pkg / "experiments" / "toy" / "command.py").write_text('''
from dataclasses import dataclass
from poslsh_cli.core.config import Spec, key
from poslsh_cli.experiments.base import Experiment


@dataclass(frozen=True)
class ToySpec(Spec):
    x: tuple[int, ...] = key("values to square", [1, 2], ge=0)


EXPERIMENT = Experiment(
    name="toy", spec=ToySpec, help="Square numbers.", columns=("x", "y"),
    cells=lambda spec, ctx: [{"x": x} for x in spec.x],
    run_cell=lambda spec, key, ctx, work: ([{"x": key["x"], "y": key["x"] ** 2}], {}),
    summary=lambda df: (["x", "y"], [[str(a), str(b)] for a, b in zip(df.x, df.y)]))
''')
    (pkg / "conf" / "toy.yaml").write_text("defaults:\n  - _schema_toy\n  - _self_\n  - experiment: null\n"
                                           "x: [1, 2]\nseed: 0\nout: null\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = lambda *a: subprocess.run([sys.executable, "-m", "poslsh_cli", *a], capture_output=True, text=True,  # noqa: E731
                                    env=env, cwd=tmp_path, timeout=120)
    r = run("toy", "--help")
    assert r.returncode == 0 and "values to square" in r.stdout
    r = run("toy", "x=[3,4]", f"out={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "results.csv").read_text().splitlines() == ["x,y", "3,9", "4,16"]
    r = run("toy", "x=[-1]", f"out={tmp_path / 'bad'}")
    assert r.returncode == 2 and r.stderr.strip() == "poslsh toy: error: x must be >= 0, got -1"


# ---------------------------------------------------------------------------------------------
# run directories that can hold training


def test_metrics_log_appends_survives_a_cut_line_and_truncates_on_resume(tmp_path):
    log = MetricsLog(tmp_path / "metrics.csv", ["step", "loss", "val_loss"])
    for step in range(1, 6):
        log.append({"step": step, "loss": 1.0 / step, "val_loss": None if step % 2 else 0.5})
    with open(tmp_path / "metrics.csv", "a") as fh:  # a kill in the middle of a write
        fh.write("6,0.16")
    log = MetricsLog(tmp_path / "metrics.csv", ["step", "loss", "val_loss"])
    df = log.frame()
    assert list(df.step) == [1, 2, 3, 4, 5] and df.val_loss.isna().sum() == 3
    log.truncate_after("step", 3)  # resumed from the step-3 checkpoint: 4 and 5 are recomputed
    log.append({"step": 4, "loss": 0.25, "val_loss": 0.4})
    assert list(log.frame().step) == [1, 2, 3, 4]


def test_checkpoints_are_atomic_and_the_latest_wins(tmp_path):
    ck = Checkpoints(tmp_path / "checkpoints")
    assert ck.latest() is None
    for step in (10, 20, 30):
        ck.save(step, lambda d, step=step: (d / "weights.txt").write_text(str(step)), keep=2)
    assert [s for s, _ in ck.all()] == [20, 30]
    step, path = ck.latest()
    assert step == 30 and (path / "weights.txt").read_text() == "30"

    def broken(d):
        (d / "weights.txt").write_text("half")
        raise KeyboardInterrupt  # killed while saving

    with pytest.raises(KeyboardInterrupt):
        ck.save(40, broken)
    assert ck.latest()[0] == 30 and not [p for p in ck.root.iterdir() if p.name.startswith(".")]


def test_a_cell_has_its_own_work_directory(tmp_path):
    run = RunDir.open(tmp_path / "run", "toy", "x: 1\n")
    with run.own("poslsh toy"):
        run.start("poslsh toy", 0, 1)
        work = run.work({"position": "poslsh", "s": 10, "seed": 0})
        assert re.match(r"position-poslsh_s-10_seed-0-[0-9a-f]{6}$", work.path.name)
        work.metrics(["step", "loss"]).append({"step": 1, "loss": 2.0})
        work.checkpoints().save(1, lambda d: (d / "x").write_text("1"))
        assert (work.path / "metrics.csv").exists() and work.checkpoints().latest()[0] == 1
    assert json.loads((tmp_path / "run" / "meta.json").read_text())["command"] == "toy"


def test_modules_and_the_readme_stay_short_enough_to_read():
    """No module over 450 lines (a longer one is two jobs); the README at most 260 lines (the rest is
    in docs/)."""
    long = {module_name(p): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
    assert len((PKG.parent / "README.md").read_text().splitlines()) <= 260


def test_no_function_is_longer_than_eighty_lines():
    """A function over 80 lines does several things; each gets a name of its own (docstrings count)."""
    import ast

    long = []
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{module_name(p)}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long
