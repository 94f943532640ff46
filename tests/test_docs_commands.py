"""The commands the README and the guides under docs/ show are run, so no sentence goes stale.

A fenced block is runnable when the line right before its fence is ``<!-- runnable -->`` (an HTML
comment: GitHub shows nothing of it, and the fence keeps its ``bash`` highlighting). Each such
block runs as one slow test, with ``bash -e -o pipefail``, in a fresh working directory that looks
like the repository root: every top-level entry of the checkout but ``outputs/`` is linked into
it, so ``conf/...`` and ``scripts/...`` resolve, while what the commands write (``outputs/``,
``runs/...``) stays in the temporary directory. ``RLORCH_HOME`` comes from ``tests/conftest.py``,
as for every other test that starts ``rlorch``; each run starts its own fork server, as it does
for a reader.

A block whose fence is preceded by ``<!-- file: PATH -->`` is a file the page asks the reader to
write (an environment, a reward module): it is written at PATH in the working directory of every
runnable block of the same page, exactly as shown.

Only commands that run on CPU in seconds are marked: nothing that needs a GPU, SGLang, a Ray
cluster, the network or minutes of time.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"
FILE_MARK = re.compile(r"^\s*<!-- file: (\S+) -->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
# The first word of every runnable block: a typo'd or renamed command is caught without running it.
KNOWN_COMMANDS = {"rlorch", "python3", "python", "cat", "ls", "mkdir", "printf"}
# Written by scripts/gen_config_docs.py (another engineer's file): linked before it may exist here.
GENERATED = {ROOT / "docs" / "configuration.md"}
BLOCK_TIMEOUT_S = 300
MIN_RUNNABLE_BLOCKS = 10


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    info: str
    code: str
    marker: str | None  # "runnable", "file:PATH" or None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def fenced_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        opened = FENCE.match(lines[index])
        if opened is None:
            index += 1
            continue
        indent, fence, info = opened.groups()
        body: list[str] = []
        end = index + 1
        while end < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[end]):
            body.append(lines[end][len(indent):] if lines[end].startswith(indent) else lines[end].lstrip())
            end += 1
        before = lines[index - 1].strip() if index > 0 else ""
        marker = None
        if before == RUNNABLE:
            marker = "runnable"
        elif FILE_MARK.match(before):
            marker = "file:" + FILE_MARK.match(before).group(1)
        blocks.append(Block(page, index + 1, info.strip(), "\n".join(body) + "\n", marker))
        index = end + 1
    return blocks


def runnable_blocks() -> list[Block]:
    return [block for page in PAGES for block in fenced_blocks(page) if block.marker == "runnable"]


def page_files(page: Path) -> dict[str, str]:
    return {block.marker[len("file:"):]: block.code for block in fenced_blocks(page)
            if block.marker and block.marker.startswith("file:")}


def first_command(code: str) -> str:
    for line in code.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.split()[0]
    return ""


def like_the_repository_root(workdir: Path) -> None:
    for entry in ROOT.iterdir():
        if entry.name in {"outputs", ".git"}:
            continue
        (workdir / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())


def run_block(block: Block, workdir: Path) -> subprocess.CompletedProcess:
    like_the_repository_root(workdir)
    for relative, content in page_files(block.page).items():
        target = workdir / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    script = workdir / ".doc-block.sh"
    script.write_text(block.code)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(["bash", "-e", "-o", "pipefail", str(script)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda block: block.id)
def test_a_documented_command_runs(block, tmp_path):
    result = run_block(block, tmp_path)
    assert result.returncode == 0, (
        f"{block.id}: the documented command failed with exit status {result.returncode}\n"
        f"--- block ---\n{block.code}--- stdout (tail) ---\n{result.stdout[-4000:]}\n"
        f"--- stderr (tail) ---\n{result.stderr[-4000:]}")


def test_the_pages_mark_their_runnable_commands():
    blocks = runnable_blocks()
    assert len(blocks) >= MIN_RUNNABLE_BLOCKS, [block.id for block in blocks]
    for block in blocks:
        assert block.info.split()[:1] == ["bash"], f"{block.id}: a runnable block is a ```bash fence"
        assert first_command(block.code) in KNOWN_COMMANDS, (
            f"{block.id}: starts with {first_command(block.code)!r}, not one of {sorted(KNOWN_COMMANDS)}")
    assert any(block.page.name == "README.md" for block in blocks), "the README has no runnable command"


def test_every_marker_sits_on_a_fence():
    """A marker one line too high (or a typo in it) would silently leave its command unrun."""
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        for number, line in enumerate(lines, 1):
            text = line.strip()
            if not (text.startswith("<!--") and ("runnable" in text or text[4:].strip().startswith("file"))):
                continue
            assert text == RUNNABLE or FILE_MARK.match(line), f"{page.name}:{number}: malformed marker {text!r}"
            following = lines[number] if number < len(lines) else ""
            assert FENCE.match(following), f"{page.name}:{number}: marker not followed by a fence"


def test_a_broken_command_fails_its_block(tmp_path):
    """The runner reports a failing command (and does not stop at the first line that succeeds)."""
    block = Block(ROOT / "README.md", 0, "bash", "rlorch --version\nrlorch no-such-command\n", "runnable")
    assert run_block(block, tmp_path).returncode != 0


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img [^>]*src=\"([^\"]+)\"")


def relative_links(page: Path) -> list[tuple[int, str]]:
    found = []
    in_fence = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for match in LINK.finditer(re.sub(r"`[^`]*`", "", line)):
            target = match.group(1) or match.group(2)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s), mailto, an anchor on the same page
            found.append((number, target.split("#")[0]))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    for number, target in relative_links(page):
        path = (page.parent / target).resolve()
        if path in GENERATED and not path.exists():
            continue  # generated by another script; its own test checks it
        assert path.exists(), f"{page.relative_to(ROOT)}:{number}: link to {target} does not resolve"


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target).resolve() for _, target in relative_links(ROOT / "README.md")}
    missing = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 200
