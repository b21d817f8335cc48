# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The README and the docs/ pages: the README stays a short guide with the two
commands ``.ci/run`` reads, docs/patches.md's generated blocks are current,
every relative link (and its heading anchor) resolves, and every repository
path a page names in code exists.

Each check takes the files it reads and returns its violations; each runs on
this repository and is shown to fail on a deliberately broken tree.
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_dcp_geometry.patches import PATCH_MODULES
from vllm_dcp_geometry.tooling.docs.patch_index import (
    PATCH_INDEX,
    PATCH_TABLE,
    declarations,
    generated_block,
    github_anchor,
    marked_test_modules,
    patch_index_markdown,
    render_patches_page,
)

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PATCHES_PAGE = REPO / "docs" / "patches.md"
README_MAX_LINES = 200
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
CODE_SPAN = re.compile(r"`([^`]*)`", re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:vllm_dcp_geometry|tools|benchmarks|docs)/[\w./*-]*"
    r"|tests/(?:test_[\w*]*\.py|gpu/[\w.*]*|support/[\w.*]*|conftest\.py))"
)
"""A path into this repository inside a code span (vLLM's own ``tests/v1/...``
and placeholders such as ``<date>`` are not matched)."""


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """The fragments GitHub gives the page's headings (repeats numbered)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", text).splitlines():
        if not line.startswith("#"):
            continue
        slug = github_anchor(line.lstrip("#"))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def link_problems(files: list[Path]) -> list[str]:
    """Relative links whose file or heading does not exist."""
    problems = []
    for page in files:
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                problems.append(f"{page.name}: link to {target}: no such file")
            elif (
                fragment
                and linked.suffix == ".md"
                and fragment not in anchors(linked.read_text(encoding="utf-8"))
            ):
                problems.append(f"{page.name}: link to {target}: no such heading")
    return problems


def path_problems(root: Path, files: list[Path]) -> list[str]:
    """Repository paths named in code spans that match nothing."""
    problems = []
    for page in files:
        text = FENCE.sub("", page.read_text(encoding="utf-8"))
        for span in CODE_SPAN.findall(text):
            for path in REPO_PATH.findall(span):
                if not any(root.glob(path.rstrip("/"))):
                    problems.append(f"{page.name}: `{path}` does not exist")
    return problems


def marked_command(text: str, marker: str) -> str:
    """The first line after ``marker`` that is not a fence, as ``.ci/run``'s
    awk reads it."""
    lines = text.splitlines()
    rest = lines[lines.index(marker) + 1 :]
    return next(line for line in rest if not line.startswith("```"))


# README.md ------------------------------------------------------------------------


def test_readme_is_a_short_guide() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"README.md does not link {page.name}"


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert marked_command(text, "<!-- main-command -->") == (
        "python3 -m venv .venv && .venv/bin/pip install -e . && "
        ".venv/bin/vllm-dcp-geometry replay"
    )
    assert marked_command(text, "<!-- test-command -->") == (
        "python3 -m venv .venv && .venv/bin/pip install uv && "
        ".venv/bin/uv pip install --python .venv/bin/python --compile-bytecode "
        "-e '.[test]' && "
        ".venv/bin/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile "
        "&& .venv/bin/python tools/test_release.py 0.34.0"
    )


# Links and paths ------------------------------------------------------------------


def test_every_link_and_path_resolves() -> None:
    assert link_problems(pages(REPO)) == []
    assert path_problems(REPO, pages(REPO)) == []


def test_broken_links_and_paths_are_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Its part\n")
    (tmp_path / "README.md").write_text(
        "# Guide\n\n[ok](docs/a.md#its-part) [self](#guide) [web](https://x.y)\n"
        "[gone](docs/b.md) [no heading](docs/a.md#other) [no self](#nothing)\n"
        "`[not a link](docs/c.md)` and `vllm_dcp_geometry/nowhere.py`\n"
    )
    assert link_problems(pages(tmp_path)) == [
        "README.md: link to docs/b.md: no such file",
        "README.md: link to docs/a.md#other: no such heading",
        "README.md: link to #nothing: no such heading",
    ]
    assert path_problems(tmp_path, pages(tmp_path)) == [
        "README.md: `docs/c.md` does not exist",
        "README.md: `vllm_dcp_geometry/nowhere.py` does not exist",
    ]


def test_repeated_headings_get_numbered_anchors() -> None:
    assert anchors("# `worker.flash_attn`\n## Tests\n## Tests\n```\n# no\n```\n") == {
        "workerflash_attn",
        "tests",
        "tests-1",
    }


# docs/patches.md ------------------------------------------------------------------


def test_patches_page_is_current() -> None:
    """Regenerate it with ``python tools/update_docs.py``."""
    text = PATCHES_PAGE.read_text(encoding="utf-8")
    assert render_patches_page(text, REPO / "tests") == text


def test_a_stale_patches_page_is_found() -> None:
    text = PATCHES_PAGE.read_text(encoding="utf-8")
    index = generated_block(text, PATCH_INDEX)
    stale = text.replace(index, index.replace("| replaces |", "| relies on |", 1))
    assert stale != text
    assert render_patches_page(stale, REPO / "tests") == text
    table = generated_block(text, PATCH_TABLE)
    assert render_patches_page(text.replace(table, ""), REPO / "tests") == text


def test_index_gives_every_symbol_its_patch_partners_and_tests() -> None:
    index = generated_block(PATCHES_PAGE.read_text(encoding="utf-8"), PATCH_INDEX)
    found = declarations()
    assert len(found) == len(PATCH_MODULES)
    tests = marked_test_modules(REPO / "tests")
    for d in found:
        link = f"[`{d.name}`](#{github_anchor(f'`{d.name}`')})"
        for role, qualnames in (
            ("replaces", d.replaces),
            ("relies on", d.relies_on),
            ("adds", d.adds),
        ):
            for qualname in qualnames:
                row = f"| `{qualname}` | `{d.upstream_module}` | {role} | {link} |"
                assert row in index, row
        section = index.split(f"### `{d.name}`\n", 1)[1].split("\n### ", 1)[0]
        for partner in d.remove_with:
            assert f"[`{partner}`]" in section, (d.name, partner)
        assert tests[d.name], f"{d.name}: no test module names it"
        for path in tests[d.name]:
            assert f"[`{path}`](../{path})" in section, (d.name, path)


def test_tests_are_read_from_their_markers(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "gpu").mkdir(parents=True)
    (tests / "test_a.py").write_text(
        "import pytest\n"
        'pytestmark = [pytest.mark.slow, pytest.mark.patches("worker.utils")]\n'
    )
    (tests / "gpu" / "test_b.py").write_text(
        "import pytest\n"
        "NAME = 'worker.block_table'\n"
        '@pytest.mark.patches("worker.utils", NAME)\n'
        "def test_x(): pass\n"
    )
    (tests / "helper.py").write_text('pytest.mark.patches("worker.flash_attn")\n')
    assert marked_test_modules(tests) == {
        "worker.utils": ("tests/gpu/test_b.py", "tests/test_a.py")
    }
    index = patch_index_markdown(tests)
    assert "- tests (0): none" in index
    assert "- tests (2): [`tests/gpu/test_b.py`](../tests/gpu/test_b.py)" in index
