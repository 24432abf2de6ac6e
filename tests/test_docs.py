"""Docs that are run: every fenced block of README.md and docs/**/*.md is a command or snippet this file runs (in a
smoke form where the documented one needs a GPU, two hosts or minutes), comparing the lines the docs quote as
printed with what is printed now. A block that cannot run here is in EXCLUDED with the reason; a new block that is
neither run nor excluded fails `test_every_block_is_run_or_excluded`.

Smoke form of `python -m recipes.train` (SMOKE): the tiny preset, 2 layers, seq 32, 2 steps; the README's main job
(the tiny preset already) runs as written and its quoted lines are compared. `python -m recipes.train.plan` builds from
shapes alone, so its documented commands run as written (the full-size presets, on the CPU) and are compared.
Volatile figures (timings, tokens/s, this machine's RAM, the ETA) are masked on both sides (VOLATILE). The examples
(`python docs/examples/...`) run as written, their quoted output compared. The site itself is built with
`mkdocs build --strict` where mkdocs is installed (`pip install -e ".[docs]"`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import cpu_env

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# Blocks that are not run, by a piece of their first command: why.
EXCLUDED = {
    "pip install -e \".[cuda]\"": "installs JAX's CUDA build (GPU only; CI builds its environments in .ci/run)",
    "JAX_COORDINATOR_ADDRESS=10.0.0.1:1234": "two hosts with 8 GPUs each (the multi-host path is not tested here)",
    "python -m bench.run ": "GPU benchmarks, one device call each (their records are in "
                             "bench/results/ and docs/benchmarks.md)",
    "JAX_COORDINATOR_ADDRESS=127.0.0.1:12355": ("two processes: tests/train/test_multiprocess.py runs them "
                                                "(its own checks)"),
    "mkdocs build": "the site's build: test_the_site_builds runs it",
    "--8<--": "an excerpt of an example file, included by the site's build: tests/test_examples.py runs the file",
}
# Commands of a run block that are not run, by their start: why.
EXCLUDED_COMMANDS = {
    "python -m pytest": "the test suite itself (this file is part of it)",
    "pip install": "installs packages: the environment running this is installed (CI builds it: .ci/run)",
}
# The GPU quick start's output is the lead's H200 run: a placeholder until it is pasted, then a GPU's lines.
GPU_OUTPUT = "<!-- GPU-OUTPUT"


@dataclasses.dataclass
class Block:
    file: str
    line: int
    lang: str
    text: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            line = text[:m.start()].count("\n") + 1
            if GPU_OUTPUT in text[max(0, m.start() - 200):m.start()]:
                continue   # the placeholder for the H200's output (README, GPU quick start)
            out.append(Block(str(path.relative_to(ROOT)), line, m.group(1), m.group(2)))
    return out


def commands(block: Block) -> tuple[list[str], list[str]]:
    """(shell commands, quoted output lines) of a bash block or a `$ command` transcript. Continuation lines are
    joined, comments dropped, `pip install ... &&` prefixes dropped (the environment is installed)."""
    lines = block.text.splitlines()
    quoted: list[str] = []
    if lines and lines[0].startswith("$ "):
        n = 1
        while lines[n - 1].rstrip().endswith("\\"):
            n += 1
        cmd = " ".join(x.rstrip("\\ ").strip() for x in lines[:n])[2:]
        return [cmd], lines[n:]
    cmds, current = [], ""
    for line in lines:
        line = line.split("  #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        current += line.rstrip("\\").strip() + " "
        if line.endswith("\\"):
            continue
        if current.strip():
            cmds.append(current.strip())
        current = ""
    return [c.split("&&")[-1].strip() for c in cmds], quoted


def kind(block: Block) -> str:
    if block.lang == "python":
        return "excluded" if "--8<--" in block.text else "python"
    cmds = commands(block)[0]
    runnable = [c for c in cmds if not any(c.startswith(x) for x in EXCLUDED_COMMANDS)]
    first = runnable[0] if runnable else ""
    for piece in EXCLUDED:
        if piece in block.text:
            return "excluded"
    if cmds and not runnable:
        return "excluded"   # installs only (EXCLUDED_COMMANDS)
    if first.startswith("python docs/examples/"):
        return "example"
    if "python -m recipes.train.plan" in first:
        return "plan"
    if "python -m recipes.train" in first:
        return "mesh" if "--mesh" in first else "train"
    if first.startswith("python -c"):
        return "python -c"
    return "unknown"


ALL = blocks()
# Commands whose output a transcript quotes: run there, as written, and not again in smoke form elsewhere.
TRANSCRIBED = {commands(b)[0][0] for b in ALL if commands(b)[1]}


def slow(block: Block) -> bool:
    """Marked `slow` (pytest -m "not slow" leaves them out): a process of its own on 8 fake devices, a training
    command in smoke form (a compile each), the DeepSeek-V3 tour (eager calls of the tiny model)."""
    return (kind(block) in ("mesh", "example") or (kind(block) == "train" and not commands(block)[1])
            or (block.lang == "python" and "deepseek_v3(" in block.text))


def params(kinds: tuple[str, ...]) -> list:
    return [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if slow(b) else []) for b in ALL if kind(b) in kinds]


def test_every_block_is_run_or_excluded():
    unknown = [b.id for b in ALL if kind(b) == "unknown"]
    assert not unknown, f"blocks neither run by this test nor in EXCLUDED (with a reason): {unknown}"
    assert len(ALL) >= 10


# -- comparing quoted output ------------------------------------------------------------------------------------
BOX = re.compile(r"[\u2500-\u257f]")
VOLATILE = [(re.compile(p), r) for p, r in (
    (r"tok/s [\d,]+", "tok/s N"), (r"TFLOP/s [\d.e+-]+  MFU", "TFLOP/s N  MFU"), (r"ETA \S+", ""),
    (r"compiled the step in [\d.]+ s", "compiled the step in N s"),
    (r"of [\d.]+ GiB \(this machine's RAM", "of N GiB (this machine's RAM"),
    # printed only where the RAM is smaller than the plan's host bytes
    (r"warning: host memory [\d.]+ GiB is over this machine's RAM \([\d.]+ GiB\)", ""),
)]


def norm(text: str) -> str:
    text = BOX.sub(" ", text)
    for pattern, repl in VOLATILE:
        text = pattern.sub(repl, text)
    return " ".join(text.split())


def assert_quoted(quoted: list[str], printed: str, where: str) -> None:
    """Every quoted line (but elisions) is printed, up to whitespace, box drawing and VOLATILE figures."""
    have = norm(printed)
    missing = [q for q in quoted if "..." not in q and norm(q) and norm(q) not in have]
    assert not missing, f"{where}: lines the docs quote that are not printed:\n" + "\n".join(missing) + \
        f"\n--- printed:\n{printed}"


def test_the_comparison_sees_a_changed_figure():
    printed = "step     60  loss 2.9169  grad 0.714  tok/s 20,330  TFLOP/s 0.012  MFU -\n│ parameters │ 417.2 KiB │"
    assert_quoted(["step     60  loss 2.9169  grad 0.714  tok/s 11,125  TFLOP/s 0.00658  MFU -  ETA 3s",
                   "│ parameters │       417.2 KiB │"], printed, "ok")   # timings and table padding differ
    for changed in ("step     60  loss 2.9170  grad 0.714  tok/s 1  TFLOP/s 1  MFU -", "│ parameters │ 417.3 KiB │"):
        with pytest.raises(AssertionError):
            assert_quoted([changed], printed, "changed")


def run_main(module, argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = module.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue()


# -- recipes.train.plan: as written ------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", params(("plan",)))
def test_plan_commands_print_what_the_docs_quote(block, monkeypatch, tmp_path):
    from recipes.train import plan
    monkeypatch.setenv("COLUMNS", "200")   # rich's tables unwrapped, as quoted
    monkeypatch.chdir(tmp_path)            # --plot writes here
    (cmd,), quoted = commands(block)
    argv = shlex.split(cmd)[3:]
    if "--plot" in argv:
        pytest.importorskip("matplotlib")   # the test extra has it; --plot refuses without it, as it should
    rc, printed = run_main(plan, argv)
    assert rc in (0, None), printed
    assert_quoted(quoted, printed, block.id)
    if "--plot" in argv:
        assert (tmp_path / argv[argv.index("--plot") + 1]).stat().st_size > 10_000


# -- recipes.train: the README's main job as written, the others in smoke form ------------------------------------
def smoke(argv: list[str]) -> list[str]:
    """The command at tiny shapes: the tiny preset (2 layers), seq 32, at most batch 8, 2 steps."""
    out, i = [], 0
    values = {"--preset": "tiny", "--seq": "32", "--steps": "2"}
    while i < len(argv):
        flag = argv[i]
        if flag in values or flag == "--batch":
            out += [flag, values.get(flag) or str(min(int(argv[i + 1]), 8))]
            i += 2
        elif flag == "--set" and argv[i + 1].startswith("num_layers="):
            i += 2
        else:
            out.append(flag)
            i += 1
    for flag, value in values.items():
        if flag not in out:
            out += [flag, value]
    return out


@pytest.mark.parametrize("block", params(("train",)))
def test_train_commands_run(block, monkeypatch, tmp_path):
    from recipes import train
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")   # set: none added late
    monkeypatch.setenv("ZOO_TOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    cmds, quoted = commands(block)
    for cmd in cmds:
        if any(cmd.startswith(c) for c in EXCLUDED_COMMANDS) or (cmd in TRANSCRIBED and not quoted):
            continue
        argv = shlex.split(cmd)[3:]
        as_written = bool(quoted)   # a transcript (the README's main job, the tiny preset): run and compared
        if not as_written:
            argv = smoke(argv)
        if "--tokenizer" in argv:   # the text example: a corpus and a tokenizer made here (no downloads)
            text_fixture(tmp_path, argv)
        rc, printed = run_main(train, argv)
        assert rc == 0, f"{block.id}: {cmd}\n{printed}"
        if as_written:
            assert_quoted(quoted, printed, block.id)


def text_fixture(tmp_path: Path, argv: list[str]) -> None:
    """Writes --data's corpus and --tokenizer's tokenizer.json, and sets vocab_size to the tokenizer's."""
    from tests.train.test_text import DOCS, make_tokenizer
    make_tokenizer(tmp_path / argv[argv.index("--tokenizer") + 1])
    corpus = tmp_path / argv[argv.index("--data") + 1]
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "a.txt").write_text(" ".join(DOCS) * 400)
    argv[argv.index("--set") + 1] = "vocab_size=300"


@pytest.mark.multidevice
@pytest.mark.parametrize("block", params(("mesh",)))
def test_mesh_commands_run_on_fake_devices(block, tmp_path):
    """On 8 fake CPU devices (the flag must be set before JAX starts: a process of its own), every command of the
    block in smoke form, in that one process."""
    argvs = [smoke(shlex.split(c)[3:]) for c in commands(block)[0]]
    script = ("import sys; from recipes import train\n"
              f"for argv in {argvs!r}:\n"
              "    rc = train.main(argv)\n"
              "    assert rc == 0, (argv, rc)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=cpu_env(8), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count(" (step 1) -> ") == len(argvs), out.stdout[-3000:]


# -- Python snippets and python -c ---------------------------------------------------------------------------------
def hf_checkpoint(tmp_path: Path) -> dict[str, str]:
    """A tiny Llama written by to_hf, standing in for the snippet's downloaded checkpoint."""
    from flax import nnx

    import recipes
    import zoo
    model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), recipe=recipes.llama3.RECIPES["qkv_offload"],
                              rngs=nnx.Rngs(0))
    zoo.to_hf(model, tmp_path / "hf")
    return {'"path/to/Llama-3.1-8B"': repr(str(tmp_path / "hf")), '"out/"': repr(str(tmp_path / "out"))}


@pytest.mark.parametrize("block", params(("python", "python -c")))
def test_python_snippets_run(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if kind(block) == "python -c":
        code = [shlex.split(c)[2] for c in commands(block)[0]]
    else:
        text = block.text
        if "zoo.from_hf(" in text:
            for old, new in hf_checkpoint(tmp_path).items():
                text = text.replace(old, new)
        code = [text if "import zoo" in text else "import zoo\n" + text]
    for c in code:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(c, block.id, "exec"), {"__name__": "__docs__"})


# -- the examples and the site ------------------------------------------------------------------------------------
@pytest.mark.parametrize("block", params(("example",)))
def test_example_scripts_print_what_the_docs_quote(block):
    cmds, quoted = commands(block)
    for cmd in cmds:
        if cmd in TRANSCRIBED and not quoted:
            continue
        out = subprocess.run(shlex.split(cmd.replace("python ", f"{sys.executable} ", 1)), cwd=ROOT, env=cpu_env(),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{block.id}: {cmd}\n{out.stdout[-2000:]}{out.stderr[-2000:]}"
        assert_quoted(quoted, out.stdout, block.id)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with `mkdocs build --strict` (warnings are errors: a broken link, a missing page, a
    docstring mkdocstrings cannot render) and the repository's mkdocs.yml."""
    pytest.importorskip("mkdocs", reason='the docs extra is not installed (pip install -e ".[docs]")')
    pytest.importorskip("mkdocstrings")
    out_dir = tmp_path_factory.mktemp("site")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**cpu_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out_dir


def test_the_site_builds(site):
    assert (site / "api" / "plan" / "index.html").stat().st_size > 10_000


# The modules whose `__all__` is the public API: each name there has an entry in the API reference.
PUBLIC = ["zoo", "zoo.models", "zoo.layers", "zoo.plan", "zoo.hf", "zoo.hf.load", "zoo.hf.save"]


def public_modules() -> list[str]:
    """PUBLIC, each family's package (zoo.models.<package>: its config, builder and the rest of its `__all__`) and
    each family's recipe set (`recipes.<family>`: RECIPES and DEFAULT)."""
    from zoo.models import registry
    families = registry.FAMILIES.values()
    return PUBLIC + sorted({f.config_cls.__module__.rsplit(".", 1)[0] for f in families}) + sorted(
        f"recipes.{f.name}" for f in families)


def test_every_public_name_has_an_api_entry(site):
    """mkdocstrings' inventory (objects.inv) holds an entry for every name in the `__all__` of each public module:
    a class or function by the path it is defined at or one it is re-exported at, anything else by its public path.
    A name added to `__all__` without a page that renders it fails here."""
    import importlib
    import types

    import griffe
    from mkdocstrings import Inventory
    with open(site / "objects.inv", "rb") as f:
        entries = set(Inventory.parse_sphinx(f))
    loaded = griffe.GriffeLoader(search_paths=[str(ROOT)])
    for package in ("zoo", "recipes"):
        loaded.load(package)
    loaded.resolve_aliases(external=False)
    targets = set(entries)
    for entry in entries:   # the object each entry documents, where it is defined
        try:
            obj = loaded.modules_collection[entry]
            targets.add(obj.final_target.path if obj.is_alias else obj.path)
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    missing = []
    for name in public_modules():
        module = importlib.import_module(name)
        assert hasattr(module, "__all__"), f"{name} has no __all__: its public names are not said"
        for attr in module.__all__:
            obj = getattr(module, attr, None)
            if obj is None:
                obj = importlib.import_module(f"{name}.{attr}")
            public = f"{name}.{attr}"
            if isinstance(obj, type | types.FunctionType):   # where it is defined (a builder shares its package's name)
                where = {f"{obj.__module__}.{obj.__qualname__}"}
            else:
                where = {public, obj.__name__ if isinstance(obj, types.ModuleType) else public}
                with contextlib.suppress(KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
                    known = loaded.modules_collection[public]
                    where.add(known.final_target.path if known.is_alias else known.path)
            if not where & targets:
                missing.append(public)
    assert not missing, f"public names without an entry in the API reference (docs/api/): {missing}"


def test_the_models_table_is_the_registry():
    """docs/models.md's table lists every registered family, with its builder, config class, presets and recipes as
    the registry and `recipes.<family>` have them now (a family added or a recipe renamed shows up here)."""
    import recipes
    from zoo.models import registry
    rows = [line for line in (ROOT / "docs" / "models.md").read_text().splitlines()
            if line.startswith("| `") and line.count("|") == 6]
    table = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0].strip("`")] = cells[1:]
    assert set(table) == set(registry.FAMILIES)
    for name, (builder, config, presets, recipe_cells) in table.items():
        f, rs = registry.family(name), getattr(recipes, name)
        assert builder == f"`zoo.models.{name}`" and config == f"`zoo.models.{f.config_cls.__name__}`", name
        assert set(re.findall(r"`(\w+)`", presets)) == set(f.presets()), name
        assert re.findall(r"`(\w+)`", recipe_cells) == list(rs.RECIPES), name
        assert f"`{rs.DEFAULT}` (default)" in recipe_cells, name


# -- renamed names (docs/changes.md) -----------------------------------------------------------------------------
def renames() -> list[tuple[str, str]]:
    """(old form, what it gives) of each row of docs/changes.md's table."""
    rows = []
    for line in (ROOT / "docs" / "changes.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        if len(cells) == 3:
            old = cells[0].strip("`").strip()
            said = re.match(r"(`+) ?(.*?) ?\1", cells[2])
            rows.append((old, said.group(2)))
    return rows


@pytest.mark.parametrize("old, said", renames(), ids=[old for old, _ in renames()])
def test_each_renamed_name_says_its_new_form(old, said):
    """Every row of the "what changed" page: the old form fails with the one line the page quotes, which names the
    new form (a command exits 2; a Python name raises before doing anything else)."""
    if old.startswith("python -m "):
        module = old.split()[2]
        out = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                             timeout=120)
        assert (out.returncode, out.stdout, out.stderr.strip()) == (2, "", said)
        return
    import zoo
    with pytest.raises(Exception) as e:
        exec(old, {"zoo": zoo, "cfg": None, "recipe": None, "path": "no/such/checkpoint"})
    assert f"{type(e.value).__name__}: {e.value}" == said


def test_the_renames_table_is_read():
    olds = [old for old, _ in renames()]
    assert "python -m recipes.plan ..." in olds and "zoo.from_hf(path, mtp=False)" in olds and len(olds) >= 10
