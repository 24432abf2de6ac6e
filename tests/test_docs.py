"""Docs that are run: every fenced block of README.md and docs/**/*.md is a command or snippet this file runs, and
what a page quotes as printed is what is printed now, all of it and in order (`assert_quoted`: whitespace, box
drawing and VOLATILE figures such as timings masked on both sides; a line `...` stands for lines left out). A block
that cannot run here is in EXCLUDED with the reason; a new block that is neither run nor excluded fails
`test_every_block_is_run_or_excluded`.

Each command runs as written on the machine its page names: `python -m recipes.train.plan` builds from shapes
alone (any preset, on the CPU); a training command on the tiny preset is a CPU command, and one that sets up fake
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N python -m ...`) runs in a process of its own; a command
for a GPU runs in smoke form (`smoke`: the tiny preset, 2 layers, seq 32, 2 steps), and a GPU's quoted output
(`GPU-OUTPUT`) says its date and commit. A page in SESSIONS runs as one session in an empty directory. The
examples (`python docs/examples/...`) run as written. Also checked against the program: the test counts
(`pytest --collect-only`), the flags and `--model` choices the pages name, the renamed names of docs/changes.md,
and, where mkdocs is installed (`pip install -e ".[docs]"`), the site's strict build and an API entry for every
public name.
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
                             "bench/results/ and docs/benchmarks/)",
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
# Pages whose blocks are one session: run in order, in one empty directory, each command as written (the CPU).
SESSIONS = {"docs/text-data.md": "a corpus and a tokenizer made offline, then a run on them"}


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
    if cmds and cmds[0].startswith("python -m pytest --collect-only"):
        return "collect"
    runnable = [c for c in cmds if not any(c.startswith(x) for x in EXCLUDED_COMMANDS)]
    first = runnable[0] if runnable else ""
    for piece in EXCLUDED:
        if piece in block.text:
            return "excluded"
    if cmds and not runnable:
        return "excluded"   # installs only (EXCLUDED_COMMANDS)
    if block.file in SESSIONS:
        return "session"
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
    command without a transcript (a compile each), a session, the DeepSeek-V3 tour (eager calls of the tiny
    model), the plans of the 8B at 524,288 positions and its automatic recipe under a tight budget (a search of
    tiles and groups), a planner command that searches (`--recipe auto`, `--max-batch`) or plans every recipe
    (`--plot`)."""
    heavy = ("deepseek_v3(", "seq=524288", 'plan(cfg, "auto"')
    searches = ("--recipe auto", "--max-batch", "--plot")
    return (kind(block) in ("mesh", "example", "session") or (kind(block) == "train" and not commands(block)[1])
            or (block.lang == "python" and any(h in block.text for h in heavy))
            or (kind(block) == "plan" and any(h in block.text for h in searches)))


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
    (r"deselected\) in [\d.]+s", "deselected)"),
    (r"of [\d.]+ GiB \(this machine's RAM", "of N GiB (this machine's RAM"),
    # printed only where the RAM is smaller than the plan's host bytes
    (r"warning: host memory [\d.]+ GiB is over this machine's RAM \([\d.]+ GiB\)", ""),
)]


def norm(text: str) -> str:
    """Each line with box drawing and VOLATILE figures masked and its whitespace collapsed; blank lines dropped."""
    lines = []
    for line in text.splitlines():
        line = BOX.sub(" ", line)
        for pattern, repl in VOLATILE:
            line = pattern.sub(repl, line)
        if line.split():
            lines.append(" ".join(line.split()))
    return "\n".join(lines)


ELIDED = "..."   # a quoted line that is only this stands for any number of printed lines


def quote_pattern(quoted: list[str]) -> str:
    """The regular expression the normalized printed text must match: each quoted line in turn, a space or a line
    break wherever one of them is (a terminal's wrapping), an `...` line as any lines, `...` inside a line as any
    part of that line (never of the next: "for cpu ..." does not hide a printed line after it)."""
    pattern = ""
    for piece in map(norm, quoted):
        if piece == ELIDED:
            pattern += r"(?:[^\n]*\n)*?"
        elif piece:
            parts = [re.escape(part).replace("\\ ", "[ \n]") for part in piece.split(ELIDED)]
            pattern += "[^\n]*?".join(parts) + "[ \n]"
    return pattern


def assert_quoted(quoted: list[str], printed: str, where: str) -> None:
    """The quoted lines are what is printed, all of it and in order, up to whitespace (line breaks included: a
    terminal's wrapping), box drawing and VOLATILE figures; a line `...` stands for lines left out, and `...` inside
    a line for a part of it left out."""
    if not quoted:   # a command the docs quote no output of
        return
    have = norm(printed) + "\n"
    if re.fullmatch(quote_pattern(quoted), have, re.S):
        return
    missing = [q for q in quoted if norm(q) not in ("", ELIDED) and not re.search(quote_pattern([q]), have, re.S)]
    raise AssertionError(f"{where}: the docs' quote is not what is printed (quoted lines not printed: {missing}; "
                         f"else a printed line is not quoted, or the order differs)\n--- printed (its end):\n"
                         f"{printed[-4000:]}")


def test_the_comparison_sees_a_changed_figure_a_missing_line_and_an_extra_one():
    printed = ("step     60  loss 2.9169  grad 0.714  tok/s 20,330  TFLOP/s 0.012  MFU -\n"
               "│ parameters │ 417.2 KiB │\n│ gradients │ 417.2 KiB │")
    quoted = ["step     60  loss 2.9169  grad 0.714  tok/s 11,125  TFLOP/s 0.00658  MFU -  ETA 3s",
              "│ parameters │       417.2 KiB │", "│ gradients │       417.2 KiB │"]
    assert_quoted(quoted, printed, "ok")   # timings and table padding differ
    assert_quoted([quoted[0], "...", quoted[2]], printed, "elided")
    assert_quoted([quoted[0], "...", quoted[1], "...", quoted[2]], printed, "an elision of nothing")
    assert_quoted(["step     60  loss 2.9169 ... MFU -", "...", quoted[2]], printed, "elided within a line")
    for changed in ([quoted[0].replace("2.9169", "2.9170"), *quoted[1:]],   # a figure
                    [quoted[0], "│ parameters │ 417.3 KiB │", quoted[2]],
                    quoted[:2],                                              # a printed line not quoted
                    [*quoted, "loss 6.1475 (step 1) -> 2.9169 (step 60)"],   # a quoted line not printed
                    [quoted[2], quoted[1], quoted[0]]):                      # out of order
        with pytest.raises(AssertionError):
            assert_quoted(changed, printed, "changed")
    # A line that ends in "..." (as "compiling ... for cpu ...") elides nothing of the lines after it.
    printed = "compiling the step for cpu ...\nloss: the whole sequence at once\nmodel llama3 tiny"
    assert_quoted(["compiling the step for cpu ...", "loss: the whole sequence at once", "model llama3 tiny"],
                  printed, "a line ending in dots")
    with pytest.raises(AssertionError):
        assert_quoted(["compiling the step for cpu ...", "model llama3 tiny"], printed, "a line hidden after dots")


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


# -- recipes.train: as written on the CPU, in smoke form where the page names a GPU -------------------------------
ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")


def parse(cmd: str) -> tuple[dict[str, str], list[str]]:
    """(the environment assignments a command starts with, the arguments after `python -m MODULE`)."""
    words = shlex.split(cmd)
    env = {}
    while words and ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[:2] == ["python", "-m"], cmd
    return env, words[3:]


def on_the_cpu(argv: list[str]) -> bool:
    """A training command for the CPU: the tiny preset (a full-size preset names a GPU)."""
    return "--preset" in argv and argv[argv.index("--preset") + 1] == "tiny"


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
    if "auto" in argv and argv[argv.index("auto") - 1] == "--recipe":   # the CPU has no budget, link or FLOP table
        out += ["--hbm-limit", "1", "--link", "10", "--peak-tflops", "1"]
    return out


@pytest.mark.parametrize("block", params(("train",)))
def test_train_commands_run(block, monkeypatch, tmp_path):
    """A command for the CPU (the tiny preset) runs as written, its transcript compared; one for a GPU in smoke
    form."""
    from recipes import train
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")   # set: none added late
    monkeypatch.setenv("ZOO_TOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    cmds, quoted = commands(block)
    for cmd in cmds:
        if any(cmd.startswith(c) for c in EXCLUDED_COMMANDS) or (cmd in TRANSCRIBED and not quoted):
            continue
        env, argv = parse(cmd)
        as_written = bool(quoted) or on_the_cpu(argv)
        # a GPU command's environment (the allocator's share, the pinned pool) means nothing in its smoke form
        assert not (env and as_written), f"{block.id}: {cmd}: an environment for a command run in this process"
        rc, printed = run_main(train, argv if as_written else smoke(argv))
        assert rc == 0, f"{block.id}: {cmd}\n{printed}"
        assert_quoted(quoted, printed, block.id)


@pytest.mark.multidevice
@pytest.mark.parametrize("block", params(("mesh",)))
def test_mesh_commands_run(block, tmp_path):
    """A command for the CPU sets its fake devices itself (`XLA_FLAGS=--xla_force_host_platform_device_count=N`,
    read when JAX starts: a process of its own) and runs as written; a command for GPUs runs in smoke form on 8
    fake CPU devices."""
    for cmd in commands(block)[0]:
        env, argv = parse(cmd)
        if env:
            assert "--xla_force_host_platform_device_count" in env.get("XLA_FLAGS", ""), cmd
            flags = " ".join(f for f in (cpu_env().get("XLA_FLAGS", ""), env.pop("XLA_FLAGS")) if f)
            run_env = {**cpu_env(), **env, "XLA_FLAGS": flags}
        else:
            argv, run_env = smoke(argv), cpu_env(8)
        out = subprocess.run([sys.executable, "-m", "recipes.train", *argv], cwd=tmp_path, env=run_env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{cmd}\n" + out.stdout[-3000:] + out.stderr[-3000:]
        assert " (step 1) -> " in out.stdout, out.stdout[-3000:]


# -- pages run as one session, and the test counts ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(SESSIONS))
def test_session_pages_run_in_order_from_nothing(page, tmp_path, monkeypatch):
    """Every command of the page's blocks in order, as written, in one empty directory: `python -c` code, the
    tokenizer and training commands; each transcript compared."""
    from recipes import train
    from recipes.train import tokenizer
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")   # set: none added late
    monkeypatch.setenv("ZOO_TOKEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    ran = 0
    for block in (b for b in ALL if b.file == page):
        cmds, quoted = commands(block)
        for cmd in cmds:
            if any(cmd.startswith(c) for c in EXCLUDED_COMMANDS):
                continue
            if cmd.startswith("python -c "):
                printed = io.StringIO()
                with contextlib.redirect_stdout(printed):
                    exec(compile(shlex.split(cmd)[2], block.id, "exec"), {"__name__": "__docs__"})
                rc, printed = 0, printed.getvalue()
            else:
                module = {"recipes.train": train, "recipes.train.tokenizer": tokenizer}[shlex.split(cmd)[2]]
                rc, printed = run_main(module, parse(cmd)[1])
            assert rc in (0, None), f"{block.id}: {cmd}\n{printed}"
            assert_quoted(quoted, printed, block.id)
            ran += 1
    assert ran >= 3


@pytest.mark.parametrize("block", params(("collect",)))
def test_the_test_counts_are_what_pytest_collects(block):
    """The docs' collection counts (the default set and the slow set it deselects) are this checkout's, counted by
    collecting, not by running the suite. Counted without torch (its parity tests are collected only with it)."""
    import importlib.util
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed: the transformers parity tests are collected too (the docs count without)")
    (cmd,), quoted = commands(block)
    out = subprocess.run([sys.executable, "-m", *shlex.split(cmd)[2:], "-p", "no:cacheprovider"], cwd=ROOT,
                         env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert_quoted(quoted, out.stdout, block.id)


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
    printed = io.StringIO()
    for c in code:
        with contextlib.redirect_stdout(printed):
            exec(compile(c, block.id, "exec"), {"__name__": "__docs__"})
    assert_quoted(printed_comments(block.text) if block.lang == "python" else [], printed.getvalue(), block.id)


def printed_comments(text: str) -> list[str]:
    """The output a Python snippet quotes: the `# ` comment lines right after each line that calls print()."""
    out, after_print = [], False
    for line in text.splitlines():
        if after_print and line.startswith("# "):
            out.append(line[2:])
            continue
        after_print = line.lstrip().startswith("print(")
    return out


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
        exec(old, {"zoo": zoo, "family": None, "cfg": None, "recipe": None, "path": "no/such/checkpoint"})
    assert f"{type(e.value).__name__}: {e.value}" == said


def test_the_renames_table_is_read():
    olds = [old for old, _ in renames()]
    assert "python -m recipes.plan ..." in olds and "zoo.from_hf(path, mtp=False)" in olds and len(olds) >= 10


# -- flags, choices and GPU outputs --------------------------------------------------------------------------------
# Flags of other programs the docs name, by flag: the program.
OTHER_FLAGS = {"--strict": "mkdocs build", "--site-dir": "mkdocs build", "--dist": "pytest-xdist",
               "--logdir": "tensorboard", "--collect-only": "pytest", "--gaps": "python -m bench.trace_summary"}
# Pages about the benchmarks: their flags are the bench scripts' (bench/), not the commands'.
BENCH_PAGES = ("docs/benchmarks/", "docs/offload-profile.md")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w])")
COMMAND = re.compile(r"python -m (recipes\.train(?:\.plan|\.tokenizer)?)\b((?:\\\n|[^`\n])*)")


def command_flags() -> dict[str, set[str]]:
    """{module: its flags} of the project's three commands."""
    import importlib
    return {m: {s for a in importlib.import_module(m).parser()._actions for s in a.option_strings}
            for m in ("recipes.train", "recipes.train.plan", "recipes.train.tokenizer")}


def test_the_flags_the_docs_name_are_the_commands_own():
    """Each flag a page names is a flag of one of the commands (or of another program it names, OTHER_FLAGS), and
    each flag of a written-out command (`python -m recipes.train...`) is that command's own, spelt in full."""
    flags = command_flags()
    known = set().union(*flags.values(), OTHER_FLAGS)
    wrong = []
    for path in DOCS:
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        if not rel.startswith(BENCH_PAGES):
            wrong += [f"{rel}: {f}" for f in sorted(set(FLAG.findall(text)) - known)]
        for m in COMMAND.finditer(text):
            wrong += [f"{rel}: {m.group(0)[:60]}...: {f} is not a flag of {m.group(1)}"
                      for f in FLAG.findall(m.group(2)) if f not in flags[m.group(1)]]
    assert not wrong, "\n".join(wrong)


def test_model_choices_in_the_docs_are_the_registered_families():
    """A list of `--model` choices (`--model a|b|c`) names every registered family."""
    from zoo.models import registry
    lists = [(p.relative_to(ROOT).as_posix(), m.group(1)) for p in DOCS
             for m in re.finditer(r"--model ([a-z0-9_]+(?:\|[a-z0-9_]+)+)", p.read_text())]
    assert lists, "no --model list found"
    for rel, choices in lists:
        assert set(choices.split("|")) == set(registry.FAMILIES), (rel, choices)


def test_every_gpu_output_says_its_date_and_commit():
    """A GPU's output (a `GPU-OUTPUT` block, which cannot run here) is introduced by the date it was measured and
    the commit of the code that printed it."""
    found = 0
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(re.escape(GPU_OUTPUT), text):
            found += 1
            before = text[:m.start()].rsplit("\n\n", 2)[-2:]   # the paragraph that introduces it
            intro = " ".join(before)
            assert re.search(r"\b20\d\d-\d\d-\d\d\b", intro) and re.search(r"\bcommit [0-9a-f]{7,40}\b", intro), (
                f"{path.relative_to(ROOT)}: a GPU output without its date and commit: {intro[-300:]!r}")
    assert found >= 2
