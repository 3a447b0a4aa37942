"""The docs cannot rot: README.md and docs/*.md build under `mkdocs build --strict`, and every `ragspec` command,
option, `make` target, pipeline spec, example script and test file they show exists. No network, no model: the
commands and options come from the Typer app's click command tree, the spec keys from the pydantic settings."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text"}  # fenced blocks that may show commands
FENCE = re.compile(r"^(?P<fence>```+|~~~+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
SEPARATORS = {"&&", "||", ";", "|"}
OPTION = re.compile(r"^--?[A-Za-z][\w-]*")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@cache
def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _split_code(text: str) -> tuple[list[tuple[str, str]], str]:
    """The fenced blocks as (language, body), and the text outside them."""
    blocks = [(m.group("info").strip().split(" ")[0].lower(), m.group("body")) for m in FENCE.finditer(text)]
    return blocks, FENCE.sub("", text)


def _shell_snippets(path: Path) -> list[str]:
    """Shell-like code: fenced shell/text/unlabelled blocks (line continuations joined) and inline code spans."""
    blocks, prose = _split_code(_text(path))
    out = []
    for lang, body in blocks:
        if lang in SHELL_LANGS:
            out.extend(re.sub(r"\\\n[ \t]*", " ", body).splitlines())
    out.extend(" ".join(m.group(1).split()) for m in INLINE.finditer(prose))
    return out


def _tokens(line: str) -> list[str]:
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose-like text: whitespace split, comment dropped
        return line.split(" #")[0].split()


def _invocations(tool: str, path: Path) -> list[tuple[str, list[str], str]]:
    """(first word after `tool`, the words after it up to a separator, the line) for every `tool ...` shown."""
    found = []
    for line in _shell_snippets(path):
        words = _tokens(line)
        for i, word in enumerate(words):
            if word != tool and not word.endswith("/" + tool):
                continue
            rest = []
            for w in words[i + 1:]:
                if w in SEPARATORS:
                    break
                rest.append(w)
            if rest:
                found.append((rest[0], rest[1:], line))
    return found


@cache
def _cli() -> dict[str, set[str]]:
    """Every `ragspec` command and its options, from the Typer app (the import path survives the cli/ package)."""
    import typer.main

    from ragspec.cli import app

    group = typer.main.get_command(app)
    commands = {}
    for name, command in group.commands.items():
        opts = {"--help"}
        for param in command.params:
            opts.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("-"))
        commands[name] = opts
    return commands


def _is_placeholder(word: str) -> bool:
    """COMMAND, INDEX, <command>, ...: a word standing for a command, not one."""
    return word.isupper() or word.startswith("<") or word in ("…", "...")


def test_the_cli_has_the_commands_the_docs_are_written_for():
    expected = {"index", "search", "info", "eval-retrieval", "eval-attribution", "eval-answers", "bench-replay",
                "bench-search", "bench", "ask", "serve", "models"}
    assert expected <= set(_cli()), f"commands missing from the CLI: {sorted(expected - set(_cli()))}"


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_ragspec_command_and_option_shown_exists(path):
    commands = _cli()
    problems = []
    checked = 0
    for word, args, line in _invocations("ragspec", path):
        if word.startswith("-") or _is_placeholder(word):
            continue  # `ragspec --help`, `ragspec COMMAND --help`
        names = word.split("/")  # `ragspec search/ask --where`: both
        for name in names:
            if name not in commands:
                problems.append(f"unknown command 'ragspec {name}' in: {line}")
                continue
            checked += 1
            for arg in args:
                option = OPTION.match(arg.lstrip("[("))
                if option and option.group(0) not in commands[name]:
                    problems.append(f"'ragspec {name}' has no option {option.group(0)}, shown in: {line}")
    assert not problems, "\n".join(problems)
    if path.name in ("README.md", "cli.md"):
        assert checked, f"no ragspec command found in {_rel(path)}: the parser is broken"


def test_the_cli_page_shows_every_command_and_option():
    text = _text(ROOT / "docs" / "cli.md")
    missing = []
    for name, options in _cli().items():
        if f"## `ragspec {name}`" not in text:
            missing.append(f"no section for ragspec {name}")
        for option in sorted(options - {"--help"}):
            if f"`{option}`" not in text and not re.search(rf"\[{re.escape(option)}[\] ]", text):
                missing.append(f"ragspec {name} {option}")
    assert not missing, "docs/cli.md does not describe: " + ", ".join(missing)


def _makefile_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", line)
        if m:
            targets.add(m.group(1))
    return targets


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_make_target_shown_exists(path):
    targets = _makefile_targets()
    assert {"install", "test", "quickstart"} <= targets
    problems = [f"no Makefile target '{target}', shown in: {line}"
                for target, _, line in _invocations("make", path)
                if not target.startswith("-") and "=" not in target and target not in targets]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", DOCS, ids=_rel)
def test_every_pipeline_example_and_test_file_named_exists(path):
    text = _text(path)
    named = set(re.findall(r"(?<![\w/.-])((?:pipelines/[\w.-]+\.yaml)|(?:examples/[\w.-]+\.py)|(?:tests/[\w.-]+\.py))",
                           text))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"{_rel(path)} names files that do not exist: {missing}"


def _spec_table_keys() -> list[str]:
    """The keys of the spec key table in docs/pipelines.md (`retriever.mode` / `top_k`: both in `retriever`)."""
    text = _text(ROOT / "docs" / "pipelines.md")
    section = text.split("### Spec keys", 1)[1]
    keys = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            if keys and not line.startswith("|"):
                break
            continue
        cell = line.split("|")[1]
        names = re.findall(r"`([^`]+)`", cell)
        head = names[0].rsplit(".", 1)
        keys.append(names[0])
        keys.extend(f"{head[0]}.{n}" for n in names[1:] if len(head) == 2)
    return keys


def _spec_keys() -> set[str]:
    from ragspec.spec import PipelineSpec

    keys = set()
    for name, field in PipelineSpec.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        if sub is None:
            keys.add(name)
        else:
            keys.update(f"{name}.{k}" for k in sub)
    return keys


def test_the_spec_table_lists_exactly_the_spec_keys():
    table, real = _spec_table_keys(), _spec_keys()
    assert len(table) > 40, "the spec key table was not found in docs/pipelines.md"
    unknown = sorted(set(table) - real)
    missing = sorted(real - set(table))
    assert not unknown, f"docs/pipelines.md lists keys the spec does not have: {unknown}"
    assert not missing, f"docs/pipelines.md does not list these spec keys: {missing}"


def test_docs_build_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install mkdocs-material mkdocstrings-python)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "serve.png").is_file(), "docs/serve.png is no longer used by the docs"


def test_no_module_is_over_600_lines():
    """docs/development.md: "No file in `ragspec/` is over 600 lines: one module, one job"."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "ragspec").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long


def test_readme_headline_table_is_rendered_from_benchmarks(tmp_path):
    """README's headline table is what `make benchmarks` renders from the JSONs under benchmarks/ (`--check`),
    within its limits (12 rows, no cell over 200 characters); a figure changed by hand fails here."""
    from ragspec.bench import render

    assert render.main(["--check"]) == 0, "README's headline table differs from benchmarks/: run `make benchmarks`"
    table = render.render().splitlines()[3:-1]
    assert 0 < len(table) <= render.MAX_ROWS
    # the check bites: a README whose table says another figure fails, and rendering puts it back
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    readme = _text(ROOT / "README.md")
    first = table[0].split(" | ")
    wrong = readme.replace(table[0], " | ".join(first[:2] + ["9.99×"] + first[3:]))
    (tmp_path / "README.md").write_text(wrong, encoding="utf-8")
    assert render.main(["--check", "--root", str(tmp_path)]) == 1
    assert render.main(["--root", str(tmp_path)]) == 0 and (tmp_path / "README.md").read_text() == readme


def test_readme_is_short_and_its_tables_cells_too():
    """README: at most 200 lines, no table cell over 200 characters; the guide pages under ~400 lines each."""
    lines = _text(ROOT / "README.md").splitlines()
    assert len(lines) <= 200
    cells = [c for line in lines if line.startswith("|") for c in line.strip("|").split(" | ")]
    assert max(len(c) for c in cells) <= 200
    for page in ("pipelines", "decoding", "models", "serving"):
        assert len(_text(ROOT / "docs" / f"{page}.md").splitlines()) <= 420, page
