"""Every ```python block of README.md and of each docs/*.md page runs, in a directory holding the
files the examples name: model.safetensors (with lm_head.weight) and checkpoint/ (three shards and
an index). Blocks that need what a test machine lacks (a store, several processes) are ```text.
Every relative link of those pages names a file (and a heading, after `#`) that exists, and README
stays short enough to read in five minutes."""

import json
import logging
import os
import re
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250


def _name(page):
    return page.relative_to(ROOT).as_posix()


def _python_blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S)


EXAMPLES = [(_name(page), index, code) for page in PAGES for index, code in enumerate(_python_blocks(page))]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    st.save_file({"lm_head.weight": torch.randn(2048, 16), "embed.weight": torch.randn(100, 16)}, tmp_path / "model.safetensors")
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    weight_map = {}
    for i in range(3):
        name = f"model-0000{i + 1}-of-00003.safetensors"
        tensors = {f"layer{i}.w": torch.randn(64, 64), f"layer{i}.b": torch.randn(64)}
        st.save_file(tensors, ckpt / name)
        weight_map.update({k: name for k in tensors})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    monkeypatch.chdir(tmp_path)
    root = logging.getLogger()
    handlers = list(root.handlers)
    yield tmp_path
    # Examples configure logging; leave the process as it was.
    logging.getLogger("safeload").setLevel(logging.NOTSET)
    root.handlers[:] = handlers


def test_readme_has_examples():
    assert _python_blocks(README), "README.md has no ```python example"
    assert len(EXAMPLES) >= 6, [(page, index) for page, index, _ in EXAMPLES]


@pytest.mark.parametrize(("page", "index", "code"), EXAMPLES, ids=[f"{page}#{index}" for page, index, _ in EXAMPLES])
def test_readme_example_runs(workdir, page, index, code):
    exec(compile(code, f"{page} block {index}", "exec"), {"__name__": f"readme_{index}"})
    assert os.getcwd() == str(workdir)


def _prose(text):
    """The page without fenced blocks and inline code, where `[x](y)` is code, not a link."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _headings_with_code(page):
    """Headings as written, inline code included (its text is part of the anchor)."""
    fence = False
    for line in page.read_text(encoding="utf-8").split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            yield line.lstrip("#").strip()


def _slugs(page):
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in _headings_with_code(page)}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in _slugs(file):
            broken.append(f"{target}: no heading #{anchor} in {_name(file)}")
    assert not broken, f"{_name(page)}: " + "; ".join(broken)


def test_readme_links_every_docs_page():
    links = re.findall(r"\]\((docs/[^)\s]+)\)", _prose(README.read_text(encoding="utf-8")))
    assert {link.partition("#")[0] for link in links} >= {_name(page) for page in PAGES[1:]}, "a docs page README does not link"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def _layout_files():
    """The files docs/layout.md's tree names, as paths from the repository's root (a folder's
    entries are indented beneath it)."""
    listed, folders = set(), []
    for line in (ROOT / "docs" / "layout.md").read_text(encoding="utf-8").splitlines():
        found = re.match(r"^( *)([\w.\-/]+)(?:\s|$)", line)
        if not found or not re.search(r"\w", found.group(2)):
            continue
        indent, name = len(found.group(1)), found.group(2)
        while folders and folders[-1][0] >= indent:
            folders.pop()
        path = "".join(f for _, f in folders) + name
        if name.endswith("/"):
            folders.append((indent, name))
        listed.add(path)
    return listed


def test_layout_lists_every_source_file():
    listed = _layout_files()
    sources = [p for folder in ("src", "python/safeload") for p in (ROOT / folder).rglob("*")
               if p.suffix in (".rs", ".py", ".pyi") and "__pycache__" not in p.parts]
    assert sources and "src/read/engine.rs" in listed
    assert sorted(_name(p) for p in sources if _name(p) not in listed) == []
