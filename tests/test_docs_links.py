"""Every relative link in the README and docs/ leads somewhere.

A link `[text](path)` or `![alt](path)` must name a file or folder of the repository, and a
`#fragment` must match a heading of the target page (GitHub's anchors), so a renamed page,
module or heading breaks the suite instead of a reader's click. Links to other sites are not
fetched (CI has no network). Code blocks and inline code are not links.
"""

import pathlib
import re

import pytest


def _repository_root() -> pathlib.Path:
    # Found by pyproject.toml rather than a fixed depth, so the file may move with the tests.
    for folder in pathlib.Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError("no pyproject.toml above tests/: cannot find the repository root")


ROOT = _repository_root()
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target), with an optional "title"; text may hold `code` and [brackets].
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    inside = None
    for number, line in enumerate(text.splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            if inside is None:
                inside = fence.group(1)
            elif fence.group(1) == inside:
                inside = None
            continue
        if inside is None:
            yield number, line


def links(text: str):
    """(line number, target) of every link in the prose of a Markdown page."""
    for number, line in prose_lines(text):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            yield number, definition.group(1)
            continue
        for match in INLINE_LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set:
    """Every heading's anchor on a page; a repeated one gets -1, -2, ... as on GitHub."""
    seen, result = {}, set()
    for _, line in prose_lines(text):
        heading = HEADING.match(line)
        if not heading:
            continue
        base = anchor(heading.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: pathlib.Path, root: pathlib.Path) -> list:
    """'LINE: TARGET: why' for each link on `page` that leads nowhere."""
    problems = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if SCHEME.match(target):
            continue
        path_part, _, fragment = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        if root.resolve() not in (destination, *destination.parents):
            problems.append(f"{number}: {target}: leads outside the repository")
        elif not destination.exists():
            problems.append(f"{number}: {target}: no such file or folder ({destination.relative_to(root.resolve())})")
        elif (
            fragment
            and destination.suffix == ".md"
            and fragment not in anchors(destination.read_text(encoding="utf-8"))
        ):
            problems.append(f"{number}: {target}: no heading with anchor #{fragment} in {destination.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_resolves(page):
    problems = broken_links(page, ROOT)
    assert not problems, f"{page.relative_to(ROOT)} has links that lead nowhere:\n" + "\n".join(problems)


def test_the_check_finds_what_is_broken(tmp_path):
    (tmp_path / "other.md").write_text("# A `code` heading, with punctuation\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[fine](other.md#a-code-heading-with-punctuation) [second](other.md#twice-1) [web](https://x.org/y)\n"
        "[missing file](nowhere.md) ![missing image](pictures/none.png)\n"
        "[missing heading](other.md#twice-2) [own heading](#nothing-here)\n"
        "`[not a link](nowhere.md)`\n"
        "```\n[in a code block](nowhere.md)\n```\n"
        "[defined]: ../../outside.md\n"
    )
    problems = broken_links(page, tmp_path)
    assert [problem.split(":")[0] for problem in problems] == ["2", "2", "3", "3", "8"], problems
    assert "nowhere.md" in problems[0] and "pictures/none.png" in problems[1]
    assert "#twice-2" in problems[2] and "#nothing-here" in problems[3]
    assert "outside the repository" in problems[4]


ISSUE_NUMBER = re.compile(r"\bissues?[ -]?#?\d+", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_headings_name_features_not_issue_numbers(page):
    """A reader meets a heading (and links to its anchor) by feature; an internal issue number means nothing to them."""
    numbered = [
        f"{number}: {line.strip()}"
        for number, line in prose_lines(page.read_text(encoding="utf-8"))
        if HEADING.match(line) and ISSUE_NUMBER.search(line)
    ]
    assert not numbered, f"{page.relative_to(ROOT)} has headings that name issue numbers:\n" + "\n".join(numbered)


UNINSTALLABLE = re.compile(r"pip install (-U )?['\"]?flexpar\[")


def test_install_commands_are_ones_that_work_from_the_checkout():
    """flexpar is not on PyPI: `pip install flexpar[hf]` fails; every page, example and message says
    `pip install -e ".[hf]"` (from the checkout) instead."""
    files = [*PAGES, *(ROOT / "examples").glob("*.py"), *(ROOT / "flexpar").rglob("*.py")]
    wrong = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if UNINSTALLABLE.search(line)
    ]
    assert not wrong, "install commands that fail (flexpar is installed from its checkout):\n" + "\n".join(wrong)


DETERMINISM_COST = re.compile(r"(?:step time (\d\.\d-\d\.\dx)|(\d\.\d-\d\.\dx) the step time)")


def test_readme_and_guide_give_the_deterministic_modes_one_measured_cost_linked():
    """They said 1.4-1.6x and 1.4-1.8x: one figure, the one docs/benchmarks.md measured, linked from both."""
    figures = {}
    for page in (ROOT / "README.md", ROOT / "docs" / "guide.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        found = {next(group for group in match.groups() if group) for match in DETERMINISM_COST.finditer(text)}
        assert found, f"{page.name} states no step-time cost of deterministic=True"
        assert "benchmarks.md#bit-for-bit-training-determinismpy" in text, page.name
        figures[page.name] = found
    assert len(set().union(*figures.values())) == 1, figures
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "whose true gradient is zero" in readme, "what float summation order means for a zero gradient"


def test_the_readme_demo_caption_says_what_the_demo_schedules():
    """The caption said the device joins "at about step 30"; the demo asks for it at steps // 5 and it
    joins once warm, which the late join's cause (a fresh process's start-up) explains."""
    import inspect

    from flexpar import demo

    steps = inspect.signature(demo.main).parameters["steps"].default
    caption = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split("*The demo's timeline")[1].split())
    caption = caption.split("*")[0]
    assert f"at step {max(1, steps // 5)}," in caption and f"at step {max(2, steps * 3 // 4)} lands there" in caption
    assert "once it is warm" in caption or "after it is warm" in caption
